"""Column schemas of every output table, in one place, and atomic Parquet I/O.

Every table is long-form (one observation per row, snake_case columns) so it
opens directly with ``pandas.read_parquet``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from headscope.columns import (
    HEADS_COLUMNS,
    IMPORTANCE_COLUMNS,
    INTERVAL_METRICS,
    MEASURED_COLUMNS,
    PER_SENTENCE,
    PROBE_PATTERNS,
    RETRIEVAL,
    STREAMING,
    WRITTEN_AND_OFF_SINK,
)
from headscope.errors import OutputError
from headscope.estimates import ProbeResult, metric_means
from headscope.files import atomic_path
from headscope.layout import (
    EXAMPLES_FILE,
    EXEMPLARS_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    PROBES_FILE,
    SENTENCE_HEADS_FILE,
    SENTENCES_FILE,
)

METADATA_KEY = b"headscope"

# One row per (layer, head): every column of the registry (headscope.columns), in its order.
HEADS_SCHEMA = pa.schema([(column.name, pa.type_for_alias(column.dtype)) for column in HEADS_COLUMNS])

# One row per layer: its attention kind (full, sliding, ...) and window (null for full attention: run.plan.
# layer_attention), the mean over its heads of every interval metric, with a 95% interval from the same
# bootstrap replicates (so the layer-depth gradient comes with its uncertainty), and the sum over its heads
# of every importance column (NaN when not computed).
LAYERS_SCHEMA = pa.schema(
    [("layer", pa.int32()), ("heads", pa.int32()), ("attention", pa.string()), ("window", pa.int32())]
    + [(f"{m}{suffix}", pa.float64()) for m in INTERVAL_METRICS for suffix in ("", "_ci_low", "_ci_high")]
    + [(f"{name}_total", pa.float64()) for name in IMPORTANCE_COLUMNS]
)

# Every head's attention on a few texts, long-form, so views and charts can be drawn without the model: one row
# per (text, head, visible query-key pair). source: "corpus" (sentence_id: a corpus sentence) or "probe"
# (sentence_id: the probe sequence's seed).
EXAMPLES_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("sentence_id", pa.int64()),
        ("layer", pa.int32()),
        ("head", pa.int32()),
        ("query", pa.int32()),
        ("key", pa.int32()),
        ("query_token", pa.string()),
        ("key_token", pa.string()),
        ("weight", pa.float32()),
    ]
)

# One row per (layer, head, probe pattern, seed): each probe sequence's score, whose mean and t-interval over
# seeds are heads.parquet's probe_<pattern>, _ci_low, _ci_high.
PROBES_SCHEMA = pa.schema(
    [("layer", pa.int32()), ("head", pa.int32()), ("probe", pa.string()), ("seed", pa.int32()), ("score", pa.float64())]
)

# One row per kept exemplar (measures.exemplars): (layer, head, kind, rank), the corpus sentence and the query row
# (positions from the sentence's first token), its key (-1: none off the first token) and weight, and the score;
# the query's and key's tokens, and the sentence's tokens from context_start around them.
EXEMPLARS_SCHEMA = pa.schema(
    [
        *(("layer", pa.int32()), ("head", pa.int32()), ("kind", pa.string()), ("rank", pa.int32())),
        *(("sentence", pa.int64()), ("row", pa.int32()), ("key", pa.int32()), ("weight", pa.float32())),
        *(("score", pa.float64()), ("query_token", pa.string()), ("key_token", pa.string())),
        *(("context_start", pa.int32()), ("context", pa.list_(pa.string()))),
    ]
)

# headscope inspect: one row per (text, chosen head, visible query-key pair), the weight the model computes; and
# the tokens of each text.
ATTENTION_SCHEMA = pa.schema(
    [(name, pa.int32()) for name in ("text_id", "layer", "head", "query", "key")] + [("weight", pa.float32())]
)
TOKENS_SCHEMA = pa.schema(
    [("text_id", pa.int32()), ("position", pa.int32()), ("token_id", pa.int64()), ("token", pa.string())]
)

# One row per sentence of the corpus that was kept.
SENTENCES_SCHEMA = pa.schema(
    [
        ("sentence_id", pa.int64()),
        ("line", pa.int64()),
        ("text", pa.string()),
        ("n_tokens", pa.int32()),
        ("truncated", pa.bool_()),
    ]
)

# One row per (sentence, layer, head): means over that sentence's tokens. float32 keeps the
# file half the size; per-sentence values need no more than 7 significant digits.
SENTENCE_HEADS_SCHEMA = pa.schema(
    [("sentence_id", pa.int64()), ("layer", pa.int32()), ("head", pa.int32()), ("n_tokens", pa.int32())]
    + [(name, pa.float32()) for name in PER_SENTENCE]
)

# A report's tables, by file, and the schema each is written and read with: the one pairing of the two.
REPORT_SCHEMAS: dict[str, pa.Schema] = {
    HEADS_FILE: HEADS_SCHEMA,
    LAYERS_FILE: LAYERS_SCHEMA,
    SENTENCES_FILE: SENTENCES_SCHEMA,
    SENTENCE_HEADS_FILE: SENTENCE_HEADS_SCHEMA,
    EXAMPLES_FILE: EXAMPLES_SCHEMA,
    PROBES_FILE: PROBES_SCHEMA,
    EXEMPLARS_FILE: EXEMPLARS_SCHEMA,
}

DETECTOR_PREFIX = "detect_"  # heads.parquet's columns of the run's detectors: detect_<name>, _ci_low, _ci_high, _chance


def heads_schema(heads: pd.DataFrame) -> pa.Schema:
    """The heads table's schema: every column of the registry, then the run's detectors' (float64)."""
    detectors = [name for name in heads.columns if name.startswith(DETECTOR_PREFIX)]
    return pa.schema([*HEADS_SCHEMA, *(pa.field(name, pa.float64()) for name in detectors)])


def heads_frame(
    sums: np.ndarray,
    kv_heads: int,
    layer_ids: np.ndarray | None = None,
    *,
    intervals: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    probes: ProbeResult | None = None,
    importance: dict[str, np.ndarray] | None = None,
    dormant_check: dict[tuple[int, int], str] | None = None,
    copying: np.ndarray | None = None,
) -> pd.DataFrame:
    """The measured columns of the heads table, from corpus-wide stat sums (layers, heads, stats).

    layer_ids: the model layers the sums are of; intervals: metric -> (low, high) per head, (layers, heads);
    probes: the probe battery's scores; importance: column -> (layers, heads) for the importance columns;
    dormant_check: (layer, head) -> "verified" or "demoted", the dormant label's removal check; copying: the
    ov_copying scores of these layers, (layers, heads).
    Columns without a value (no intervals, no probes, no importance, no copying) are NaN.
    """
    layers, heads = sums.shape[:2]
    layer_ids = np.arange(layers) if layer_ids is None else np.asarray(layer_ids)
    columns = {
        "layer": np.repeat(layer_ids, heads),
        "head": np.tile(np.arange(heads), layers),
        # Query head h reads KV head h // (heads / kv_heads) in grouped-query attention.
        "kv_head": np.tile(np.arange(heads) // max(heads // kv_heads, 1), layers),
        **{name: values.reshape(-1) for name, values in metric_means(sums).items()},
    }
    missing = np.full(layers * heads, np.nan)
    for metric in INTERVAL_METRICS:
        low, high = (intervals or {}).get(metric, (missing, missing))
        columns[f"{metric}_ci_low"], columns[f"{metric}_ci_high"] = np.reshape(low, -1), np.reshape(high, -1)
    for pattern in PROBE_PATTERNS:
        name = f"probe_{pattern}"
        columns[name] = probes.scores[pattern].reshape(-1) if probes else missing
        columns[f"{name}_chance"] = np.full(layers * heads, probes.chance[pattern]) if probes else missing
        columns[f"{name}_ci_low"] = probes.low[pattern].reshape(-1) if probes else missing
        columns[f"{name}_ci_high"] = probes.high[pattern].reshape(-1) if probes else missing
        off_sink = probes.off_sink if probes else None
        columns[f"{name}_offsink"] = off_sink[pattern].reshape(-1) if off_sink else missing
    for name in IMPORTANCE_COLUMNS:
        values = (importance or {}).get(name)
        columns[name] = values.reshape(-1) if values is not None else missing
    columns["ov_copying"] = np.reshape(copying, -1) if copying is not None else missing
    retrieval = probes.retrieval if probes else None
    columns["probe_retrieval"] = retrieval.scores.reshape(-1) if retrieval else missing
    columns["probe_retrieval_chance"] = np.full(layers * heads, retrieval.chance) if retrieval else missing
    columns["probe_retrieval_ci_low"] = retrieval.low.reshape(-1) if retrieval else missing
    columns["probe_retrieval_ci_high"] = retrieval.high.reshape(-1) if retrieval else missing
    columns |= {column.name: missing for column in STREAMING}  # the corpus pass's far pattern fills them
    checked = dormant_check or {}
    heads_of = zip(columns["layer"], columns["head"], strict=True)
    columns["dormant_check"] = [checked.get((int(layer), int(head))) for layer, head in heads_of]
    return pd.DataFrame(columns)[list(MEASURED_COLUMNS)]


def layers_frame(
    heads: pd.DataFrame,
    intervals: dict[str, tuple[np.ndarray, np.ndarray]] | None,
    attention: tuple[tuple[str, int | None], ...],
) -> pd.DataFrame:
    """The layers table: per layer, its attention kind and window, the mean over heads of each interval metric and
    its interval.

    intervals: metric -> (low, high) of the layer mean, (layers,); None leaves them NaN. attention: (kind, window)
    of every layer of the model (model.architecture.layer_attention).
    """
    grouped = heads.groupby("layer", sort=True)
    layers = grouped.size().index
    frame = pd.DataFrame({"layer": layers, "heads": grouped.size().to_numpy()})
    frame["attention"] = [attention[layer][0] for layer in layers]
    frame["window"] = pd.array([attention[layer][1] for layer in layers], dtype="Int32")
    means = grouped[list(INTERVAL_METRICS)].mean()  # one grouped pass for every metric (one each cost 20 ms)
    totals = grouped[list(IMPORTANCE_COLUMNS)].sum(min_count=1)  # NaN stays NaN: unknown when its heads' are
    columns = {}
    for metric in INTERVAL_METRICS:
        low, high = (intervals or {}).get(metric, (np.full(len(frame), np.nan),) * 2)
        columns |= {metric: means[metric].to_numpy(), f"{metric}_ci_low": low, f"{metric}_ci_high": high}
    columns |= {f"{name}_total": totals[name].to_numpy() for name in IMPORTANCE_COLUMNS}
    return pd.concat([frame, pd.DataFrame(columns, index=frame.index)], axis=1)


def sentence_heads_frame(
    sentence_ids: np.ndarray, n_tokens: np.ndarray, sums: np.ndarray, layer_ids: np.ndarray
) -> pd.DataFrame:
    """Per-(sentence, layer, head) rows from stat sums, (sentences, layers, heads, stats)."""
    count, layers, heads = sums.shape[:3]
    means = metric_means(sums)
    columns = {
        "sentence_id": np.repeat(sentence_ids, layers * heads),
        "layer": np.tile(np.repeat(layer_ids, heads), count),
        "head": np.tile(np.arange(heads), count * layers),
        "n_tokens": np.repeat(n_tokens, layers * heads),
    }
    columns |= {name: means[name].reshape(-1).astype(np.float32) for name in PER_SENTENCE}
    return pd.DataFrame(columns)  # built at once: a column added at a time copied the frame each time


def probes_frame(per_seed: np.ndarray, layer_ids: np.ndarray) -> pd.DataFrame:
    """Long-form per-seed probe scores from (seeds, layers, heads, patterns)."""
    seed, layer, head, pattern = (axis.reshape(-1) for axis in np.indices(per_seed.shape))
    frame = pd.DataFrame(
        {
            "layer": np.asarray(layer_ids)[layer],
            "head": head,
            "probe": np.array(PROBE_PATTERNS, dtype=object)[pattern],
            "seed": seed,
            "score": per_seed.reshape(-1),
        }
    )
    return frame.sort_values(["layer", "head", "probe", "seed"], kind="stable", ignore_index=True)


def examples_frame(
    source: str,
    sentence_id: int,
    tokens: list[str],
    kept: dict[tuple[int, int], np.ndarray],
    visible: dict[int, np.ndarray],
) -> pd.DataFrame:
    """Long-form rows of one text's attention: kept maps (layer, head) -> its (t, t) weights, visible maps
    layer -> (t, t) bool (the keys each query could see); one row per head and visible (query, key)."""
    labels = np.array(tokens, dtype=object)
    columns: dict[str, list[np.ndarray]] = {name: [] for name in ("layer", "head", "query", "key", "weight")}
    for layer in sorted({layer for layer, _ in kept}):
        heads = sorted(head for lay, head in kept if lay == layer)
        query, key = np.nonzero(visible[layer])
        weights = np.stack([kept[(layer, head)][query, key] for head in heads])  # (heads, pairs)
        columns["layer"].append(np.full(weights.size, layer))
        columns["head"].append(np.repeat(heads, len(query)))
        columns["query"].append(np.tile(query, len(heads)))
        columns["key"].append(np.tile(key, len(heads)))
        columns["weight"].append(weights.reshape(-1).astype(np.float32))
    frame = pd.DataFrame({name: np.concatenate(parts) if parts else [] for name, parts in columns.items()})
    frame.insert(0, "sentence_id", sentence_id)
    frame.insert(0, "source", source)
    frame["query_token"] = labels[frame["query"].to_numpy(int)] if len(labels) else []
    frame["key_token"] = labels[frame["key"].to_numpy(int)] if len(labels) else []
    return frame[EXAMPLES_SCHEMA.names]


def parquet_metadata(run: dict) -> dict:
    """The part of run.json embedded in heads.parquet's metadata (key ``headscope``)."""
    keys = ("schema_version", "model", "corpus", "settings", "device", "dtype", "classification")
    return {key: run[key] for key in keys if key in run}


def _with_metadata(schema: pa.Schema, metadata: dict | None) -> pa.Schema:
    if not metadata:
        return schema
    return schema.with_metadata({METADATA_KEY: json.dumps(metadata, sort_keys=True).encode()})


def to_arrow(frame: pd.DataFrame, schema: pa.Schema) -> pa.Table:
    """Cast `frame` to exactly `schema` (column order and types); extra columns are an error."""
    missing = [name for name in schema.names if name not in frame.columns]
    extra = [name for name in frame.columns if name not in schema.names]
    if missing or extra:
        raise ValueError(f"table does not match its schema: missing {missing}, unexpected {extra}")
    return pa.Table.from_pandas(frame[schema.names], schema=schema, preserve_index=False)


def write_table(frame: pd.DataFrame, path: Path, schema: pa.Schema, *, metadata: dict | None = None) -> None:
    """Write `frame` to `path` atomically: a temporary sibling, then a rename."""
    table = to_arrow(frame, _with_metadata(schema, metadata))
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_frame(frame: pd.DataFrame, path: Path) -> None:
    """Write a table whose columns depend on its inputs (a comparison's) atomically, types as pandas has them."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_json(data: dict, path: Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


# Columns a later schema version added: a table written before them reads with them empty (null).
ADDED_COLUMNS = {"attention": 5, "window": 5} | {name: 6 for name in WRITTEN_AND_OFF_SINK}
ADDED_COLUMNS |= {
    name: 7
    for name in ("dormant_check", "estimate_zero", "estimate_mean", "estimate_zero_total", "estimate_mean_total")
}
ADDED_COLUMNS |= {column.name: 10 for column in (*RETRIEVAL, *STREAMING)}


def read_table(path: Path, schema: pa.Schema) -> pd.DataFrame:
    """Read a headscope table, checking that it has the columns `schema` promises, of their types.

    Columns beyond the schema (from a newer headscope, say) are kept as they are; columns of ADDED_COLUMNS that an
    older headscope did not write are added, empty.
    """
    if not path.is_file():
        raise OutputError(f"{path} not found; run `headscope analyze` first")
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise OutputError(f"{path} is not a readable Parquet file ({_first_line(err)})") from None
    for name in [name for name in schema.names if name in ADDED_COLUMNS and name not in table.column_names]:
        table = table.append_column(name, pa.nulls(len(table), schema.field(name).type))
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise OutputError(f"{path} is not a headscope table: columns {', '.join(missing)} are missing")
    for field in schema:
        column = table.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise OutputError(
                    f"{path} is not a headscope table: column {field.name!r} holds {column.type}, not {field.type}"
                ) from None
            table = table.set_column(table.schema.get_field_index(field.name), field.name, column)
    return table.to_pandas()


def read_metadata(path: Path) -> dict:
    """The headscope metadata stored in a Parquet file's schema ({} if none or unreadable)."""
    try:
        raw = (pq.read_schema(path).metadata or {}).get(METADATA_KEY)
        metadata = json.loads(raw) if raw else {}
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise OutputError(f"{path} is not a readable Parquet file ({_first_line(err)})") from None
    return metadata if isinstance(metadata, dict) else {}


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
