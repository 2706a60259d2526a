"""What the commands print: rich tables of a report and of a comparison. Never imports torch.

Everything from a report or a model (names, paths, tokens, reasons) is printed as text, never as rich markup.
"""

from __future__ import annotations

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from headscope.arguments import head_name
from headscope.labels import HEAD_TYPES, ROLES, label_counts
from headscope.layout import (
    ABLATION_RECORD,
    CIRCUIT_RECORD,
    EDGES_FILE,
    HEAD_MASK_FILE,
    INSPECT_RECORD,
    KV_POLICY_RECORD,
    PATCH_RECORD,
    PATCHING_FILE,
    PRUNE_RECORD,
)
from headscope.model.memory import readable
from headscope.progress import printable
from headscope.report.report import Report
from headscope.summary import (
    dormant_line,
    early_late_entropy,
    importance_column,
    layer_bands,
    layer_entropy,
    least_needed,
    model_name,
    most_important,
    off_sink_counts,
    strongest_positions,
    top_heads_per_role,
)


class _Plain(Console):
    """A console that prints text as text: no markup (a path with "[/x]" in it is a name, not a style) and no raw
    control characters (a model's config may hold terminal escapes); long lines stay whole at any width."""

    def __init__(self) -> None:
        super().__init__(soft_wrap=True, highlight=False, markup=False)

    def print(self, *objects, **kwargs) -> None:
        objects = [printable(o) if isinstance(o, str) else o for o in objects]
        tables = [o for o in objects if isinstance(o, Table)]
        if not tables:
            super().print(*objects, **kwargs)
            return
        # a table as wide as its cells need, whatever the terminal: cells whole (no "..."), lines that wrap
        natural = max(self.measure(table, options=self.options.update_width(10_000)).maximum for table in tables)
        width = self.width
        self.width = max(width, natural)
        try:
            super().print(*objects, **kwargs)
        finally:
            self.width = width


def _console() -> Console:
    return _Plain()


def _row(table: Table, *cells) -> None:
    """A table row whose text cells are printable: a role or token read from a report may hold terminal escapes."""
    table.add_row(*(printable(cell) if isinstance(cell, str) else cell for cell in cells))


def _title(text: str) -> Text:
    return Text(printable(text))


def print_analysis(report: Report) -> None:
    """Per-layer entropy, the depth gradient, the run's counts and warnings; labels per band; the heads the
    loss needs most (when importance was measured)."""
    console = _console()
    facts = report.facts
    table = Table(title=_title(f"{facts.model}: mean attention entropy per layer (nats)"))
    for name in ("layer", "mean", "min head", "max head"):
        table.add_column(name, justify="right")
    for layer, row in layer_entropy(report.heads).iterrows():
        _row(table, str(layer), f"{row['mean']:.3f}", f"{row['min']:.3f}", f"{row['max']:.3f}")
    console.print(table)
    bands = early_late_entropy(report.heads, report.depth)
    if bands is not None:
        console.print(
            f"early layers {bands['early_layers']}: {bands['early']:.3f} nats, "
            f"late layers {bands['late_layers']}: {bands['late']:.3f} nats, gradient {bands['gradient']:+.3f}",
        )
    capped = (
        f", {facts.cut_before_tokenizing} so long they were cut before tokenizing"
        if facts.cut_before_tokenizing
        else ""
    )
    speed = "" if facts.tokens_per_second is None else f"; {facts.tokens_per_second:,.0f} tokens/s"
    console.print(
        f"{facts.sentences} sentences, {facts.tokens} tokens ({facts.truncated} truncated{capped}); "
        f"{facts.layers} layers x {facts.heads} heads on {facts.device} ({facts.dtype}){speed}",
    )
    if facts.nonfinite_rows:
        console.print(
            f"warning: {facts.nonfinite_rows} attention rows held NaN or inf ({facts.heads_with_nonfinite_rows} "
            "heads; left out of the metrics, counted in nonfinite_rows). float16 overflow? Try --dtype bfloat16 or "
            "float32.",
        )
    if facts.unnormalised_rows:
        console.print(
            f"warning: {facts.unnormalised_rows} attention rows do not sum to 1 "
            f"({facts.heads_with_unnormalised_rows} heads; counted in unnormalised_rows).",
        )
    console.print(f"wrote {report.folder}/")
    print_label_counts(report, facts.model)
    print_role_heads(report)
    _print_most_important(report)


def print_role_heads(report: Report, count: int = 3) -> None:
    """Each role's strongest heads, by the evidence that gave them the role, with their scores."""
    found = top_heads_per_role(report.heads, count)
    if not found:
        return
    title = _title("the strongest heads of each role, by the evidence for it")
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("role (heads)", no_wrap=True)
    table.add_column("evidence", no_wrap=True)
    for rank in range(1, count + 1):
        table.add_column(f"#{rank}", no_wrap=True)
    for entry in found:
        top = [f"{head_name(layer, head)} {score:.3f}" for layer, head, score in entry["top"]]
        role = f"{entry['role']} ({entry['heads']})"
        _row(table, role, entry["evidence"], *top, *[""] * (count - len(top)))
    _console().print(table)
    checked = dormant_line(report.heads, report.run.get("dormant_check"))
    if checked:
        _console().print(checked)
    behaviours = off_sink_counts(report.heads)
    if behaviours:
        counts = ", ".join(f"{name} {n}" for name, n in behaviours.items())
        _console().print(f"sink heads, by what they do off the sink (role_detail): {counts}")


def _print_most_important(report: Report) -> None:
    """The 10 heads the loss needs most and the 10 it needs least, with their role and entropy; each role's heads
    removed together. Signed attribution is never shown as if it were an ablation: without exact ablation the
    tables rank by its magnitude and say that it is an estimate."""
    heads = report.heads
    column = importance_column(heads)
    if column is None:
        return
    facts = report.facts
    console = _console()
    exact = column.startswith("ablation")
    how = f"by {column}" if exact else f"by {column}, a second-order estimate"
    clean = "no clean loss" if facts.clean_loss is None else f"clean loss {facts.clean_loss:.4f} nats"
    for title, chosen in (
        (f"the 10 heads the loss needs most, {how} ({clean})", most_important(heads)),
        (f"the 10 heads it needs least alone, {how} (headscope prune removes heads together, verified)",
         least_needed(heads)),
    ):  # fmt: skip
        table = Table(title=_title(title), box=box.SIMPLE_HEAD)
        for name in ("head", "ablate 0", "ablate mean", "estimate 0", "estimate mean", "role", "entropy"):
            table.add_column(name, justify="left" if name in ("head", "role") else "right", no_wrap=name == "role")
        for row in chosen.itertuples():
            values = [row.ablation_zero, row.ablation_mean, row.estimate_zero, row.estimate_mean]
            cells = [f"{v:+.4f}" if v == v else "-" for v in values]  # NaN: not computed
            _row(table, head_name(row.layer, row.head), *cells, row.role, f"{row.entropy:.3f}")
        console.print(table)
    if not exact:
        console.print(
            "note: the estimates are second order, from one gradient pass, not ablations (on SmolLM2 they rank "
            "heads as exact mean ablation does at Spearman 0.85); measure removals with --importance exact, "
            "headscope ablate (heads together) or headscope prune."
        )
    _print_role_groups(facts.role_removals)


def _print_role_groups(removals) -> None:
    """Each role's heads removed together: the delta on every token and on repeated tokens, with intervals."""
    if not removals:
        return
    table = Table(title=_title("each role's heads removed together (exact, nats of loss)"), box=box.SIMPLE_HEAD)
    for name in ("role (heads)", "removal", "all tokens", "repeated tokens"):
        table.add_column(name, justify="left" if name.startswith("role") or name == "removal" else "right")
    for removal in removals:
        cells = []
        for scoring in ("all", "repeats"):
            effect = removal.effects.get(scoring) or {"delta": None}
            if effect["delta"] is None:
                cells.append("- (no tokens)")
                continue
            low, high = effect["delta_ci_low"], effect["delta_ci_high"]
            interval = "" if low is None else f" [{low:+.3f}, {high:+.3f}]"
            cells.append(f"{effect['delta']:+.4f}{interval} ({effect['tokens']:,})")
        _row(table, f"{removal.role} ({len(removal.heads)})", removal.mode, *cells)
    _console().print(table)


def print_label_counts(report: Report, title: str) -> None:
    """Head types and roles, counted per band of the model's layers."""
    bands = layer_bands(report.depth)
    console = _console()
    for column, names, what in (("head_type", HEAD_TYPES, "head type"), ("role", ROLES, "role")):
        counts = label_counts(report.heads, column, names, bands)  # rows: bands; columns: labels
        table = Table(title=_title(f"{title}: heads per {what}"))
        table.add_column(what)
        for band in counts.index:
            table.add_column(band, justify="right")
        for name in names:
            _row(table, name, *(str(int(counts.at[band, name])) for band in counts.index))
        console.print(table)


def print_comparison(comparison) -> None:
    """The method, the heads that changed most and the layers where the mean entropy moved."""
    console = _console()
    for side, (model, corpus) in comparison.sides.items():
        console.print(f"{side.upper()}: {model} on {corpus}")
    console.print(f"method: {comparison.method}")
    differ = comparison.settings_differ
    if differ:
        console.print(
            "note: the reports were measured with settings that change what the numbers mean: "
            + "; ".join(f"{name} {a} (A) vs {b} (B)" for name, (a, b) in differ.items())
        )
    if not comparison.same_grid:
        shares = comparison.bands[comparison.bands["kind"] == "role"].pivot_table(
            index="label", columns=["band", "report"], values="share"
        )
        console.print(shares.round(3).to_string())
        return
    heads = comparison.heads
    counts = ", ".join(f"{metric} {n}" for metric, n in comparison.significant_heads.items())
    console.print(f"heads whose change is significant (FDR 5%): {counts} of {len(heads)}")
    table = Table(title="the heads whose entropy changed most", box=box.SIMPLE_HEAD)
    for name in ("head", "A", "B", "B - A", "95% interval", "sig.", "role A -> B"):
        table.add_column(name, justify="left" if name in ("head", "role A -> B") else "right")
    for row in heads.reindex(heads["entropy_delta"].abs().sort_values(ascending=False).index).head(10).itertuples():
        _row(
            table,
            head_name(row.layer, row.head),
            f"{row.entropy_a:.3f}",
            f"{row.entropy_b:.3f}",
            f"{row.entropy_delta:+.3g}",  # significant figures: a consistent 1e-5 shift must not read 0.000
            f"[{row.entropy_delta_ci_low:+.3g}, {row.entropy_delta_ci_high:+.3g}]",
            "yes" if row.entropy_significant else "",
            f"{row.role_a} -> {row.role_b}",
        )
    console.print(table)
    layers = comparison.layers
    moved = layers[layers["entropy_significant"]]
    if len(moved):
        console.print(
            "layers whose mean entropy moved (FDR 5%): "
            + ", ".join(f"{row.layer} ({row.entropy_delta:+.3g})" for row in moved.itertuples())
        )
    else:
        console.print("no layer's mean entropy moved significantly (FDR 5%)")


def print_inspection(found) -> None:
    """Per head and text: its role (when known), where its rows put their largest weight, its probe scores."""
    console = _console()
    probes = found.probes
    table = Table(title=_title(f"{found.model}: where each head's rows put their largest weight"))
    for name in ("head", "role", "text", "largest weight at (share of rows)", "mean", *probes):
        table.add_column(
            name, justify="left" if name in ("head", "role", "text") or name.startswith("largest") else "right"
        )
    shown = found.summary.head(SUMMARY_ROWS)
    for row in shown.itertuples():
        head = f"{row.layer}.{row.head}"
        places = ", ".join(f"{name} {share:.0%}" for name, share in row.largest_at) or "-"
        scores = (getattr(row, f"probe_{pattern}") for pattern in probes)
        _row(
            table,
            head,
            found.roles.get(head, "-"),
            found.texts[row.text_id].label,
            places,
            "-" if pd.isna(row.mean_largest) else f"{row.mean_largest:.3f}",
            *("-" if pd.isna(score) else f"{score:.3f}" for score in scores),
        )
    console.print(table)
    if len(found.summary) > len(shown):
        console.print(f"... {len(found.summary) - len(shown)} more rows in {INSPECT_RECORD}")
    if found.roles_from:
        console.print(f"roles from {found.roles_from}")
    if "why" in found.record:
        _print_why(console, found)
    if found.folder is not None:
        written = sorted(path.name for path in found.folder.iterdir())  # what is there, inspect.html included
        console.print(f"wrote {found.folder}/ ({', '.join(written)})")


SUMMARY_ROWS = 40  # the console shows this many (head, text) rows; inspect.json has them all


def print_ablation(found) -> None:
    """Per group: its heads, the scored tokens, clean and ablated loss, the delta and its 95% interval (with
    --pairs: the pairs, clean and ablated m, the change, its interval and its share of the gap)."""
    if found.pairs is not None:
        _print_pair_ablation(found)
        return
    console = _console()
    how = f"removed together ({found.mode})"
    if found.window is not None:
        how = f"windowed together ({found.window.kept})"
    title = f"{found.model}: heads {how}, loss on {found.loss_on} tokens"
    table = Table(title=_title(title), box=box.SIMPLE_HEAD)
    shown = [",".join(e.heads[:6]) + (f",... ({len(e.heads)})" if len(e.heads) > 6 else "") for e in found.effects]
    for name in ("group", "heads", "tokens", "clean", "ablated", "delta (nats)", "95% interval"):
        # every cell whole on its line: the heads column as wide as its longest list (6 heads at most are named)
        width = max(map(len, shown), default=0) if name == "heads" else None
        table.add_column(name, justify="left" if name in ("group", "heads") else "right", no_wrap=True,
                         min_width=width)  # fmt: skip
    for effect, heads in zip(found.effects, shown, strict=True):
        low, high = effect.delta_ci_low, effect.delta_ci_high
        _row(
            table,
            effect.name if effect.name != ",".join(effect.heads) else "-",
            heads,
            f"{effect.tokens:,}",
            *("-" if value is None else f"{value:.4f}" for value in (effect.clean_loss, effect.ablated_loss)),
            "-" if effect.delta is None else f"{effect.delta:+.4f}",
            "-" if low is None else f"[{low:+.4f}, {high:+.4f}]",
        )
    console.print(table)
    if found.folder is not None:
        console.print(f"wrote {found.folder}/{ABLATION_RECORD}")


def _print_pair_ablation(found) -> None:
    console = _console()
    task = found.pairs
    title = (f"{found.model}: heads removed together ({found.mode}) on {task['count']} pairs' clean prompts, "
             f"{task['metric']} = {task['definition']}")  # fmt: skip
    table = Table(title=_title(title), box=box.SIMPLE_HEAD)
    for name in ("group", "heads", "m clean", "m ablated", "change", "95% interval", "share of the gap"):
        table.add_column(name, justify="left" if name in ("group", "heads") else "right", no_wrap=True)
    for effect in found.effects:
        low, high = effect.change_ci_low, effect.change_ci_high
        heads = ",".join(effect.heads[:6]) + (f",... ({len(effect.heads)})" if len(effect.heads) > 6 else "")
        _row(table, effect.name if effect.name != ",".join(effect.heads) else "-", heads,
             f"{effect.clean_metric:.4f}", f"{effect.ablated_metric:.4f}", f"{effect.change:+.4f}",
             "-" if low is None else f"[{low:+.4f}, {high:+.4f}]",
             "-" if effect.gap_share is None else f"{effect.gap_share:+.3f}")  # fmt: skip
    console.print(table)
    console.print("share of the gap: change / (mean m_corrupt - mean m_clean); 1 = removing the heads does what the "
                  "corrupt prompt does, 0 = nothing")  # fmt: skip
    if found.folder is not None:
        console.print(f"wrote {found.folder}/{ABLATION_RECORD}")


PATCH_MEANING = {
    "denoise": "effect = share of the gap (mean m_clean - mean m_corrupt) the head's clean {what} restores in the "
    "corrupt prompt: 1 = all of the behaviour, 0 = none, below 0 = it pushes the other way",
    "noise": "effect = share of the gap (mean m_clean - mean m_corrupt) the head's corrupt {what} destroys in the "
    "clean prompt: 1 = all of the behaviour, 0 = none, below 0 = it strengthens it",
}


def print_patching(found, count: int = 12) -> None:
    """The heads of largest |effect| with their intervals (and roles), and what the numbers mean."""
    console = _console()
    record = found.record
    console.print(
        _title(
            f"{model_name(record)}: {record['metric']['name']} = {record['metric']['definition']}; mean "
            f"{record['m_clean_mean']:.3f} clean, {record['m_corrupt_mean']:.3f} corrupt over "
            f"{record['pairs']['count']} pairs"
        )
    )
    estimate = " (first-order estimates: --fast)" if record["method"] == "attribution" else ""
    title = f"heads whose {record['what']} carries the behaviour ({record['direction']}){estimate}"
    table = Table(title=_title(title), box=box.SIMPLE_HEAD)
    top = found.top(count)
    by_role = "position_role" in top
    columns = ["head", *(["position", "role at" if by_role else "token"] if "position" in top else []), "effect",
               "95% interval"]  # fmt: skip
    parts = "beyond_parts" in top
    columns += ["pattern", "values", "beyond", "beyond 95%"] if parts else []
    columns += ["role"] if "role" in top else []
    numbers = ("effect", "95% interval", "position", "pattern", "values", "beyond", "beyond 95%")
    for name in columns:
        table.add_column(name, justify="right" if name in numbers else "left")

    def signed(value) -> str:
        return "-" if pd.isna(value) else f"{value:+.3f}"

    def interval(low, high) -> str:
        return "-" if pd.isna(low) else f"[{low:+.3f}, {high:+.3f}]"

    for row in top.itertuples():
        cells = [head_name(row.layer, row.head)]
        if "position" in top:
            cells += [str(row.position), row.position_role if by_role else printable(repr(row.clean_token))]
        cells += [signed(row.effect), interval(row.effect_ci_low, row.effect_ci_high)]
        if parts:
            cells += [signed(row.pattern_effect), signed(row.values_effect), signed(row.beyond_parts),
                      interval(row.beyond_ci_low, row.beyond_ci_high)]  # fmt: skip
        if "role" in top:
            cells.append(row.role)
        _row(table, *cells)
    console.print(table)
    if "role" in found.effects:
        console.print(_title(_patch_roles(found.effects)))
    console.print(_title(PATCH_MEANING[record["direction"]].format(what=record["what"])))
    if found.folder is not None:
        console.print(f"wrote {found.folder}/{PATCHING_FILE} and {PATCH_RECORD}")


def print_circuit(found, count: int = 12) -> None:
    """The strongest edges with their intervals (and the sender's role), the components that write most of m, and
    what the numbers mean."""
    console = _console()
    record = found.record
    m = record["m"]
    console.print(_title(f"{model_name(record)}: {record['metric']['name']} = {record['metric']['definition']}; "
                         f"mean {m['clean']:.3f} clean, {m['corrupt']:.3f} corrupt over {record['pairs']['count']} "
                         f"pairs; {record['graph']['edges']:,} edges scored by {record['method']}"))  # fmt: skip
    table = Table(title=_title("the strongest edges"), box=box.SIMPLE_HEAD)
    top = found.top(count)
    roles = "sender_role" in top
    numbers = ("score", "95% interval", "exact")
    for name in ("sender", "receiver", *numbers, *(["sender role"] if roles else [])):
        table.add_column(name, justify="right" if name in numbers else "left")
    for row in top.itertuples():
        receiver = row.receiver + (f" ({row.channel})" if row.channel else "")
        low, high = row.score_ci_low, row.score_ci_high
        cells = [row.sender, receiver, f"{row.score:+.4f}", "-" if pd.isna(low) else f"[{low:+.4f}, {high:+.4f}]",
                 "-" if pd.isna(row.exact) else f"{row.exact:+.4f}"]  # fmt: skip
        _row(table, *cells, *([row.sender_role if isinstance(row.sender_role, str) else "-"] if roles else []))
    console.print(table)
    if record["faithfulness"]:
        curve = ", ".join(f"{p['share']:.1%} {p['faithfulness']:.2f}" for p in record["faithfulness"][1:-1])
        console.print(_title(f"faithfulness by circuit size (share of edges): {curve}; CPR {record['cpr']:.3f}, "
                             f"CMD {record['cmd']:.3f}"))  # fmt: skip
        smallest = record["circuit"]
        if smallest is None:
            console.print(_title(f"no circuit of the curve reaches faithfulness {record['target']}"))
        else:
            size = f"{smallest['edges']:,} edges ({smallest['share']:.1%})"
            console.print(_title(f"the smallest circuit reaching {record['target']}: {size}, faithfulness "
                                 f"{smallest['faithfulness']:.3f}"))  # fmt: skip
    nodes = found.nodes.reindex(found.nodes["dla"].abs().sort_values(ascending=False).index).head(count // 2)
    written = ", ".join(f"{row.node} {row.dla:+.3f}" for row in nodes.itertuples())
    console.print(_title(f"direct logit attribution (the components add up to m): {written}"))
    console.print(_title("a negative score: corrupting the edge lowers the metric (exact: the same, patched); the "
                         "interval is over pairs"))  # fmt: skip
    if "why" in record:
        _print_circuit_why(console, record["why"])
    if found.folder is not None:
        console.print(f"wrote {found.folder}/{EDGES_FILE} and {CIRCUIT_RECORD}")


PATCH_NOTABLE = 0.05  # |effect| from which the printout counts a head among those that carry the behaviour


def _patch_roles(effects: pd.DataFrame) -> str:
    """The heads of |effect| >= PATCH_NOTABLE (at their strongest position), by role."""
    strongest = strongest_positions(effects)
    notable = strongest[strongest["effect"].abs() >= PATCH_NOTABLE]
    if notable.empty:
        return f"no head has |effect| >= {PATCH_NOTABLE}"
    groups = [
        f"{role} {', '.join(head_name(r.layer, r.head) for r in rows.itertuples())}"
        for role, rows in sorted(notable.groupby("role"), key=lambda item: -item[1]["effect"].abs().sum())
    ]
    return f"heads with |effect| >= {PATCH_NOTABLE}, by role: " + "; ".join(groups)


def print_pruning(found) -> None:
    """How many heads went, the verified loss, the curve's steps and where the mask and checkpoint are."""
    console = _console()
    result, removed = found.result, found.heads
    if found.window is None:
        how, verified = f"removed {len(removed)} of {found.total_heads} heads ({found.mode})", "removed together"
    else:
        how = f"windowed {len(removed)} of {found.total_heads} heads to {found.window.kept}"
        verified = "windowed together"
    console.print(
        f"{how} within {result.budget:g} nats: loss {result.clean_loss:.4f} -> {result.loss:.4f} "
        f"({result.loss - result.clean_loss:+.4f}, verified with every one of them {verified})"
    )
    if found.kv_policy is not None:
        _print_kv_policy(console, found.kv_policy)
    steps = ", ".join(f"{count}: {loss:.4f}" for count, loss in result.curve)
    console.print(_title(f"verified loss by heads removed: {steps}"))
    if removed:
        console.print(_title(f"removed, in order: {', '.join(removed)}"))
    saved = found.saved_model
    if saved is not None and saved.error is None:
        console.print(_title(f"saved the pruned model to {saved.path} (its own loss {saved.loss:.4f}, checked)"))
    if found.folder is not None:
        policy = f", {KV_POLICY_RECORD}" if found.kv_policy is not None else ""
        console.print(_title(f"wrote {found.folder}/ ({PRUNE_RECORD}, {HEAD_MASK_FILE}{policy})"))


def _print_kv_policy(console, policy: dict) -> None:
    """What the windowed heads free: KV heads (only those every reading query head leaves), and bytes."""
    query, kv = policy["query_heads"], policy["kv_heads"]
    console.print(_title(f"KV heads whose cache can shrink: {kv['windowed']} of {kv['total']} (a KV head only where "
                         f"every query head reading it is windowed; query heads windowed: {query['windowed']} of "
                         f"{query['total']})"))  # fmt: skip
    for name, memory in policy["memory"].items():
        console.print(_title(f"KV cache at {name.replace('_', ' ')} ({memory['tokens']:,} tokens): "
                             f"{readable(memory['full_bytes'])} -> {readable(memory['policy_bytes'])} per sequence "
                             f"({memory['freed_share']:.1%} freed)"))  # fmt: skip


def print_copying(found, count: int = 10) -> None:
    """The heads that copy most and those that suppress most, and what the score means."""
    console = _console()
    heads, record = found.heads, found.record
    console.print(_title(f"{model_name(record)}: the OV copying score of {len(heads)} heads (unembedding: "
                         f"{record['unembedding']})"))  # fmt: skip
    ordered = heads.sort_values("ov_copying", ascending=False)
    for title, rows in (("copying most", ordered.head(count)), ("suppressing most", ordered.tail(count)[::-1])):
        table = Table(title=_title(title), box=box.SIMPLE_HEAD)
        table.add_column("head")
        table.add_column("ov_copying", justify="right")
        for row in rows.itertuples():
            _row(table, head_name(row.layer, row.head), f"{row.ov_copying:+.3f}")
        console.print(table)
    console.print(_title("ov_copying = sum(eigenvalues) / sum(|eigenvalues|) of the head's OV circuit on tokens, "
                         "norm gains folded in: 1 copies the token it attends to, -1 suppresses it"))  # fmt: skip


def _print_circuit_why(console, why: dict) -> None:
    """circuit --why: per explained head and role, its attention at END clean and corrupt, and the senders whose
    side of the contrast moves most between them."""
    table = Table(title=_title(f"why the heads the {why['edges']} strongest q and k edges feed attend, at END, to "
                               "each role's token: weight and contrast clean -> corrupt, and the senders that move "
                               "the contrast (clean - corrupt)"), box=box.SIMPLE_HEAD)  # fmt: skip
    for name in ("head", "role", "weight", "contrast", "query side moved by", "key side moved by"):
        table.add_column(name, justify="right" if name in ("weight", "contrast") else "left")
    for entry in why["rows"]:
        weight, contrast = entry["weight"], entry["contrast"]
        _row(table, f"{entry['layer']}.{entry['head']}", entry["role"],
             f"{weight['clean']:.3f} -> {weight['corrupt']:.3f}",
             f"{contrast['clean']:+.2f} -> {contrast['corrupt']:+.2f}", _senders(entry["query_moved"]),
             _senders(entry["key_moved"]))  # fmt: skip
    console.print(table)


def _print_why(console, found) -> None:
    """inspect --why: per explained row, the key, its weight and contrast, each side's strongest senders and the
    strongest pairs (by contrast)."""
    rows = found.record["why"]["rows"]
    tokens = {(row.text_id, row.position): row.token for row in found.tokens.itertuples()}
    table = Table(title=_title("why each row attends to its key: the senders of the query and the key, by contrast"))
    for name in ("head", "text", "row -> key", "weight", "contrast", "query side", "key side", "strongest pairs"):
        table.add_column(name, justify="right" if name in ("weight", "contrast") else "left")

    for entry in rows[:SUMMARY_ROWS]:
        text = entry["text_id"]
        row, key = (f"{entry[at]} {tokens.get((text, entry[at]), '')!r}" for at in ("row", "key"))
        pairs = ", ".join(f"{a} x {b} {value:+.2f}" for a, b, value in entry["pairs"])
        _row(table, f"{entry['layer']}.{entry['head']}", found.texts[text].label, f"{row} -> {key}",
             f"{entry['weight']:.3f}", f"{entry['contrast']:+.3f}", _senders(entry["query_side"]),
             _senders(entry["key_side"]), pairs)  # fmt: skip
    console.print(table)
    if len(rows) > SUMMARY_ROWS:
        console.print(f"... {len(rows) - SUMMARY_ROWS} more rows in {INSPECT_RECORD}; every pair in qk.parquet")
    heads = found.record["why"].get("heads", [])
    if len(rows) > 1 and heads:
        _print_why_heads(console, heads)


def _print_why_heads(console, heads: list[dict]) -> None:
    """inspect --why over several rows: each head's mean contrast per side and pair, and k_composition_prev."""
    table = Table(title=_title("each head over its explained rows: mean contrast by sender; k_comp_prev: the share "
                               "of the key side's push for the key that previous-token heads write"))  # fmt: skip
    for name in ("head", "role", "rows", "contrast", "query side", "key side", "strongest pairs", "k_comp_prev"):
        table.add_column(name, justify="right" if name in ("rows", "contrast", "k_comp_prev") else "left")
    for entry in heads:
        share = entry["k_composition_prev"]
        _row(table, f"{entry['layer']}.{entry['head']}", entry["role"] or "-", str(entry["rows"]),
             f"{entry['contrast']:+.3f}", _senders(entry["query_side"]), _senders(entry["key_side"]),
             ", ".join(f"{a} x {b} {value:+.2f}" for a, b, value in entry["pairs"]),
             "-" if share is None else f"{share:.2f}")  # fmt: skip
    console.print(table)


def _senders(entries) -> str:
    return ", ".join(f"{sender} {value:+.2f}" for sender, value in entries)
