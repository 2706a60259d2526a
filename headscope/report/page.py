"""report.html and compare.html: one self-contained page each. Never imports torch.

The page's HTML, CSS and JavaScript are package data (headscope/report/assets/); this module builds the data the
script reads (columnar JSON: the tables, which columns to offer and how, their descriptions and the palette,
the example attention quantised to one byte per weight) and fills the template. Everything is inline,
Plotly's JavaScript included (from the `plotly` package, MIT): the page asks for nothing over the network.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.columns import COLUMNS, HEADS_COLUMNS, IDS, INTERVAL_METRICS
from headscope.layout import EXAMPLES_FILE, HEADS_FILE, LAYERS_FILE, RUN_FILE, SENTENCE_HEADS_FILE, SENTENCES_FILE
from headscope.output import atomic_path
from headscope.report import palette
from headscope.report.report import Report

FILES = (HEADS_FILE, LAYERS_FILE, SENTENCE_HEADS_FILE, SENTENCES_FILE, EXAMPLES_FILE, RUN_FILE)
# The all-heads table: who the head is and its labels, every column the selector offers, then the rest.
TABLE = (*IDS, "head_type", "role", *(c.name for c in HEADS_COLUMNS if c.shown), "top_offset", "n_rows")
# Columns report.js reads by name (the heads grid, labels, filter, classification map).
SCRIPT_READS = ("layer", "head", "head_type", "role", "top_offset", "locality", "norm_entropy")


@cache
def _asset(name: str) -> str:
    return (resources.files("headscope.report") / "assets" / name).read_text(encoding="utf-8")


def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs  # the bundle the package ships: no network, MIT licensed

    return _without_urls(get_plotlyjs())


def _without_urls(script: str) -> str:
    """The same script with every "://" written ":\\/\\/": identical inside JS strings, regexes and comments,
    and no literal http:// or https:// left in the page. (plotly.js holds URLs as strings: SVG namespaces,
    its logo's link, map-tile servers for map traces; the page fetches none of them, as the browser test checks.)"""
    return script.replace("://", ":\\/\\/")


def _columns(frame: pd.DataFrame, names) -> dict[str, list]:
    """Columnar JSON-ready values: numbers rounded to 6 significant digits, NaN as null."""
    out = {}
    for name in names:
        if name not in frame:
            continue
        values = frame[name]
        if pd.api.types.is_bool_dtype(values):
            out[name] = [bool(v) for v in values]
        elif pd.api.types.is_float_dtype(values):
            out[name] = [None if not math.isfinite(v) else float(f"{v:.6g}") for v in values.to_numpy(float)]
        elif pd.api.types.is_integer_dtype(values):
            out[name] = [int(v) for v in values]
        else:
            out[name] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v) for v in values]
    return out


def _examples(examples: pd.DataFrame | None) -> dict | None:
    """The example sentence's tokens and every head's (t, t) attention as base64 bytes (weight * 255, rounded)."""
    if examples is None or examples.empty:
        return None
    n = int(max(examples["query"].max(), examples["key"].max())) + 1
    tokens = [""] * n
    for query, token in examples.drop_duplicates("query")[["query", "query_token"]].itertuples(index=False):
        tokens[int(query)] = str(token)
    heads = examples[["layer", "head"]].drop_duplicates().sort_values(["layer", "head"])
    grid = np.zeros((len(heads), n, n), dtype=np.uint8)
    index = {(int(r.layer), int(r.head)): i for i, r in enumerate(heads.itertuples())}
    rows = np.array([index[(int(a), int(b))] for a, b in zip(examples["layer"], examples["head"], strict=True)])
    grid[rows, examples["query"].to_numpy(), examples["key"].to_numpy()] = np.clip(
        np.round(np.nan_to_num(examples["weight"].to_numpy(float)) * 255), 0, 255
    ).astype(np.uint8)
    return {
        "sentence_id": int(examples["sentence_id"].iloc[0]),
        "tokens": tokens,
        "heads": [[int(r.layer), int(r.head)] for r in heads.itertuples()],
        "weights": base64.b64encode(grid.tobytes()).decode("ascii"),
    }


def _run_summary(run: dict) -> dict:
    model, corpus, timings = (
        run.get(key) if isinstance(run.get(key), dict) else {} for key in ("model", "corpus", "timings")
    )
    architecture = model.get("architecture") if isinstance(model.get("architecture"), dict) else {}
    versions = run.get("versions") if isinstance(run.get("versions"), dict) else {}
    return {
        "model": model.get("input"),
        "architecture": architecture,
        "corpus": corpus.get("path"),
        "sentences": corpus.get("sentences"),
        "tokens": corpus.get("tokens"),
        "truncated": corpus.get("truncated_sentences"),
        "device": run.get("device"),
        "dtype": run.get("dtype"),
        "timings": timings,
        "headscope": versions.get("headscope"),
        "created": run.get("created"),
        "probes": run.get("probes"),
        "importance": run.get("importance"),
        "bootstrap": run.get("bootstrap"),
    }


def _safe_json(data) -> str:
    """JSON that cannot end or confuse the script element it sits in: no "<" at all, and no literal URL; a number
    that is not finite (a NaN in run.json, say) is null, "no value", as JSON has no NaN."""
    return _without_urls(json.dumps(_finite(data), separators=(",", ":"), allow_nan=False).replace("<", "\\u003c"))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def report_page(report: Report, *, files_in: Path | None = None) -> str:
    """The whole report.html of `report`, as a string; it links to the report's tables found in `files_in`."""
    heads = report.heads
    present = [c.name for c in HEADS_COLUMNS if c.name in heads and heads[c.name].notna().any()]
    shown = [name for name in present if COLUMNS[name].shown]
    # The columns with a value, and every column the script reads by name (null throughout where it has none).
    sent = heads.reindex(columns=list(dict.fromkeys((*SCRIPT_READS, *present))))
    data = {
        "title": report.title,
        "run": _run_summary(report.run),
        "heads": _columns(sent, sent.columns),
        "layers": _columns(report.layers, report.layers.columns) if report.layers is not None else None,
        "examples": _examples(report.examples),
        "thresholds": report.thresholds.to_dict(),
        "columns": {
            "selectable": shown,
            "diverging": [name for name in shown if COLUMNS[name].diverging],
            "table": [name for name in TABLE if name in present],
            "panel": present,
            "text": [name for name in present if not COLUMNS[name].numeric],
            "about": {name: COLUMNS[name].about for name in present},
        },
        "palette": palette.as_dict(),
        "files": [name for name in FILES if files_in is not None and (files_in / name).exists()],
    }
    return _page("headscope", "report.html", "report.js", report.title, data)


def compare_page(comparison) -> str:
    """compare.html: the comparison's per-head deltas (same grid) and both layer gradients, self-contained."""
    heads = comparison.heads
    selectable = []
    if heads is not None:
        names = (f"{c.name}_delta" for c in HEADS_COLUMNS if c.shown)
        selectable = [name for name in names if name in heads and heads[name].notna().any()]
    data = {
        "title": comparison.title,
        "record": comparison.record,
        "heads": _columns(heads, heads.columns) if heads is not None else None,
        "layers": _columns(comparison.layers, comparison.layers.columns),
        "transitions": {
            k: {"index": list(t.index), "columns": list(t.columns), "values": t.to_numpy().tolist()}
            for k, t in comparison.transitions.items()
        },
        "selectable": selectable,
        "metrics": list(INTERVAL_METRICS),
        "palette": palette.as_dict(),
    }
    return _page("headscope compare", "compare.html", "compare.js", comparison.title, data)


def _page(heading: str, body: str, app: str, title: str, data: dict) -> str:
    """The shell (assets/page.html) around a page's body and script, with its title and data."""
    title = html.escape(title)
    return _fill(
        _asset("page.html"),
        {
            "HEADING": heading,
            "TITLE": title,
            "STYLE": _asset("style.css"),
            "PLOTLY": _plotly_js(),
            "BODY": _fill(_asset(body), {"TITLE": title}),
            "DATA": _safe_json(data),
            "APP": _asset("common.js") + _asset(app),
        },
    )


def _fill(template: str, values: dict[str, str]) -> str:
    """Every __NAME__ placeholder of `template` replaced by values[NAME], in one pass: nothing inserted is read
    again, so a title or a model name that looks like a placeholder stays as it is."""
    return re.sub(r"__([A-Z]+)__", lambda match: values[match.group(1)], template)


def write_page(page: str, path: Path) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return path
