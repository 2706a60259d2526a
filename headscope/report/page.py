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
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.columns import COLUMNS, HEADS_COLUMNS, INTERVAL_METRICS, PROBE_PATTERNS
from headscope.errors import one_line
from headscope.files import atomic_path
from headscope.labels import PROBE_ROLES
from headscope.layout import (
    EXAMPLES_FILE,
    EXEMPLARS_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    RUN_FILE,
    SENTENCE_HEADS_FILE,
    SENTENCES_FILE,
)
from headscope.report import palette

FILES = (HEADS_FILE, LAYERS_FILE, SENTENCE_HEADS_FILE, SENTENCES_FILE, EXAMPLES_FILE, EXEMPLARS_FILE, RUN_FILE)
# The all-heads table: who the head is, its role and why, the probe scores, then its type and every other column
# the selector offers.
_PROBES = tuple(f"probe_{pattern}" for pattern in PROBE_PATTERNS)
TABLE = ("layer", "head", "role", "role_reason", "role_detail", *_PROBES, "head_type", "kv_head")
TABLE += (*(c.name for c in HEADS_COLUMNS if c.shown and c.name not in _PROBES), "top_offset", "n_rows")
# What the head panel shows first: the head's role and why, what it does off the sink, and how much it writes.
PANEL_FIRST = ("role", "role_reason", "role_detail", "write_ratio", "write_norm", "head_type")
# ... and the evidence a reader looks at next; every other column (some seventy) waits behind "every column".
PANEL_NEXT = ("dormant_check", "entropy", "norm_entropy", "locality", "sink", "sink_rate", "active_rows",
              "prev_token", *_PROBES, "ov_copying", "top_offset", "top_offset_share", "sink_value_ratio", "logit_std",
              "estimate_mean", "ablation_mean")  # fmt: skip
# Columns report.js reads by name (the heads grid, labels, filter, classification map).
SCRIPT_READS = ("layer", "head", "head_type", "role", "top_offset", "locality", "norm_entropy")


@cache
def asset(name: str) -> str:
    return (resources.files("headscope.report") / "assets" / name).read_text(encoding="utf-8")


@cache
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs  # the bundle the package ships: no network, MIT licensed

    return _without_urls(get_plotlyjs())


def plotly_from_notebook(page: str) -> str:
    """`page` (from page_html) with its plotly.js replaced by assets/plotly_from_notebook.js, which runs the copy a
    notebook's own page holds (headscope.report.notebook)."""
    bundle = _plotly_js()
    if bundle not in page:
        raise ValueError("the page holds no plotly.js of this headscope's to replace")
    return page.replace(bundle, asset("plotly_from_notebook.js"), 1)


def plotly_held() -> str:
    """plotly.js as inert text for a notebook's own page (assets/plotly_held.html: type text/plain, never run)."""
    return fill_template(asset("plotly_held.html").strip(), {"PLOTLY": _plotly_js()})


def _without_urls(script: str) -> str:
    """The same script with every "://" written ":\\/\\/": identical inside JS strings, regexes and comments,
    and no literal http:// or https:// left in the page. (plotly.js holds URLs as strings: SVG namespaces,
    its logo's link, map-tile servers for map traces; the page fetches none of them, as the browser test checks.)"""
    return script.replace("://", ":\\/\\/")


def _columns(frame: pd.DataFrame, names, digits: int = 6) -> dict[str, list]:
    """Columnar JSON-ready values: numbers rounded to `digits` significant digits, NaN as null."""
    out = {}
    for name in names:
        if name not in frame:
            continue
        values = frame[name]
        if pd.api.types.is_bool_dtype(values):
            out[name] = [bool(v) for v in values]
        elif pd.api.types.is_float_dtype(values):
            out[name] = [None if not math.isfinite(v) else float(f"{v:.{digits}g}") for v in values.to_numpy(float)]
        elif pd.api.types.is_integer_dtype(values):  # a nullable one (a full-attention layer's window) holds NA
            out[name] = [None if pd.isna(v) else int(v) for v in values]
        else:
            out[name] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v) for v in values]
    return out


# Example weights the page carries, one byte each; the report's examples.parquet holds them all, exactly.
VIEW_BYTES = 6_000_000


def _views(examples: pd.DataFrame | None, heads: pd.DataFrame) -> list[dict]:
    """The example views for the page: per (source, sentence), its tokens and, for the heads it carries, every
    (t, t) weight as base64 bytes (weight * 255, rounded). Within VIEW_BYTES, in this order: every head on the
    first corpus sentence, the probe-role heads on the probe sequence, the other heads there, the other corpus
    sentences."""
    if examples is None or examples.empty:
        return []
    probe_heads = {(int(r.layer), int(r.head)) for r in heads.itertuples() if r.role in PROBE_ROLES}
    groups = list(examples.groupby(["source", "sentence_id"], sort=False))
    corpus = [key for key, _ in groups if key[0] == "corpus"]
    sizes = {key: int(max(part["query"].max(), part["key"].max())) + 1 for key, part in groups}
    ranked = []
    for key, part in groups:
        for layer, head in part[["layer", "head"]].drop_duplicates().itertuples(index=False):
            pair = (int(layer), int(head))
            rank = 0 if corpus and key == corpus[0] else 3 if key[0] == "corpus" else 1 if pair in probe_heads else 2
            ranked.append((rank, key, pair))
    kept: dict[tuple, list] = {}
    spent = 0
    for _, key, pair in sorted(ranked, key=lambda item: item[0]):
        if spent + sizes[key] ** 2 > VIEW_BYTES:
            continue
        kept.setdefault(key, []).append(pair)
        spent += sizes[key] ** 2
    views = []
    for key, part in groups:
        if key in kept:
            views.append(_view(key, part, sorted(kept[key]), sizes[key]))
    return views


def _view(key: tuple, part: pd.DataFrame, pairs: list, n: int) -> dict:
    tokens = [""] * n
    for query, token in part.drop_duplicates("query")[["query", "query_token"]].itertuples(index=False):
        tokens[int(query)] = str(token)
    index = {pair: i for i, pair in enumerate(pairs)}
    rows = np.array([index.get((int(a), int(b)), -1) for a, b in zip(part["layer"], part["head"], strict=True)])
    keep = rows >= 0
    grid = np.zeros((len(pairs), n, n), dtype=np.uint8)
    weights = np.nan_to_num(part["weight"].to_numpy(float)[keep])
    grid[rows[keep], part["query"].to_numpy()[keep], part["key"].to_numpy()[keep]] = np.clip(
        np.round(weights * 255), 0, 255
    ).astype(np.uint8)
    source, sentence_id = key
    label = f"corpus sentence {sentence_id}" if source == "corpus" else "probe: repeated random tokens"
    return {
        "source": source,
        "sentence_id": int(sentence_id),
        "label": label,
        "tokens": tokens,
        "heads": [list(pair) for pair in pairs],
        "weights": base64.b64encode(grid.tobytes()).decode("ascii"),
    }


# Context tokens of exemplars the page carries (with their row's numbers, about 9 bytes each): every head's top
# ranks, as many ranks as fit (all ten of GPT-2's or SmolLM2's, one of a 70B model's); exemplars.parquet holds all.
EXEMPLAR_TOKENS = 400_000
# What each built-in kind scores a row by (a detector's kind is its SPEC).
EXEMPLAR_KINDS = {
    "sharp": "the row's largest attention weight off the first token",
    "write": "the row's write norm ||W_h z_h(t)||",
    "induction": "the row's weight on the token after an earlier occurrence of its own token (after-same-token)",
    "duplicate": "the row's weight on earlier occurrences of its own token (same-token)",
    "previous": "the row's weight on the previous token (offset:1)",
}


def _exemplars(frame: pd.DataFrame | None, run: dict) -> dict | None:
    """Each head's exemplars for the page: the top ranks that fit EXEMPLAR_TOKENS, columnar, their contexts as
    indices into one list of distinct token texts (a corpus repeats its tokens)."""
    if frame is None or frame.empty:
        return None
    sizes = frame.groupby("rank")["context"].apply(lambda contexts: contexts.map(len).sum()).sort_index().cumsum()
    shown, kept = int((sizes <= EXEMPLAR_TOKENS).sum()), int(frame["rank"].max())
    kind = frame["kind"].astype(str)  # analyze's own frame holds a categorical, with every kind it could have made
    kinds = list(dict.fromkeys(kind))  # as analyze wrote them: sharp, write, the patterns, the detectors
    frame = frame.assign(kind_order=kind.map(kinds.index))[frame["rank"] <= shown]
    frame = frame.sort_values(["layer", "head", "kind_order", "rank"], kind="stable")
    codes, vocabulary = pd.factorize(pd.Series([*frame["key_token"], *frame["context"].explode()], dtype=object))
    key_tokens, context_tokens = codes[: len(frame)], codes[len(frame) :]
    ends = np.cumsum(frame["context"].map(len).to_numpy())
    contexts = [chunk.tolist() for chunk in np.split(context_tokens, ends[:-1])] if len(frame) else []
    settings = run.get("settings") if isinstance(run.get("settings"), dict) else {}
    specs = dict(entry.split("=", 1) for entry in settings.get("detectors") or [] if "=" in entry)
    columns = _columns(frame, ("layer", "head", "rank", "sentence", "row", "key", "context_start"))
    columns |= _columns(frame, ("weight", "score"), digits=4)  # as the strips show them
    return columns | {
        "kinds": kinds,
        "about": [EXEMPLAR_KINDS.get(kind) or f"detector {kind} = {specs.get(kind, '?')}" for kind in kinds],
        "kind": frame["kind_order"].tolist(),
        "key_token": [None if code < 0 else int(code) for code in key_tokens],
        "context": contexts,
        "tokens": [str(token) for token in vocabulary],
        "shown": shown,
        "kept": kept,
    }


def _run_summary(run: dict) -> dict:
    model, corpus, timings = (
        run.get(key) if isinstance(run.get(key), dict) else {} for key in ("model", "corpus", "timings")
    )
    architecture = model.get("architecture") if isinstance(model.get("architecture"), dict) else {}
    versions = run.get("versions") if isinstance(run.get("versions"), dict) else {}
    return {
        "model": model.get("name") or model.get("input"),
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


def report_page(report, *, files_in: Path | Sequence[Path] | None = None) -> str:
    """The whole report.html of `report`, as a string; it links to the report's tables found in `files_in` (a
    folder, or several: a report rewritten in place keeps its tables where they are)."""
    folders = [] if files_in is None else [files_in] if isinstance(files_in, Path) else list(files_in)
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
        "views": _views(report.examples, heads),
        "exemplars": _exemplars(report.exemplars, report.run),
        "probe_roles": PROBE_ROLES,  # role -> the probe pattern and exemplar kind that shows it
        "thresholds": report.thresholds.to_dict(),
        "columns": {
            "selectable": shown,
            "scales": {name: COLUMNS[name].scale for name in shown},
            "table": [name for name in TABLE if name in present],
            "panel": [name for name in (*PANEL_FIRST, *PANEL_NEXT) if name in present],
            "panel_more": [name for name in present if name not in (*PANEL_FIRST, *PANEL_NEXT)],
            "text": [name for name in present if not COLUMNS[name].numeric],
            "about": {name: COLUMNS[name].about for name in present},
        },
        "palette": palette.as_dict(),
        "files": [name for name in FILES if any((folder / name).exists() for folder in folders)],
    }
    return page_html("headscope", "report.html", "report.js", report.title, data)


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
    return page_html("headscope compare", "compare.html", "compare.js", comparison.title, data)


def page_html(heading: str, body: str, app: str, title: str, data: dict) -> str:
    """The shell (assets/page.html) around a page's body and script, with its title and data."""
    title = html.escape(title)
    return fill_template(
        asset("page.html"),
        {
            "HEADING": heading,
            "TITLE": title,
            "STYLE": asset("style.css"),
            "PLOTLY": _plotly_js(),
            "BODY": fill_template(asset(body), {"TITLE": title}),
            "DATA": _safe_json(data),
            "APP": asset("common.js") + asset(app),
        },
    )


def fill_template(template: str, values: dict[str, str]) -> str:
    """Every __NAME__ placeholder of `template` replaced by values[NAME], in one pass: nothing inserted is read
    again, so a title or a model name that looks like a placeholder stays as it is."""
    return re.sub(r"__([A-Z]+)__", lambda match: values[match.group(1)], template)


def write_page(page: str, path: Path) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(page, encoding="utf-8")
    return path


def write_view(make: Callable[[], str], path: Path) -> str | None:
    """Write the page `make()` builds to `path`. A page is a view of what the command has already written, so a page
    that cannot be built or written (a full disk: every page carries plotly.js, about 4.5 MB) never takes the result
    down: None when written, else "NAME (why)" for the command to say."""
    try:
        write_page(make(), path)
    except Exception as err:  # any failure of the view: the tables and the record stay, the user is told
        return f"{path.name} ({one_line(err)})"
    return None
