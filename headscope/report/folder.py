"""A finished report folder, without the model: read its tables (every read guarded), re-label its heads,
redraw its charts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from headscope.config import CHART_FORMATS, RoleThresholds, Thresholds
from headscope.errors import ConfigError, OutputError
from headscope.labels import classification_record, label_heads
from headscope.layout import EXAMPLES_FILE, HEADS_FILE, LAYERS_FILE, PAGE_FILE, RUN_FILE, why_not_a_report
from headscope.output import atomic_path
from headscope.tables import (
    EXAMPLES_SCHEMA,
    HEADS_SCHEMA,
    LAYERS_SCHEMA,
    MEASURED_COLUMNS,
    parquet_metadata,
    read_table,
    write_json,
    write_table,
)


def read_run(folder: Path) -> dict:
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        raise OutputError(f"{path} not found; is {folder} a headscope report folder?")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise OutputError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise OutputError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(run, dict):
        raise OutputError(f"{path} is not a headscope run record (a JSON object)")
    return run


def read_heads(folder: Path) -> pd.DataFrame:
    """The heads table of a report, refused unless it has one row per (layer, head)."""
    path = Path(folder) / HEADS_FILE
    heads = read_table(path, HEADS_SCHEMA)
    if heads.empty:
        raise OutputError(f"{path} has no rows; run `headscope analyze` again")
    if heads[["layer", "head"]].isna().any().any():
        raise OutputError(f"{path} has rows without a layer or head number")
    repeated = heads.duplicated(["layer", "head"])
    if repeated.any():
        first = heads[repeated].iloc[0]
        raise OutputError(f"{path} lists layer {first['layer']}, head {first['head']} more than once")
    return heads


def reclassify(
    folder: Path, thresholds: Thresholds, roles: RoleThresholds | None = None, *, out: Path | None = None
) -> pd.DataFrame:
    """Re-label the heads of `folder` (types and roles); write in place (atomically) or into `out`.

    With `out`, the new heads.parquet and run.json go there, with the tables the charts need.
    """
    folder = Path(folder)
    run = read_run(folder)
    roles = roles or RoleThresholds()
    classified = label_heads(read_heads(folder)[MEASURED_COLUMNS], thresholds, roles)
    run["classification"] = classification_record(classified, thresholds, roles)
    target = Path(out) if out is not None else folder
    _make_folder(target)
    problem = why_not_a_report(target)
    if problem is not None:  # classify writes heads.parquet and run.json: never over someone else's files
        raise OutputError(f"--out {target} is not a headscope report ({problem}); choose a new or empty folder")
    for name in (EXAMPLES_FILE, LAYERS_FILE):
        if target.resolve() != folder.resolve() and (folder / name).is_file():
            _copy_atomically(folder / name, target / name)
    write_table(classified, target / HEADS_FILE, HEADS_SCHEMA, metadata=parquet_metadata(run))
    write_json(run, target / RUN_FILE)
    return classified


def thresholds_of(run: dict) -> Thresholds:
    """The head-type thresholds a report was labelled with."""
    return _recorded(run, "thresholds", Thresholds)


def role_thresholds_of(run: dict) -> RoleThresholds:
    """The role thresholds a report was labelled with."""
    return _recorded(run, "role_thresholds", RoleThresholds)


def _recorded(run: dict, key: str, kind):
    classification = run.get("classification")
    recorded = classification.get(key) if isinstance(classification, dict) else None
    try:
        return kind(**recorded) if recorded else kind()
    except (TypeError, ConfigError) as err:
        raise OutputError(f"run.json holds unusable classification {key.replace('_', ' ')} ({err})") from None


def chart_title(run: dict) -> str:
    model, corpus = _section(run, "model"), _section(run, "corpus")
    name = Path(str(corpus.get("path", "corpus"))).name
    return f"{model.get('input', '?')} on {name} ({corpus.get('sentences', '?')} sentences)"


def _section(run: dict, key: str) -> dict:
    value = run.get(key)
    return value if isinstance(value, dict) else {}


def read_layers(folder: Path) -> pd.DataFrame | None:
    """The layers table (per-layer means and their intervals), or None when the report has none."""
    path = Path(folder) / LAYERS_FILE
    return read_table(path, LAYERS_SCHEMA) if path.is_file() else None


def read_examples(folder: Path) -> pd.DataFrame | None:
    """Every head's attention on the example sentence, or None when the report has none."""
    path = Path(folder) / EXAMPLES_FILE
    if not path.is_file():
        return None
    examples = read_table(path, EXAMPLES_SCHEMA)
    positions = examples[["query", "key"]]
    if examples.empty:
        return None
    if positions.isna().any().any() or (positions < 0).any().any() or (positions.max() > 4096).any():
        raise OutputError(f"{path} is not a headscope table: query and key must be token positions")
    return examples


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {folder}: {err.strerror or err}") from None


def plot_report(folder: Path, *, fmt: str = "png", out: Path | None = None, page: bool = True) -> list[Path]:
    """Draw every chart of the report in `folder`, and its report.html (into `out`, default the same folder);
    return their paths."""
    from headscope.report.charts import draw_charts  # matplotlib is imported only when charts are drawn

    if fmt not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {fmt!r}")
    folder = Path(folder)
    run = read_run(folder)
    heads, layers, examples = read_heads(folder), read_layers(folder), read_examples(folder)
    target = Path(out) if out is not None else folder
    _make_folder(target)
    thresholds, title = thresholds_of(run), chart_title(run)
    written = draw_charts(heads, layers, examples, thresholds, title=title, folder=target, fmt=fmt)
    if page:
        written.append(write_report_page(run, heads, layers, examples, thresholds, target / PAGE_FILE))
    return written


def write_report_page(run, heads, layers, examples, thresholds, path: Path) -> Path:
    """report.html from the frames in hand (analyze) or read back (plot)."""
    from headscope.report.page import FILES, report_page, write_page  # plotly is imported only for the page

    present = tuple(name for name in FILES if (path.parent / name).exists())  # e.g. no sentence_heads.parquet
    page = report_page(run, heads, layers, examples, thresholds, title=chart_title(run), files=present)
    return write_page(page, path)


def _copy_atomically(source: Path, destination: Path) -> None:
    with atomic_path(destination) as tmp:
        shutil.copyfile(source, tmp)
