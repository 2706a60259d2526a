"""Two finished reports -> what changed, head by head. Never imports torch.

Same grid (the same layers x heads): every numeric measured column X of heads.parquet gives `X_a`, `X_b` and
`X_delta` = B - A (exactly, from the two tables), with the labels of both sides beside them. For `entropy`,
`norm_entropy`, `sink` and `diagonal` the delta gets a 95% interval, a p-value and a `significant` flag:
- the same sentences (the same texts in the same order, whatever files they came from) are *paired*: a Poisson
  bootstrap over sentences, each replicate weighing a sentence by the same count in A and B, streamed from both
  sentence_heads tables (memory O(replicates x heads)); p = 2 min(share of replicate deltas <= 0, share >= 0),
  with +1 smoothing, over the replicates where the delta exists (none: no p-value, never significant);
- different corpora are *unpaired*: each report's own 95% interval gives its standard error, the delta's
  interval is delta +- 1.96 sqrt(se_a^2 + se_b^2), and p is the normal two-sided p-value.
Settings that change what a number means (MEANING) and differ between the reports are listed in compare.json.
`significant` controls the false discovery rate at 5% over all heads, per metric (Benjamini-Hochberg).

Different grids (two models): layers are compared on relative depth, layer / (depth - 1) of each model, with
the types' and roles' shares in each model's early, middle and late layers (summary.depth_bands).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.arguments import as_number
from headscope.columns import DELTAS, INTERVAL_METRICS, MODEL_ONLY, RATIOS, ROWS_LEFT_OUT
from headscope.config import COMPARE_REPLICATES, check_replicates, check_seed
from headscope.errors import OutputError, ResourceError
from headscope.estimates import MIN_BOOTSTRAP_SENTENCES, ONE_SENTENCE_NOTE, percentile_interval, replicate_weights
from headscope.labels import HEAD_TYPES, ROLES
from headscope.layout import SCHEMA_VERSION, SENTENCE_HEADS_FILE
from headscope.model.memory import host_free_memory, readable
from headscope.report.report import Report
from headscope.report.sentence_rows import SENTENCES_AT_ONCE, sentence_rows

LEVEL = 0.95
Z = 1.959963984540054  # the standard normal's 97.5th percentile
FDR = 0.05
LABELS = ("head_type", "role", "top_offset")  # label columns shown for both sides


@dataclass
class Comparison:
    """The tables `compare` writes, as DataFrames."""

    record: dict  # compare.json
    layers: pd.DataFrame  # per layer (same grid) or per (report, layer) on relative depth
    bands: pd.DataFrame  # type and role shares per depth band, both reports
    heads: pd.DataFrame | None = None  # compare.parquet: one row per (layer, head); same grid only
    transitions: dict[str, pd.DataFrame] = field(default_factory=dict)  # label -> crosstab A -> B

    @property
    def same_grid(self) -> bool:
        return self.heads is not None

    @property
    def title(self) -> str:
        return f"{self.record['b']['name']} against {self.record['a']['name']}"

    @property
    def sides(self) -> dict[str, tuple[str, str]]:
        """ "a" and "b": (model, corpus path) of each report."""
        return {side: (str(self.record[side]["model"]), str(self.record[side]["corpus"])) for side in ("a", "b")}

    @property
    def method(self) -> str:
        """How the intervals were made (paired or not, and why)."""
        return self.record["method"]

    @property
    def settings_differ(self) -> dict[str, list]:
        """Settings that change what a number means, where the reports differ: name -> [A's, B's]."""
        return dict(self.record.get("settings_differ") or {})

    @property
    def significant_heads(self) -> dict[str, int]:
        """Per metric, the heads whose change passes the false discovery rate (same grid only)."""
        return dict(self.record.get("significant_heads", {}))


def read_side(folder: Path, name: str) -> Report:
    """One side of a comparison, refused with one line if it is from another schema version or lacks a table."""
    report = Report.open(folder)
    version = report.run.get("schema_version")
    if version != SCHEMA_VERSION:
        written = f"schema version {version}" if version is not None else "an older headscope (no schema version)"
        raise OutputError(
            f"report {name} ({folder}) was written by {written}; compare reads schema version {SCHEMA_VERSION}: "
            "run headscope analyze again"
        )
    if report.layers is None:
        raise OutputError(f"report {name} ({folder}) has no layers.parquet; run headscope analyze again")
    report.checked()
    return report


def compare_reports(a: Path, b: Path, *, replicates: int = COMPARE_REPLICATES, seed: int = 0) -> Comparison:
    """Compare report B against report A (deltas are B - A)."""
    replicates, seed = as_number(replicates, "--replicates", whole=True), as_number(seed, "--seed", whole=True)
    check_replicates("--replicates", replicates)
    check_seed("--seed", seed)
    ra, rb = read_side(a, "A"), read_side(b, "B")
    bands = band_shares(ra, rb)
    same_grid = (ra.depth, ra.head_count) == (rb.depth, rb.head_count) and set(
        zip(ra.heads["layer"], ra.heads["head"], strict=True)
    ) == set(zip(rb.heads["layer"], rb.heads["head"], strict=True))
    record = {
        "schema_version": SCHEMA_VERSION,
        **_identities(ra, rb),
        "same_grid": same_grid,
        "level": LEVEL,
        "fdr": {"method": "Benjamini-Hochberg", "rate": FDR, "over": "all heads, per metric"},
        "settings_differ": settings_differ(ra, rb),
    }
    if not same_grid:
        record["method"] = "relative depth (different grids)"
        return Comparison(record=record, layers=relative_depth_layers(ra, rb), bands=bands)

    heads = head_deltas(ra.heads, rb.heads)
    layer_ids = sorted(heads["layer"].unique())
    digests = [sentences_digest(r) for r in (ra, rb)]
    paired = digests[0] is not None and digests[0] == digests[1]
    if paired and all((r.folder / SENTENCE_HEADS_FILE).is_file() for r in (ra, rb)):
        check_fits(replicates, len(heads))
        head_stats, layer_stats, sentences = paired_intervals(ra, rb, heads, layer_ids, replicates, seed)
        record["method"] = f"paired (the same sentences): Poisson bootstrap over sentences, {replicates} replicates"
        if sentences < MIN_BOOTSTRAP_SENTENCES:  # the sentences measured (with a token), as the bootstrap saw them
            record["method"] += f"; {ONE_SENTENCE_NOTE}"
        record.update(replicates=replicates, seed=seed)
    else:
        head_stats, layer_stats = unpaired_intervals(ra, rb, heads)
        reason = "different sentences" if not paired else "a report without sentence_heads.parquet"
        if not paired and ra.corpus_sha256 is not None and ra.corpus_sha256 == rb.corpus_sha256:
            reason = "the same corpus file read into different sentences (--text-column or --encoding-errors)"
        record["method"] = f"unpaired ({reason}): normal intervals from each report's own 95% intervals"
    added = {}
    for metric, (low, high, p) in head_stats.items():
        added[f"{metric}_delta_ci_low"], added[f"{metric}_delta_ci_high"] = low, high
        added[f"{metric}_p"] = p
        added[f"{metric}_significant"] = benjamini_hochberg(p) <= FDR
    heads = pd.concat([heads, pd.DataFrame(added, index=heads.index)], axis=1)
    layers = layer_deltas(ra, rb, layer_stats)
    record["significant_heads"] = {m: int(heads[f"{m}_significant"].sum()) for m in INTERVAL_METRICS}
    transitions = {
        label: pd.crosstab(heads[f"{label}_a"], heads[f"{label}_b"]).reindex(index=names, columns=names, fill_value=0)
        for label, names in (("head_type", HEAD_TYPES), ("role", ROLES))
    }
    return Comparison(record=record, layers=layers, bands=bands, heads=heads, transitions=transitions)


# Settings that change what a number means: reports measured with different ones compare different things.
MEANING = ("window", "stream_window", "stream_sink", "sink_threshold", "max_length", "layers", "probe_length")


def settings_differ(ra: Report, rb: Report) -> dict[str, list]:
    """Setting -> [A's value, B's value], for the settings in MEANING the two reports were measured with apart."""
    a, b = (_section(r.run, "settings") for r in (ra, rb))
    return {name: [a.get(name), b.get(name)] for name in MEANING if a.get(name) != b.get(name)}


def sentences_digest(report: Report) -> str | None:
    """A hash of the sentences a report measured, in order (None without a sentences table): two reports are
    paired when they measured the same sentences, whatever the files they were read from."""
    sentences = report.sentences
    if sentences is None:
        return None
    digest = hashlib.sha256()
    for text in sentences.sort_values("sentence_id")["text"]:
        digest.update(str(text).encode("utf-8", "surrogatepass") + b"\x00")
    return digest.hexdigest()


def check_fits(replicates: int, cells: int) -> None:
    """Refuse a paired bootstrap whose replicate sums would not fit in half the host's free memory."""
    per_replicate = 8 * (2 * 2 * len(INTERVAL_METRICS) + 4) * cells + 8 * SENTENCES_AT_ONCE
    budget = host_free_memory() // 2
    if replicates * per_replicate > budget:
        raise ResourceError(
            f"--replicates {replicates:,} needs {readable(replicates * per_replicate)} for the bootstrap of "
            f"{cells:,} heads, more than half the free memory ({readable(budget)}); "
            f"{budget // per_replicate:,} replicates fit"
        )


def _section(run: dict, key: str) -> dict:
    value = run.get(key)
    return value if isinstance(value, dict) else {}


def _identities(ra: Report, rb: Report) -> dict[str, dict]:
    """Each side's identity, with a name saying which it is: "model on corpus", and the folder when those agree."""
    sides = {"a": _identity(ra), "b": _identity(rb)}
    for side in sides.values():
        side["name"] = f"{side['model']} on {Path(str(side['corpus'])).name}"
    if sides["a"]["name"] == sides["b"]["name"]:
        for side in sides.values():
            side["name"] += f" ({Path(side['folder']).name})"
    return sides


def _identity(report: Report) -> dict:
    model, corpus = _section(report.run, "model"), _section(report.run, "corpus")
    return {
        "folder": str(report.folder),
        "model": model.get("name") or model.get("input"),
        "corpus": corpus.get("path"),
        "corpus_sha256": report.corpus_sha256,
        "layers": report.depth,
        "heads": report.head_count,
    }


def head_deltas(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """One row per (layer, head): X_a, X_b, X_delta = B - A for every numeric column both measured, and both
    sides' labels."""
    a, b = a.set_index(["layer", "head"]).sort_index(), b.set_index(["layer", "head"]).sort_index()
    columns = {}
    numeric = [c for c in DELTAS if c in a.columns and c in b.columns]
    for column in numeric:
        # Importance, say, only when both measured it; the interval metrics always (NaN where unmeasurable);
        # a probe score only when it differs (one model's probes are the same whatever the corpus).
        measured = a[column].notna().any() and b[column].notna().any()
        if column in MODEL_ONLY and a[column].equals(b[column]):
            continue
        if column in INTERVAL_METRICS or measured:
            columns[f"{column}_a"], columns[f"{column}_b"] = a[column], b[column]
            columns[f"{column}_delta"] = b[column] - a[column]
    for label in LABELS:
        columns[f"{label}_a"], columns[f"{label}_b"] = a[label], b[label]
    return pd.DataFrame(columns, index=a.index).reset_index()


def paired_intervals(ra: Report, rb: Report, heads: pd.DataFrame, layer_ids, replicates: int, seed: int):
    """Bootstrap intervals of every head's and every layer mean's delta, resampling sentences in pairs, and how many
    sentences there were to resample (with fewer than two the intervals and p-values are NaN)."""
    cells = len(heads)
    metrics = INTERVAL_METRICS
    sums = {side: {m: np.zeros((2, replicates, cells)) for m in metrics} for side in ("a", "b")}
    streams = zip(
        sentence_rows(ra.folder / SENTENCE_HEADS_FILE, cells, metrics),
        sentence_rows(rb.folder / SENTENCE_HEADS_FILE, cells, metrics),
        strict=True,
    )
    sentences = 0
    for part_a, part_b in _checked(streams):
        if not np.array_equal(part_a[0], part_b[0]):
            raise OutputError("the two reports' sentence_heads tables hold different sentences")
        sentences += len(part_a[0])
        weights = replicate_weights(part_a[0], replicates, seed)  # (replicates, sentences), estimates' own draws
        for side, part in (("a", part_a), ("b", part_b)):
            n = part[1]
            for metric, values in zip(metrics, part[2:], strict=True):
                left_out = ROWS_LEFT_OUT[RATIOS[metric][1]]
                rows = np.clip(n - left_out, 0, None)[:, None] * np.isfinite(values)  # (sentences, cells)
                sums[side][metric][0] += weights @ (rows * np.nan_to_num(values))
                sums[side][metric][1] += weights @ rows
    head_stats, layer_stats = {}, {}
    layer_of = heads["layer"].to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a layer without any value (one-token corpus): NaN
        for metric in metrics:
            ratio = {s: sums[s][metric][0] / sums[s][metric][1] for s in ("a", "b")}  # (replicates, cells)
            delta = ratio["b"] - ratio["a"]
            low, high = percentile_interval(delta, LEVEL)
            head_stats[metric] = (low, high, _bootstrap_p(delta))
            per_layer = {
                s: np.stack([np.nanmean(ratio[s][:, layer_of == lay], axis=1) for lay in layer_ids], 1)
                for s in ("a", "b")
            }
            layer_delta = per_layer["b"] - per_layer["a"]  # (replicates, layers)
            layer_stats[metric] = (*percentile_interval(layer_delta, LEVEL), _bootstrap_p(layer_delta))
    if sentences < MIN_BOOTSTRAP_SENTENCES:  # every replicate resamples the one sentence: no interval, no test
        head_stats = {metric: _undefined(stats) for metric, stats in head_stats.items()}
        layer_stats = {metric: _undefined(stats) for metric, stats in layer_stats.items()}
    return head_stats, layer_stats, sentences


def _undefined(stats: tuple) -> tuple[np.ndarray, ...]:
    """NaN in the shape of each of `stats` (interval bounds, p-values)."""
    return tuple(np.full(np.shape(x), np.nan) for x in stats)


def _checked(streams):
    try:
        yield from streams
    except ValueError as err:
        if "zip()" not in str(err):
            raise
        raise OutputError("the two reports' sentence_heads tables hold different numbers of sentences") from None


def _bootstrap_p(delta: np.ndarray) -> np.ndarray:
    """Two-sided bootstrap p-value of 'no change' per column of (replicates, columns) deltas (+1 smoothed), over
    the replicates where the delta exists; NaN for a column without any (nothing to test, nothing significant)."""
    count = np.isfinite(delta).sum(0)
    below, above = (delta <= 0).sum(0), (delta >= 0).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.minimum(1.0, 2 * (np.minimum(below, above) + 1) / (count + 1))
    return np.where(count > 0, p, np.nan)


def unpaired_intervals(ra: Report, rb: Report, heads: pd.DataFrame):
    """Normal intervals of each delta from the two reports' own 95% intervals (NaN where either has none)."""
    a = ra.heads.set_index(["layer", "head"]).loc[list(zip(heads["layer"], heads["head"], strict=True))]
    b = rb.heads.set_index(["layer", "head"]).loc[list(zip(heads["layer"], heads["head"], strict=True))]
    head_stats = {metric: _normal_delta(a, b, metric) for metric in INTERVAL_METRICS}
    la, lb = ra.layers.set_index("layer").sort_index(), rb.layers.set_index("layer").sort_index()
    layer_stats = {metric: _normal_delta(la, lb, metric) for metric in INTERVAL_METRICS}
    return head_stats, layer_stats


def _normal_delta(a: pd.DataFrame, b: pd.DataFrame, metric: str):
    """(low, high, p) of b - a per row, from the rows' own 95% intervals."""
    delta = b[metric].to_numpy() - a[metric].to_numpy()
    se_a = (a[f"{metric}_ci_high"].to_numpy() - a[f"{metric}_ci_low"].to_numpy()) / (2 * Z)
    se_b = (b[f"{metric}_ci_high"].to_numpy() - b[f"{metric}_ci_low"].to_numpy()) / (2 * Z)
    se = np.sqrt(se_a**2 + se_b**2)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.abs(delta) / se
    p = np.array([math.erfc(value / math.sqrt(2)) if np.isfinite(value) else np.nan for value in z])
    p = np.where((se == 0) & (delta == 0), 1.0, p)  # two identical, exactly known values: no change
    return delta - Z * se, delta + Z * se, p


def benjamini_hochberg(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (NaN stays NaN and counts for nothing)."""
    from scipy.stats import false_discovery_control

    p = np.asarray(p, dtype=float)
    adjusted = np.full_like(p, np.nan)
    known = np.isfinite(p)
    if known.any():
        adjusted[known] = false_discovery_control(p[known], method="bh")
    return adjusted


def layer_deltas(ra: Report, rb: Report, layer_stats: dict) -> pd.DataFrame:
    """Per layer: each interval metric's mean over heads in A and B, the delta and its interval."""
    a, b = ra.layers.set_index("layer").sort_index(), rb.layers.set_index("layer").sort_index()
    out = pd.DataFrame({"layer": a.index.to_numpy(), "relative_depth": _relative_depth(a.index, ra.depth)})
    for metric in INTERVAL_METRICS:
        for side, table in (("a", a), ("b", b)):
            out[f"{metric}_{side}"] = table[metric].to_numpy()
            out[f"{metric}_{side}_ci_low"] = table[f"{metric}_ci_low"].to_numpy()
            out[f"{metric}_{side}_ci_high"] = table[f"{metric}_ci_high"].to_numpy()
        out[f"{metric}_delta"] = b[metric].to_numpy() - a[metric].to_numpy()
        low, high, p = layer_stats[metric]
        out[f"{metric}_delta_ci_low"], out[f"{metric}_delta_ci_high"] = low, high
        out[f"{metric}_significant"] = benjamini_hochberg(p) <= FDR
    return out


def _relative_depth(layers, n_layers: int) -> np.ndarray:
    return np.asarray(layers, dtype=float) / max(n_layers - 1, 1)


def relative_depth_layers(ra: Report, rb: Report) -> pd.DataFrame:
    """Both reports' layer tables, long-form, with each layer's relative depth in its model (layer / (depth - 1))."""
    frames = []
    for name, report in (("A", ra), ("B", rb)):
        frame = report.layers.copy()
        frame.insert(0, "report", name)
        frame.insert(2, "relative_depth", _relative_depth(frame["layer"], report.depth))
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def band_shares(ra: Report, rb: Report) -> pd.DataFrame:
    """Share of each head type and role in each band of each model's layers (summary.depth_bands), both reports."""
    rows = []
    for name, report in (("A", ra), ("B", rb)):
        for band, layers in report.bands.items():
            members = report.heads[report.heads["layer"].isin(layers)]
            for kind, column, names in (("type", "head_type", HEAD_TYPES), ("role", "role", ROLES)):
                counts = members[column].value_counts().reindex(names, fill_value=0)
                for label, count in counts.items():
                    share = count / len(members) if len(members) else np.nan
                    rows.append(
                        {
                            "report": name,
                            "band": band,
                            "kind": kind,
                            "label": label,
                            "heads": int(count),
                            "share": share,
                        }
                    )
    return pd.DataFrame(rows)
