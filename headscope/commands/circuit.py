"""circuit(): which components feed which, for prompt pairs: every edge's attribution score (EAP or EAP-IG) and every
component's direct logit attribution, each the mean over pairs with a paired bootstrap interval.

    the graph      senders embed, L.H, mlpL; receivers L.H (q), L.kvG (k, v), mlpL, logits (interventions/edges.py)
    the scores     eap: the gradient at the clean run; eap-ig (default): averaged over `steps` interpolated inputs
    the check      the `verify` strongest edges patched exactly, one at a time
    the circuits   the strongest edges at sizes from 0.1% to 50% of them, every other edge carrying the corrupt
                   prompt's sender: the faithfulness curve, CPR, CMD and the smallest circuit that reaches `target`
    the output     edges.parquet (every edge, ranked by |score|), nodes.parquet (each component's DLA), circuit.json,
                   circuit.html (the graph, the curve and the strongest edges)

Refused in one line (docs/circuit.md says so): attention beside the MLP, residual multipliers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.arguments import as_number, as_path, head_name
from headscope.commands import circuit_why
from headscope.commands.circuit_resume import CircuitCheckpoint
from headscope.config import CHART_FORMATS, CIRCUIT_SELECTIONS, RunConfig
from headscope.errors import ConfigError
from headscope.estimates import MIN_BOOTSTRAP_SENTENCES, percentile_interval, replicate_ratios
from headscope.interventions.edge_graph import (
    CURVE_SHARES,
    circuit_size,
    curve_areas,
    faithfulness,
    greedy_edges,
    outside,
    ranked_edges,
)
from headscope.interventions.edges import DEFAULT_STEPS, METHODS, EdgeModel, EdgeScores
from headscope.interventions.pairs import as_pairs, common_roles, tokenize_pairs
from headscope.layout import CIRCUIT_PAGE, CIRCUIT_RECORD, CIRCUIT_WHY_FILE, EDGES_BY_ROLE_FILE, EDGES_FILE, NODES_FILE
from headscope.model.capture import attached
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.progress import Reporter
from headscope.report.circuit_page import circuit_page
from headscope.report.page import write_view
from headscope.report.report import Report
from headscope.run.distributed import ONE_PROCESS, Ranks, gather, share_of, together
from headscope.run.record import fingerprint
from headscope.run.setup import MODEL_AND_CORPUS, CommandRun, record_header
from headscope.summary import model_name
from headscope.tables import write_frame, write_json

EDGE_BLOCK = 4096  # edges bootstrapped at once: (replicates, EDGE_BLOCK) float64 at a time
DEFAULT_VERIFY = 10  # the strongest edges patched exactly
DEFAULT_TARGET = 0.8  # the faithfulness the smallest circuit must reach
UNMARKED = "(unmarked)"  # edges_by_role's bucket of the positions no role marks (no role name has parentheses)


@dataclass
class Circuit:
    """What `circuit` measured: `edges` is edges.parquet, `nodes` nodes.parquet, `record` circuit.json."""

    edges: pd.DataFrame
    nodes: pd.DataFrame
    record: dict
    folder: Path | None = None
    by_role: pd.DataFrame | None = None  # edges_by_role.parquet, with by_role
    why: pd.DataFrame | None = None  # why.parquet, with why

    def top(self, count: int = 10) -> pd.DataFrame:
        """The `count` strongest edges (largest |score|)."""
        return self.edges.nsmallest(count, "rank")

    def __repr__(self) -> str:
        return f"Circuit(model={model_name(self.record)!r}, {len(self.edges)} edges, {self.record['method']})"

    def _repr_html_(self) -> str:
        """In a notebook: the settings, the strongest edges and the components that write most of m."""
        from headscope.report.notebook import block, facts, table

        record = self.record
        top = self.top(10)
        edges = [(r.sender, r.receiver, r.channel, r.score, r.score_ci_low, r.score_ci_high) for r in top.itertuples()]
        strongest = self.nodes.reindex(self.nodes["dla"].abs().sort_values(ascending=False).index).head(10)
        nodes = [(r.node, r.dla, r.dla_ci_low, r.dla_ci_high) for r in strongest.itertuples()]
        return block(
            f"headscope circuit: {model_name(record)}",
            facts(
                [
                    ("method", record["method"]),
                    ("pairs", record["pairs"]["count"]),
                    ("mean m (clean, corrupt)", f"{record['m']['clean']:.3f}, {record['m']['corrupt']:.3f}"),
                ]
            ),
            table(["sender", "receiver", "channel", "score", "95% low", "95% high"], edges),
            table(["component", "DLA", "95% low", "95% high"], nodes),
        )

    def to_html(self) -> str:
        return self._repr_html_()


def circuit(
    model: str | LoadedModel,
    pairs: str | Path | Sequence[dict],
    *,
    method: str = METHODS[0],
    steps: int = DEFAULT_STEPS,
    verify: int = DEFAULT_VERIFY,
    target: float = DEFAULT_TARGET,
    curve: bool = True,
    selection: str = CIRCUIT_SELECTIONS[0],
    by_role: bool = False,
    why: int = 0,
    report: str | Path | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    resume: bool = False,
    charts: str | None = CHART_FORMATS[0],
    page: bool = True,
    config: RunConfig | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Circuit:
    """Every edge's attribution score and every component's direct logit attribution on the pairs' metric
    (logit[answer] - logit[distractor] at the last position), written to `out` when given.

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model (with its LM head).
        pairs: a .jsonl/.csv/.tsv file or a list of dicts (clean, corrupt, answer, distractor), as patch takes.
        method: "eap-ig" (gradients averaged over `steps` inputs between the corrupt and the clean prompt) or "eap"
            (the gradient at the clean run).
        steps: EAP-IG's interpolation steps (at least 1).
        verify: how many of the strongest edges are patched exactly, one at a time (0: none).
        target: the faithfulness (in (0, 1]) the smallest circuit must reach.
        curve: measure the faithfulness curve (nine patched passes over the pairs).
        selection: how the curve's circuits take edges: "top" (the strongest |score| first) or "greedy" (MIB's
            greedy growth from the logits: the strongest edge into a node already in the circuit).
        by_role: each edge's score at each role marked in the pairs ([[IO:Mary]]; END, the last token, is every
            pair's) too: edges_by_role.parquet.
        why: explain, for the heads the `why` strongest q and k edges feed, their attention at END to each marked
            role's token, clean against corrupt (the pairs must mark roles): why.parquet (docs/why.md).
        report: a report of this model, for each head's role.
        out: the folder to write; None keeps the result in memory.
        overwrite: replace `out` if this command wrote it before.
        resume: continue an interrupted run into `out` from its checkpoint (its edge scores and the edge sets patched
            so far: commands/circuit_resume.py); every run into `out` keeps one until it finishes.
        charts: the chart format (the circuit as a graph, the faithfulness curve), or None.
        page: write circuit.html (the circuit as a graph, its faithfulness curve, its strongest edges).
        config: the settings as a RunConfig (max_memory, device, dtype, bootstrap, bootstrap_seed...).
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        A Circuit: edges (sender, receiver, channel, score with its interval, rank), nodes (DLA with its interval)
        and the record.
    """
    steps, verify, target = check_request(method, steps, verify, target, selection)
    why = as_number(why, "--why", whole=True)
    circuit_why.check_count(why)
    if charts is not None and charts not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {charts!r}")
    pairs = as_pairs(pairs)
    report, out = as_path(report, "report"), as_path(out, "out")
    if resume and out is None:
        raise ConfigError("--resume needs an output folder (--out): the checkpoint is kept beside it")
    run = CommandRun.prepare(model, config=config, options=options, reporter=reporter, report=report,
                             reads_corpus=False)  # fmt: skip
    run.request = {"pairs (sha256)": pairs.sha256, "method": method, "steps": steps, "verify": verify,
                   "target": target, "curve": curve, "selection": selection, "by_role": by_role,
                   "why": why, "resume": resume}  # fmt: skip
    ranks = run.data_parallel(model, "circuit")
    if pairs.path.is_file():
        run.protected["the pairs file"] = pairs.path
    settings, reporter = run.settings, run.reporter

    def pairs_fit(tokenizer, model_config) -> None:  # what the tokenizer alone refuses, before the weights load
        found = tokenize_pairs(pairs, tokenizer, settings.max_length)
        if by_role:
            common_roles(found, pairs, "--by-role")
        if why:
            circuit_why.check_roles(why, common_roles(found, pairs, "--why"))

    session = run.session(model, loader, what="circuit", out=out, kind="circuit", overwrite=overwrite, lm_head=True,
                          report=report, before_weights=pairs_fit, resumable=True, continuing=resume)  # fmt: skip
    with session as opened:
        loaded, plan = opened.loaded, opened.plan
        tokenized = tokenize_pairs(pairs, loaded.tokenizer, plan.max_length)
        roles = common_roles(tokenized, pairs, "--by-role") if by_role else None
        why_roles = common_roles(tokenized, pairs, "--why") if why else None
        extra = f", {steps} steps" if method == "eap-ig" else ""
        reporter.stage(f"scoring every edge ({method}{extra}) on {len(tokenized)} pairs")
        started = time.perf_counter()
        with attached(loaded.lm, block_bytes=settings.block_bytes) as capture:
            edges = _Dealt(EdgeModel(capture, loaded, plan), ranks, tokenized, reporter)
            saved = _checkpoint(opened, loaded, pairs, settings, ranks, resume, method, steps, roles, reporter)
            found = saved.scores(lambda: edges.scores(method=method, steps=steps, roles=roles), edges.model.graph)
            if verify > found.graph.edge_count:
                raise ConfigError(f"--verify {verify} is more than the {found.graph.edge_count:,} edges of this model")
            patch = functools.partial(saved.patched, compute=edges.patched)
            checked = _checked(patch, found, verify, curve, target, selection, reporter)
        seconds = time.perf_counter() - started
        head_roles = None if report is None else _roles(report)
        distinct = None if roles is None else _distinct_positions(tokenized, roles)
        result = _result(loaded, settings, pairs, found, method, steps, head_roles, seconds, checked, roles, distinct)
        if why and ranks.main:
            _explain(result, why, why_roles, loaded, plan, tokenized, reporter)
        if opened.folder is not None:
            write_frame(result.edges, opened.folder / EDGES_FILE)
            write_frame(result.nodes, opened.folder / NODES_FILE)
            if result.by_role is not None:
                write_frame(result.by_role, opened.folder / EDGES_BY_ROLE_FILE)
            if result.why is not None:
                write_frame(result.why, opened.folder / CIRCUIT_WHY_FILE)
            write_json(result.record, opened.folder / CIRCUIT_RECORD)
            page_of = functools.partial(circuit_page, result.edges, result.nodes, result.record)
            missed = write_view(page_of, opened.folder / CIRCUIT_PAGE) if page else None
            if missed is not None:
                reporter.warn(f"could not write {missed}; the tables and circuit.json are written")
            if charts:
                from headscope.report.circuit_charts import draw_circuit_charts

                drawn = draw_circuit_charts(result.edges, result.nodes, result.record, opened.folder, charts)
                for failed in drawn[1]:
                    reporter.warn(f"could not draw {failed}; the tables and circuit.json are written")
            saved.remove()  # only now: a run interrupted while writing keeps what --resume reads back
    result.folder = opened.target
    run.done(opened)
    return result


def _explain(result: Circuit, why: int, roles: list[str], loaded, plan, tokenized, reporter) -> None:
    """--why: the heads the `why` strongest q and k edges feed, their attention at END to each role's token split
    into senders, clean against corrupt (commands.circuit_why), into `result`."""
    heads = circuit_why.explained_heads(result.edges, why, plan.heads, plan.architecture["kv_heads"])
    names = ", ".join(head_name(*head) for head in heads)
    reporter.stage(f"explaining {len(heads)} heads' attention at END to each role's token (--why {why}): {names}")
    with attached(loaded.lm, block_bytes=plan.settings.block_bytes) as capture:
        result.why, entries = circuit_why.explain_pairs(capture, loaded, plan, tokenized, heads, roles)
    result.record["why"] = {"edges": why, "heads": [head_name(*head) for head in heads], "rows": entries}


def check_request(method: str, steps, verify=DEFAULT_VERIFY, target=DEFAULT_TARGET,
                  selection: str = CIRCUIT_SELECTIONS[0]) -> tuple[int, int, float]:  # fmt: skip
    """Refuse, before anything loads, a method circuit does not know, a step count that is not a whole number of at
    least 1, a negative --verify and a --target outside (0, 1] (a --verify beyond the edges is refused once the model
    says how many there are). Numbers of any type are taken as numbers (arguments.as_number); returns them as the
    code uses them."""
    if method not in METHODS:
        raise ConfigError(f"--method takes {', '.join(METHODS)}; got {method!r}")
    if selection not in CIRCUIT_SELECTIONS:
        raise ConfigError(f"--select takes {', '.join(CIRCUIT_SELECTIONS)}; got {selection!r}")
    steps, verify = as_number(steps, "--steps", whole=True), as_number(verify, "--verify", whole=True)
    target = as_number(target, "--target")
    if steps < 1:
        raise ConfigError(f"--steps must be a whole number of at least 1; got {steps}")
    if verify < 0:
        raise ConfigError(f"--verify must be a whole number of at least 0; got {verify}")
    if not 0 < target <= 1:
        raise ConfigError(f"--target must be in (0, 1]; got {target}")
    return steps, verify, target


@dataclass
class _Checked:
    """What the patched passes found: the verified edges' exact effects and the faithfulness curve."""

    ranked: np.ndarray  # (edges, 2): sender and receiver index, in the order the circuits take them
    exact: dict  # (sender, receiver) index -> (pairs,) m with that edge patched
    curve: list  # {"edges", "share", "faithfulness"}, from the empty circuit to the full one
    target: float
    smallest: dict | None  # the smallest curve point at or above target
    selection: str  # how the circuits took edges: top or greedy


class _Dealt:
    """An EdgeModel's passes over the pairs, under torchrun dealt round-robin to the ranks (pair i to rank i % N)
    and gathered on every rank in pair order: a pair's numbers do not depend on which rank ran it, or with which
    others. In one process, the passes over every pair. Each pass is shown as it runs (this rank's share; the bar
    gives the time left)."""

    def __init__(self, model: EdgeModel, ranks: Ranks, pairs, reporter: Reporter) -> None:
        self.model, self.ranks, self.reporter = model, ranks, reporter
        self.mine = list(share_of(ranks, pairs))
        self.ids = np.concatenate(gather(ranks, np.sort([pair.pair.pair_id for pair in self.mine])))

    def scores(self, *, method: str, steps: int, roles=None) -> EdgeScores:
        extra = f", {steps} steps" if method == "eap-ig" else ""
        self.reporter.start(len(self.mine), what=f"scoring every edge ({method}{extra})", unit="pairs")
        share = together(self.ranks, lambda: self.model.scores(self.mine, method=method, steps=steps, roles=roles,
                                                                on_batch=self.reporter.advance))  # fmt: skip
        self.reporter.finish()
        return EdgeScores.joined(gather(self.ranks, share))

    def patched(self, excluded) -> np.ndarray:
        self.reporter.start(len(self.mine) * len(excluded), what=f"patching {len(excluded)} edge sets",
                            unit="patched runs")  # fmt: skip
        share = together(self.ranks, lambda: self.model.patched(self.mine, excluded, on_batch=self.reporter.advance))
        self.reporter.finish()
        return np.concatenate(gather(self.ranks, share), axis=1)[:, np.argsort(self.ids, kind="stable")]


def _checkpoint(opened, loaded, pairs, settings, ranks, resume: bool, method: str, steps: int, roles, reporter):
    """Where this run saves its scores and patched sets as they finish (rank 0 writes), and reads an interrupted
    run's back with `resume`; in memory only (nothing saved) without an output folder."""
    folder = None if opened.stage is None else opened.stage.path
    key = fingerprint(loaded, pairs, settings, ONE_PROCESS)  # pairs: their sha256, as a corpus's
    request = {"method": method, "steps": steps if method == "eap-ig" else None, "roles": roles}
    return CircuitCheckpoint(folder, key, request, resume=resume, writes=ranks.main, notify=reporter.note)


def _checked(patch, found: EdgeScores, verify: int, curve: bool, target: float, selection: str, reporter):
    graph = found.graph
    strongest = ranked_edges(graph, found.scores.mean(0))
    ranked = strongest if selection == "top" else greedy_edges(graph, found.scores.mean(0))
    count = graph.edge_count
    masks, exact_keys = [], []
    for sender, receiver in verified_edges(graph, found, verify):
        mask = np.zeros_like(graph.edges)
        mask[sender, receiver] = True
        masks.append(mask)
        exact_keys.append((int(sender), int(receiver)))
    sizes = sorted({circuit_size(share, count) for share in CURVE_SHARES if circuit_size(share, count) < count})
    if curve:
        masks += [outside(graph, ranked, size) for size in sizes]
    if masks:
        circuits = len(sizes) if curve else 0
        reporter.stage(f"patching {len(masks)} edge sets exactly ({verify} edges, {circuits} circuits)")
    patched = patch(masks) if masks else np.zeros((0, len(found.pair_ids)))
    exact = {key: patched[i] for i, key in enumerate(exact_keys)}
    points = []
    if curve:
        points.append({"edges": 0, "share": 0.0, "faithfulness": 0.0})  # the corrupt run itself
        for size, values in zip(sizes, patched[len(exact_keys) :], strict=True):
            points.append({"edges": size, "share": size / count,
                           "faithfulness": faithfulness(values, found.clean, found.corrupt)})  # fmt: skip
        points.append({"edges": count, "share": 1.0, "faithfulness": 1.0})  # the clean run itself
    reached = [point for point in points if point["edges"] and point["faithfulness"] >= target]
    return _Checked(ranked, exact, points, target, reached[0] if reached else None, selection)


def verified_edges(graph, found: EdgeScores, verify: int) -> list[tuple[int, int]]:
    """The edges --verify patches exactly: the `verify` strongest by the run's score and, in an EAP-IG run, the
    `verify` strongest by EAP (the same pass's, found.eap) not among them: a ranking can miss an edge the other
    finds (an edge EAP ranked 685th was the second strongest when patched: issue 65)."""
    chosen = [(int(s), int(r)) for s, r in ranked_edges(graph, found.scores.mean(0))[:verify]]
    if found.eap is not None:
        taken = set(chosen)
        chosen += [(int(s), int(r)) for s, r in ranked_edges(graph, found.eap.mean(0))[:verify]
                   if (int(s), int(r)) not in taken]  # fmt: skip
    return chosen


def _roles(report) -> dict[str, str]:
    """Each head's role in `report`, by node name (L.H)."""
    return {head_name(*head): role for head, role in Report.open(report).head_roles().items()}


def _mean_and_interval(values: np.ndarray, pair_ids: np.ndarray, settings: RunConfig) -> tuple[np.ndarray, ...]:
    """(columns,) mean over pairs of (pairs, columns) values, and its paired bootstrap interval over pairs (NaN with
    fewer than MIN_BOOTSTRAP_SENTENCES pairs or without replicates)."""
    mean = values.mean(0)
    low, high = np.full_like(mean, np.nan), np.full_like(mean, np.nan)
    if settings.bootstrap and len(pair_ids) >= MIN_BOOTSTRAP_SENTENCES:
        ones = np.ones(len(pair_ids))
        for start in range(0, values.shape[1], EDGE_BLOCK):
            block = slice(start, start + EDGE_BLOCK)
            replicates = replicate_ratios(pair_ids, settings.bootstrap, settings.bootstrap_seed, values[:, block], ones)
            low[block], high[block] = percentile_interval(replicates)
    return mean, low, high


def _result(loaded, settings, pairs, found: EdgeScores, method, steps, roles, seconds, checked,
            position_roles=None, distinct=None) -> Circuit:  # fmt: skip
    """The tables and the record; with `position_roles`, edges_by_role (distinct: `_distinct_positions`)."""
    graph = found.graph
    senders, receivers = np.nonzero(graph.edges)
    per_pair = found.scores[:, senders, receivers]  # (pairs, edges)
    score, low, high = _mean_and_interval(per_pair, found.pair_ids, settings)
    edges = pd.DataFrame(
        {
            "sender": [graph.senders[i] for i in senders],
            "receiver": [graph.receivers[j][0] for j in receivers],
            "channel": [graph.receivers[j][1] for j in receivers],
            "score": score,
            "score_ci_low": low,
            "score_ci_high": high,
            "method": method,
            "rank": _ranks(score),
        }
    )
    if found.eap is not None:  # an EAP-IG run: the same pass's EAP scores and ranks, beside (--verify takes both)
        edges["score_eap"] = found.eap[:, senders, receivers].mean(0)
        edges["rank_eap"] = _ranks(edges["score_eap"].to_numpy())
    # The verified edges' exact effect: m with that edge alone patched, minus m, mean over pairs (noising, as the
    # score: corrupting the edge); the circuit: the smallest curve point that reached the target.
    position = {(int(s), int(r)): i for i, (s, r) in enumerate(zip(senders, receivers, strict=True))}
    exact = np.full(len(score), np.nan)
    for key, values in checked.exact.items():
        exact[position[key]] = float((values - found.clean).mean())
    edges["exact"] = exact
    in_circuit = np.zeros(len(score), dtype=bool)
    if checked.smallest is not None:
        for sender, receiver in checked.ranked[: checked.smallest["edges"]]:
            in_circuit[position[(int(sender), int(receiver))]] = True
    edges["in_circuit"] = in_circuit
    names = [*graph.senders, "bias"]
    dla, dla_low, dla_high = _mean_and_interval(found.dla, found.pair_ids, settings)
    nodes = pd.DataFrame({"node": names, **_placed(names), "dla": dla, "dla_ci_low": dla_low, "dla_ci_high": dla_high})
    # A node is in the circuit where one of its edges is: as a sender, or as a receiver (a KV head's channels count
    # for none of its query heads: they are nodes of their own in edges.parquet).
    touched = set(edges.loc[in_circuit, "sender"]) | set(edges.loc[in_circuit, "receiver"])
    nodes["in_circuit"] = [name in touched for name in names]
    if roles is not None:
        nodes["role"] = [roles.get(name) for name in names]
        edges["sender_role"] = [roles.get(name) for name in edges["sender"]]
    record = record_header(loaded, settings, MODEL_AND_CORPUS, None) | {
        "method": method,
        "steps": steps if method == "eap-ig" else None,
        "metric": {"name": "logit_diff", "definition": "logit[answer] - logit[distractor] at the last position"},
        "pairs": {"path": str(pairs.path), "sha256": pairs.sha256, "count": len(found.pair_ids)},
        "m": {
            "clean": float(found.clean.mean()),
            "corrupt": float(found.corrupt.mean()),
            "per_pair": [
                {"pair": int(i), "clean": float(c), "corrupt": float(r)}
                for i, c, r in zip(found.pair_ids, found.clean, found.corrupt, strict=True)
            ],
        },
        "graph": {"senders": len(graph.senders), "receivers": len(graph.receivers), "edges": graph.edge_count},
        "verified": len(checked.exact),
        "faithfulness": checked.curve,
        **_areas(checked.curve),
        "target": checked.target,
        "selection": checked.selection,
        "circuit": checked.smallest,
        "roles": position_roles,
        "bootstrap": {"replicates": settings.bootstrap, "seed": settings.bootstrap_seed, "level": 0.95},
        "seconds": round(seconds, 3),
    }
    by_role = None
    if position_roles is not None:  # (pairs, roles, edges) -> every edge at every role, its mean and interval
        parts = _role_parts(found, senders, receivers, distinct)
        mean, low, high = _mean_and_interval(parts.reshape(len(parts), -1), found.pair_ids, settings)
        count, buckets = len(senders), [*position_roles, UNMARKED]
        by_role = pd.DataFrame({
            "sender": np.tile(edges["sender"].to_numpy(), len(buckets)),
            "receiver": np.tile(edges["receiver"].to_numpy(), len(buckets)),
            "channel": np.tile(edges["channel"].to_numpy(), len(buckets)),
            "position_role": np.repeat(buckets, count),
            "score": mean, "score_ci_low": low, "score_ci_high": high,
        })  # fmt: skip
    return Circuit(edges, nodes, record, by_role=by_role)


def _ranks(scores: np.ndarray) -> np.ndarray:
    """Each edge's rank by |score|, 1 the strongest (ties in graph order, as ranked_edges orders them)."""
    rank = np.empty(len(scores), dtype=np.int64)
    rank[np.argsort(-np.abs(scores), kind="stable")] = np.arange(1, len(scores) + 1)
    return rank


def _distinct_positions(tokenized, roles: list[str]) -> np.ndarray:
    """(pairs, roles) bool, in pair order: whether the role's token is not an earlier role's in that pair (two roles
    may end on one token, a marked one on END's): the positions the by-role parts count once each."""
    return np.array([[pair.positions[role] not in {pair.positions[r] for r in roles[:i]} for i, role in
                      enumerate(roles)] for pair in sorted(tokenized, key=lambda p: p.pair.pair_id)])  # fmt: skip


def _role_parts(found: EdgeScores, senders, receivers, distinct: np.ndarray) -> np.ndarray:
    """(pairs, roles + 1, edges) float64: each edge's score at each role's position, then at every position no role
    marks (its whole score less each distinct marked position's part), so that the parts of each pair add up to the
    edge's score."""
    at_roles = found.by_role[:, :, senders, receivers].astype(np.float64)
    marked = (at_roles * distinct[:, :, None]).sum(1)
    unmarked = found.scores[:, senders, receivers] - marked
    return np.concatenate([at_roles, unmarked[:, None]], axis=1)


def _areas(curve: list[dict]) -> dict[str, float | None]:
    """CPR and CMD of the faithfulness curve (None without one)."""
    if not curve:
        return {"cpr": None, "cmd": None}
    cpr, cmd = curve_areas([point["share"] for point in curve], [point["faithfulness"] for point in curve])
    return {"cpr": cpr, "cmd": cmd}


def _placed(names: list[str]) -> dict[str, list]:
    """Each node's layer, head and kind (embed and bias have no layer; an MLP no head)."""
    layers, heads, kinds = [], [], []
    for name in names:
        if name in ("embed", "bias"):
            layers.append(None), heads.append(None), kinds.append(name)
        elif name.startswith("mlp"):
            layers.append(int(name[3:])), heads.append(None), kinds.append("mlp")
        else:
            layer, head = name.split(".")
            layers.append(int(layer)), heads.append(int(head)), kinds.append("head")
    return {"layer": pd.array(layers, dtype="Int64"), "head": pd.array(heads, dtype="Int64"), "kind": kinds}
