"""patch(): which heads carry a behaviour? Activation patching of each head on prompt pairs.

    the pairs      clean and corrupt prompts of the same length, and the answer and distractor tokens
                   (interventions/pairs.py); the metric m = logit[answer] - logit[distractor] at the last position
    the patch      one head's output (`output`), its attention probabilities (`pattern`), the values it reads
                   (`values`), its query (`q`) or its key (`k`) taken from the other prompt of the pair, at every
                   position, one at a time, or one marked role at a time
    the effect     denoise: (mean m_patched - mean m_corrupt) / (mean m_clean - mean m_corrupt), patching into the
                   corrupt prompt (1: the head alone restores the behaviour); noise: (mean m_clean - mean
                   m_patched) / the same gap, patching into the clean prompt (1: the head alone destroys it); a 95%
                   paired bootstrap interval over pairs
    the output     patching.parquet, patching_pairs.parquet, patch.json, patch_heatmap and patch_positions charts

interventions/patching.py does the passes (exact, or --fast's first-order estimate).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from headscope.arguments import as_heads, as_path
from headscope.config import CHART_FORMATS, PATCH_DIRECTIONS, PATCH_METRICS, PATCH_POSITIONS, PATCH_WHATS, RunConfig
from headscope.errors import ConfigError, CorpusError
from headscope.estimates import ONE_SENTENCE_NOTE
from headscope.interventions.pairs import PairsFile, TokenizedPair, as_pairs, common_roles, tokenize_pairs
from headscope.interventions.patching import (
    METRICS,
    PROJECTED,
    PairRecorder,
    ProjectionPatch,
    Unit,
    attributed_metrics,
    beyond_parts,
    exact_metrics,
    kept_logits,
    metric_of,
    pair_batches,
    patch_effects,
)
from headscope.layout import PATCH_RECORD, PATCHING_FILE, PATCHING_PAIRS_FILE
from headscope.model.capture import attached
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.progress import Reporter
from headscope.report.report import Report
from headscope.run.distributed import one_process_only
from headscope.run.feed import token_texts
from headscope.run.setup import MODEL_AND_CORPUS, CommandRun, record_header
from headscope.summary import strongest_positions
from headscope.tables import write_frame, write_json

PATCH_SETTINGS = tuple(name for name in (*MODEL_AND_CORPUS, "bootstrap", "bootstrap_seed", "batch_size", "layers")
                       if name not in ("text_column", "encoding_errors"))  # fmt: skip
NO_DIFFERENCE = 1e-6  # a pair whose clean and corrupt metrics differ by less than this is flagged


@dataclass
class Patching:
    """What `patch` measured: `effects` is patching.parquet, `per_pair` patching_pairs.parquet, `record`
    patch.json."""

    effects: pd.DataFrame
    per_pair: pd.DataFrame
    record: dict
    folder: Path | None = None
    notes: list[str] = field(default_factory=list)

    def top(self, count: int = 10) -> pd.DataFrame:
        """The `count` rows of largest |effect|."""
        order = self.effects["effect"].abs().fillna(-1).sort_values(ascending=False).index
        return self.effects.loc[order[:count]]

    def __repr__(self) -> str:
        return f"Patching(model={self.record.get('model', {}).get('input')!r}, {len(self.effects)} effects)"

    def _repr_html_(self) -> str:
        """In a notebook: the settings, every head's effect as a heatmap, and the ten largest effects (three
        decimals each, as the printout gives them)."""
        from headscope.report.notebook import block, effect_grid, facts, table

        record = self.record
        top = self.top(10)
        metric = record.get("metric") or {}
        shown = [("what", record.get("what")), ("direction", record.get("direction")),
                 ("positions", record.get("positions")),
                 ("metric", f"{metric.get('name', '')} = {metric.get('definition', '')}")]  # fmt: skip
        rows = []
        for row in top.itertuples(index=False):
            low, high = row.effect_ci_low, row.effect_ci_high
            cells = [row.layer, row.head, *([row.position] if "position" in top.columns else [])]
            cells += ["" if pd.isna(row.effect) else f"{row.effect:+.3f}",
                      "" if pd.isna(low) else f"[{low:+.3f}, {high:+.3f}]"]  # fmt: skip
            rows.append([*cells, *([row.role] if "role" in top.columns else [])])
        columns = ["layer", "head", *(["position"] if "position" in top.columns else []), "effect", "95% interval"]
        columns += ["role"] if "role" in top.columns else []
        architecture = record.get("model", {}).get("architecture", {})
        return block(
            f"headscope patching: {self.record.get('model', {}).get('input', '')}",
            facts(shown),
            effect_grid(strongest_positions(self.effects), architecture.get("layers"), architecture.get("heads")),
            table(columns, rows, caption="the largest effects"),
        )

    def to_html(self) -> str:
        return self._repr_html_()


UNMEASURED = "not measured"  # the role column of a head the --report did not measure


def patch(
    model: str | LoadedModel,
    pairs: str | Path | Sequence[dict],
    *,
    what: str = "output",
    direction: str = "denoise",
    positions: str = "all",
    heads: Sequence = (),
    metric: str = "logit_diff",
    fast: bool = False,
    parts: bool = False,
    report: str | Path | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    charts: str | None = CHART_FORMATS[0],
    config: RunConfig | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Patching:
    """Each head's effect on the pairs' metric when patched from the other prompt (written to `out` when given).

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model (with its LM head).
        pairs: a .jsonl/.csv/.tsv file or a list of dicts (clean, corrupt, answer, distractor).
        what: "output", "pattern", "values", "q" or "k": which activation of the head is patched (q, k: its query or
            key projection's output; k is its KV head's, shared by a grouped-KV model's query heads).
        direction: "denoise" (clean into corrupt) or "noise" (corrupt into clean).
        positions: "all" at once, "each" position apart, or "roles": each role marked in the pairs ([[IO:Mary]]) at
            its own position in each pair.
        heads: (layer, head) pairs to patch (default: every head of the layers in `options["layers"]`, else every
            head).
        metric: "logit_diff": logit[answer] - logit[distractor] at the last position.
        fast: first-order estimates (attribution patching) instead of a pass per patch.
        parts: with what="output", patch each head's pattern and values too: their effects and how far the
            output's effect goes beyond their sum (beyond_parts, with its interval).
        report: a report of this model, for each head's role.
        out: the folder to write; None keeps the result in memory.
        overwrite: replace `out` if this command wrote it before.
        charts: the chart format, or None.
        config: the settings as a RunConfig (layers, max_memory, device, dtype, bootstrap, bootstrap_seed,
            padding_side...).
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        A Patching: each head's effect with its interval, the per-pair values, and the record.
    """
    heads = as_heads(heads) if heads else ()
    check_request(what, direction, positions, metric, fast, charts, parts)
    pairs = as_pairs(pairs)
    report = as_path(report, "report")
    one_process_only("patch")
    run = CommandRun.prepare(model, config=config, options=options, reporter=reporter, report=report,
                             reads_corpus=False)  # fmt: skip
    if heads and run.settings.layers is not None:
        raise ConfigError("pass --heads or --layers, not both")
    if pairs.path.is_file():
        run.protected["the pairs file"] = pairs.path
    settings, reporter = run.settings, run.reporter

    def pairs_fit(tokenizer, model_config) -> None:  # what the tokenizer alone refuses, before the weights load
        found = tokenize_pairs(pairs, tokenizer, settings.max_length)
        if positions == "each":
            _common_length(found, pairs)
        elif positions == "roles":
            common_roles(found, pairs)

    session = run.session(model, loader, what="patch", out=out, kind="patching", overwrite=overwrite, lm_head=True,
                          report=report, before_weights=pairs_fit)  # fmt: skip
    with session as opened:
        loaded, plan = opened.loaded, opened.plan
        head_roles = _roles(report)
        plan.check_heads(heads)
        tokenized = tokenize_pairs(pairs, loaded.tokenizer, plan.max_length)
        roles = common_roles(tokenized, pairs) if positions == "roles" else None
        width = _common_length(tokenized, pairs) if positions == "each" else None if roles is None else len(roles)
        units = _units(plan, heads, width)
        unit_name = "heads" if width is None else "head positions" if roles is None else "head roles"
        reporter.stage(f"patching {len(units):,} {unit_name} ({what}, {direction}"
                       f"{', first-order estimate' if fast else ''}) on {len(tokenized)} pairs")  # fmt: skip
        started = time.perf_counter()
        with attached(loaded.lm, block_bytes=settings.block_bytes) as capture:
            found = _measure(capture, plan, loaded, tokenized, units, what, direction, width, roles,
                             METRICS[metric], fast, reporter)  # fmt: skip
            apart = {}
            for part in ("pattern", "values") if parts else ():
                reporter.stage(f"patching the same {unit_name}' {part} (--parts)")
                apart[part] = _measure(capture, plan, loaded, tokenized, units, part, direction, width, roles,
                                       METRICS[metric], fast, reporter)  # fmt: skip
        seconds = time.perf_counter() - started
        result = _result(loaded, settings, pairs, tokenized, units, found, what, direction, positions, metric, fast,
                         head_roles, roles, seconds, apart)  # fmt: skip
        if opened.folder is not None:
            _write(opened.folder, result, charts, reporter)
    for note in result.notes:
        reporter.note(note)
    result.folder = opened.target
    run.done(opened)
    return result


def check_request(what: str, direction: str, positions: str, metric: str, fast, charts, parts=False) -> None:
    """Refuse a choice outside its list, before anything loads."""
    asked = {"--what": (what, PATCH_WHATS), "--direction": (direction, PATCH_DIRECTIONS),
             "--positions": (positions, PATCH_POSITIONS), "--metric": (metric, PATCH_METRICS)}  # fmt: skip
    for name, (value, allowed) in asked.items():
        if value not in allowed:
            raise ConfigError(f"{name} takes {', '.join(allowed)}; got {value!r}")
    if not isinstance(fast, bool):
        raise ConfigError(f"fast takes True or False; got {fast!r}")
    if not isinstance(parts, bool):
        raise ConfigError(f"parts takes True or False; got {parts!r}")
    if parts and what != "output":
        raise ConfigError(f"--parts compares output patching with pattern and values patching; it takes --what "
                          f"output, not {what}")  # fmt: skip
    if fast and what in PROJECTED:
        raise ConfigError(f"--fast estimates output, pattern and values patching; --what {what} is patched exactly "
                          "(leave out --fast)")  # fmt: skip
    if charts is not None and charts not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {charts!r}")


def _roles(report) -> dict[tuple[int, int], str] | None:
    """Each head's role in `report` (its model checked against the command's by the session), or None."""
    return None if report is None else Report.open(report).head_roles()


def _common_length(tokenized: list[TokenizedPair], pairs: PairsFile) -> int:
    """--positions each compares positions across pairs: every pair must have the first pair's length."""
    first = tokenized[0]
    for pair in tokenized[1:]:
        if pair.length != first.length:
            raise CorpusError(
                f"{pairs.path}:{pair.pair.line}: {pair.length} tokens, but line {first.pair.line} has {first.length}; "
                "--positions each needs every pair of one length (one template), or use --positions all"
            )
    return first.length


def _units(plan, heads, width: int | None) -> list[Unit]:
    chosen = sorted(heads) if heads else [(layer, head) for layer in plan.layers for head in range(plan.heads)]
    positions = [None] if width is None else list(range(width))
    return [(layer, head, position) for layer, head in chosen for position in positions]


@dataclass
class _Found:
    pair_ids: list[int]
    clean: np.ndarray  # (pairs,) in pair-id order
    corrupt: np.ndarray
    patched: np.ndarray  # (units, pairs)
    forwards: int
    batches: int
    skipped: int = 0  # patched runs not run: positions before a pair's first differing token (effect exactly 0)


def _measure(capture, plan, loaded, tokenized, units, what, direction, width, roles, metric, fast,
             reporter) -> _Found:  # fmt: skip
    layers = sorted({layer for layer, _, _ in units})
    count = len(tokenized)
    clean, corrupt, patched = np.zeros(count), np.zeros(count), np.zeros((len(units), count))
    order = {pair.pair.pair_id: index for index, pair in enumerate(tokenized)}
    forwards = batches = skipped = 0
    reporter.start(count * len(units), what="patching", unit="patched runs")

    def on_forward(batch) -> None:  # a pass of replicas: one patched run per row
        nonlocal forwards
        forwards += 1
        reporter.advance(len(batch.sentence_ids), batch.n_tokens)

    projections = ProjectionPatch(capture.decoder, plan.architecture, what, layers) if what in PROJECTED else None
    for batch in pair_batches(tokenized, plan, loaded.device, direction):
        recorder = PairRecorder(what, layers, batch.target_rows, batch.source_rows, each=width is not None,
                                keep=fast)  # fmt: skip
        both = batch.both
        kept = kept_logits(capture, both)
        recording = projections.recording(batch.source_rows) if projections else contextlib.nullcontext()
        with recording:
            output, outputs = capture.run_keeping_layers(both, editors=[recorder],
                                                         measures=[recorder] if recorder.wants(layers[0]) else [],
                                                         logits_to_keep=kept)  # fmt: skip
        metrics = metric_of(metric, output.logits, both, kept, batch.answer.repeat(2), batch.distractor.repeat(2))
        del output
        metrics = metrics.double().cpu().numpy()
        rows = [order[i] for i in batch.pair_ids]
        clean[rows], corrupt[rows] = metrics[: len(rows)], metrics[len(rows) :]
        columns = None  # (pairs, positions): each pair's column of each patched position (its role's, by role)
        unchanged = []  # units patching only positions before every pair's first differing token
        if width is not None:
            start = batch.target.seq_start[:, None]
            if roles is None:
                at = [list(range(width)) for _ in batch.pair_ids]
            else:
                at = [[tokenized[order[i]].positions[role] for role in roles] for i in batch.pair_ids]
            columns = start + torch.tensor(at, dtype=torch.long, device=start.device)
            differs = [first_difference(tokenized[order[i]]) for i in batch.pair_ids]
            before = [all(p[position] < first for p, first in zip(at, differs, strict=True)) for *_, position in units]
            unchanged = [index for index, skip in enumerate(before) if skip]
        forwards, batches = forwards + 1, batches + 1
        if fast:
            patched[:, rows] = attributed_metrics(capture, batch, recorder, units, metric, columns)
            forwards += 1
            reporter.advance(len(rows) * len(units), batch.target.n_tokens)
        else:
            target_metric = metrics[batch.target_rows]
            patched[:, rows] = exact_metrics(capture, batch, recorder, outputs, units, metric, columns,
                                             max(1, plan.replicas(batch.target)), on_forward, projections,
                                             unchanged, target_metric)  # fmt: skip
            skipped += len(unchanged) * len(rows)
            reporter.advance(len(unchanged) * len(rows), 0)
    reporter.finish()
    return _Found([pair.pair.pair_id for pair in tokenized], clean, corrupt, patched, forwards, batches, skipped)


def first_difference(pair: TokenizedPair) -> int:
    """The first position where a pair's clean and corrupt tokens differ (its length where none does): a patch
    before it changes nothing, the two prompts' activations there being the same."""
    return next((i for i, (a, b) in enumerate(zip(pair.clean_ids, pair.corrupt_ids, strict=True)) if a != b),
                pair.length)  # fmt: skip


def _result(loaded, settings, pairs: PairsFile, tokenized, units, found: _Found, what, direction, positions,
            metric, fast, roles, position_roles, seconds, apart: dict[str, _Found]) -> Patching:  # fmt: skip
    effects = patch_effects(found.patched, found.clean, found.corrupt, direction, np.asarray(found.pair_ids),
                            replicates=settings.bootstrap, seed=settings.bootstrap_seed)  # fmt: skip
    if apart:
        effects |= beyond_parts(found.patched, apart["pattern"].patched, apart["values"].patched, found.clean,
                                found.corrupt, direction, np.asarray(found.pair_ids), replicates=settings.bootstrap,
                                seed=settings.bootstrap_seed)  # fmt: skip
    method = "attribution" if fast else "exact"
    table = pd.DataFrame({"layer": [u[0] for u in units], "head": [u[1] for u in units]})
    first = tokenized[0]
    if positions == "roles":
        table["position"] = [u[2] for u in units]
        table["position_role"] = [position_roles[u[2]] for u in units]
    if positions == "each":
        table["position"] = [u[2] for u in units]
        clean_tokens, corrupt_tokens = (token_texts(loaded.tokenizer, ids) for ids in (first.clean_ids,
                                                                                        first.corrupt_ids))  # fmt: skip
        table["clean_token"] = [clean_tokens[u[2]] for u in units]
        table["corrupt_token"] = [corrupt_tokens[u[2]] for u in units]
    table = table.assign(what=what, direction=direction, method=method, **effects)
    if roles is not None:
        # a head the report did not measure (a --layers report) has no role: "other" is a role it was not given
        table["role"] = [roles.get((u[0], u[1]), UNMEASURED) for u in units]
    keys = ["layer", "head", *(["position"] if positions != "all" else [])]
    per_pair = pd.DataFrame(
        {
            "pair": np.repeat([found.pair_ids], len(units), axis=0).ravel(),
            "line": np.repeat([[pair.pair.line for pair in tokenized]], len(units), axis=0).ravel(),
            **{key: np.repeat(table[key].to_numpy(), len(tokenized)) for key in keys},
            "m_patched": found.patched.ravel(),
            **{f"m_patched_{part}": done.patched.ravel() for part, done in apart.items()},
        }
    )
    gap = found.clean.mean() - found.corrupt.mean()
    flagged = np.abs(found.clean - found.corrupt) < NO_DIFFERENCE
    notes = []
    if flagged.any():
        lines = [pair.pair.line for pair, same in zip(tokenized, flagged, strict=True) if same]
        notes.append(f"{flagged.sum()} pair(s) give the same metric clean and corrupt (lines {lines[:5]}): kept, "
                     "flagged in patch.json")  # fmt: skip
    skipped = found.skipped + sum(done.skipped for done in apart.values())
    if skipped:
        notes.append(
            f"{skipped:,} patched runs not run: they patch positions before the first token where the "
            "pair's clean and corrupt prompts differ, where the activations are the same (effect exactly 0)"
        )
    if gap == 0:
        notes.append("the clean and corrupt prompts give the same mean metric: there is no behaviour to explain, "
                     "and every effect is empty (NaN)")  # fmt: skip
    elif settings.bootstrap and len(tokenized) < 2:
        notes.append(ONE_SENTENCE_NOTE.replace("sentences", "pairs"))
    units_done = len(units) * len(tokenized) * (1 + len(apart))
    record = record_header(loaded, settings, PATCH_SETTINGS, None) | {
        "pairs": {"path": str(pairs.path), "sha256": pairs.sha256, "count": len(tokenized),
                  "lengths": sorted({pair.length for pair in tokenized})},
        "metric": {"name": metric, "definition": METRICS[metric].definition},
        "what": what, "direction": direction, "positions": positions, "method": method, "parts": bool(apart),
        "heads_patched": len({(u[0], u[1]) for u in units}), "units": len(units),
        "m_clean_mean": float(found.clean.mean()), "m_corrupt_mean": float(found.corrupt.mean()), "gap": float(gap),
        "per_pair": [{"pair": pair.pair.pair_id, "line": pair.pair.line, "m_clean": float(c), "m_corrupt": float(r),
                      "no_difference": bool(same)}
                     for pair, c, r, same in zip(tokenized, found.clean, found.corrupt, flagged, strict=True)],
        "tokens": token_texts(loaded.tokenizer, first.clean_ids),
        "roles": position_roles,
        "bootstrap": {"replicates": settings.bootstrap, "seed": settings.bootstrap_seed, "level": 0.95,
                      "over": "pairs"},
        "timing": {"seconds": round(seconds, 3),
                   "forwards": found.forwards + sum(done.forwards for done in apart.values()),
                   "batches": found.batches,
                   "skipped_runs": skipped,
                   "patched_runs_per_second": round(units_done / seconds, 2) if seconds > 0 else None},
    }  # fmt: skip
    return Patching(table, per_pair, record, notes=notes)


def _write(folder: Path, result: Patching, charts: str | None, reporter: Reporter) -> None:
    write_frame(result.effects, folder / PATCHING_FILE)
    write_frame(result.per_pair, folder / PATCHING_PAIRS_FILE)
    write_json(result.record, folder / PATCH_RECORD)
    if charts:
        from headscope.report.patch_charts import draw_patch_charts

        for failed in draw_patch_charts(result.effects, result.record, folder, charts)[1]:
            reporter.warn(f"could not draw {failed}; the tables and patch.json are written")
