"""report.html: one self-contained page to explore a report. Never imports torch.

Everything is inline: Plotly's JavaScript (from the `plotly` package, MIT), the styles, the data (columnar
JSON; the example attention quantised to one byte per weight) and a small script that wires hovering,
clicking, the metric selector and the sortable, filterable table. The page asks for nothing over the network.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.config import Thresholds
from headscope.output import atomic_path

# Columns the metric selector offers, in order (those the report has values for).
SELECTABLE = (
    "entropy",
    "norm_entropy",
    "diagonal",
    "locality",
    "sink",
    "sink_rate",
    "prev_token",
    "max_weight",
    "top_offset_share",
    "probe_induction",
    "probe_duplicate",
    "probe_previous",
    "ablation_zero",
    "ablation_mean",
    "attribution_zero",
    "attribution_mean",
)
DIVERGING = ("ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean", "locality")
TABLE_COLUMNS = (
    "layer",
    "head",
    "kv_head",
    "head_type",
    "role",
    "entropy",
    "entropy_ci_low",
    "entropy_ci_high",
    "norm_entropy",
    "diagonal",
    "locality",
    "sink",
    "sink_rate",
    "top_offset",
    "top_offset_share",
    "prev_token",
    "max_weight",
    "probe_induction",
    "probe_duplicate",
    "probe_previous",
    "ablation_zero",
    "ablation_mean",
    "attribution_zero",
    "attribution_mean",
    "n_rows",
)
PANEL_EXTRA = (
    "type_reason",
    "role_reason",
    "norm_entropy_ci_low",
    "norm_entropy_ci_high",
    "sink_ci_low",
    "sink_ci_high",
    "diagonal_ci_low",
    "diagonal_ci_high",
    "probe_induction_ci_low",
    "probe_induction_ci_high",
    "probe_duplicate_ci_low",
    "probe_duplicate_ci_high",
    "probe_previous_ci_low",
    "probe_previous_ci_high",
    "probe_induction_chance",
    "probe_duplicate_chance",
    "probe_previous_chance",
)
FILES = (
    "heads.parquet",
    "layers.parquet",
    "sentence_heads.parquet",
    "sentences.parquet",
    "examples.parquet",
    "run.json",
)


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
    """JSON that cannot end or confuse the <script> it sits in: no "<" at all, and no literal URL."""
    return _without_urls(json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c"))


def report_page(
    run: dict,
    heads: pd.DataFrame,
    layers: pd.DataFrame | None,
    examples: pd.DataFrame | None,
    thresholds: Thresholds,
    *,
    title: str,
    files: tuple[str, ...] = FILES,
) -> str:
    """The whole page, as a string; `files` are the report's tables that the page links to."""
    selectable = [c for c in SELECTABLE if c in heads and heads[c].notna().any()]
    data = {
        "title": title,
        "run": _run_summary(run),
        "heads": _columns(heads, dict.fromkeys((*TABLE_COLUMNS, *PANEL_EXTRA))),
        "layers": _columns(layers, layers.columns) if layers is not None else None,
        "examples": _examples(examples),
        "thresholds": thresholds.to_dict(),
        "selectable": selectable,
        "diverging": [c for c in DIVERGING if c in selectable],
        "files": list(files),
    }
    return _fill("headscope", _BODY, title, data, _APP)


def compare_page(comparison, *, title: str) -> str:
    """compare.html: the comparison's per-head deltas (same grid) and both layer gradients, self-contained."""
    heads = comparison.heads
    selectable = []
    if heads is not None:
        selectable = [f"{m}_delta" for m in SELECTABLE if f"{m}_delta" in heads and heads[f"{m}_delta"].notna().any()]
    data = {
        "title": title,
        "record": comparison.record,
        "heads": _columns(heads, heads.columns) if heads is not None else None,
        "layers": _columns(comparison.layers, comparison.layers.columns),
        "transitions": {
            k: {"index": list(t.index), "columns": list(t.columns), "values": t.to_numpy().tolist()}
            for k, t in comparison.transitions.items()
        },
        "selectable": selectable,
    }
    return _fill("headscope compare", _COMPARE_BODY, title, data, _COMPARE_APP)


def _fill(heading: str, body: str, title: str, data: dict, app: str) -> str:
    """The shell with a page's body, title, app (after the common script) and data."""
    filled = _SHELL.replace("__BODY__", body).replace("__HEADING__", heading).replace("__STYLE__", _STYLE)
    filled = filled.replace("__TITLE__", _html_escape(title)).replace("__APP__", _COMMON_APP + app)
    # The data goes in last: nothing in it can be mistaken for a placeholder.
    return filled.replace("__PLOTLY__", _plotly_js()).replace("__DATA__", _safe_json(data))


def _html_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def write_page(html: str, path: Path) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(html, encoding="utf-8")
    return path


_STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#263238;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;font-size:13px;color:#cfd8dc}
main{padding:12px 24px;max-width:1500px}section{background:#fff;border:1px solid #e0e0e0;border-radius:6px;
margin:12px 0;padding:12px 16px}h2{font-size:16px;margin:0 0 8px}
.row{display:flex;gap:16px;flex-wrap:wrap}.grow{flex:1 1 560px;min-width:360px}
#panel{flex:0 0 340px;font-size:13px}#panel table{border-collapse:collapse;width:100%}
#panel td{padding:2px 4px;border-bottom:1px solid #eee;vertical-align:top}#panel td:first-child{color:#555}
.muted{color:#777;font-size:12px}dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:0;
font-size:13px}dt{color:#555}dd{margin:0}
#heads-table{border-collapse:collapse;font-size:12px;width:100%}#heads-table th{position:sticky;top:0;
background:#eceff1;cursor:pointer;padding:4px;text-align:right;white-space:nowrap}
#heads-table td{padding:2px 4px;text-align:right;white-space:nowrap;border-bottom:1px solid #f0f0f0}
#heads-table td.text,#heads-table th.text{text-align:left}.table-box{max-height:520px;overflow:auto}
code,pre{background:#f5f5f5;border-radius:4px}pre{padding:8px;overflow:auto;font-size:12px}
select,input{font-size:13px;padding:2px 4px}"""

# Both pages: the same head, style, plotly.js, data island and script; `_fill` puts a page's body and app in.
_SHELL = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>__HEADING__: __TITLE__</title>
<style>
__STYLE__
</style>
<script>__PLOTLY__</script>
</head><body>
__BODY__
<script id="data" type="application/json">__DATA__</script>
<script>__APP__</script>
</body></html>
"""

_BODY = """<header><h1>__TITLE__</h1><p id="run-line"></p></header>
<main>
<section><h2>The run</h2><dl id="run-details"></dl></section>
<section><h2>Every head</h2>
<p>Colour by <select id="metric"></select> <span class="muted">hover a cell for the head's numbers; click it for
its attention on the example sentence</span></p>
<div class="row"><div class="grow"><div id="heatmap"></div></div>
<div id="panel"><p class="muted">Hover a head.</p></div></div>
<div id="example"></div></section>
<section><h2>Entropy by layer</h2><div id="gradient"></div></section>
<section><h2>Head types and roles per layer</h2><div class="row"><div class="grow" id="types"></div>
<div class="grow" id="roles"></div></div></section>
<section><h2>Why each head got its type</h2><div id="classification"></div></section>
<section><h2>All heads</h2><p><input id="filter" size="40" placeholder="filter, e.g.: induction, layer 17">
<span class="muted" id="table-count"></span></p><div class="table-box"><table id="heads-table"></table></div>
</section>
<section><h2>The tables</h2><ul id="files"></ul>
<pre>import pandas as pd
heads = pd.read_parquet("heads.parquet")          # one row per (layer, head)
heads.groupby("layer")["entropy"].mean()          # the layer-depth gradient
heads.sort_values("probe_induction", ascending=False).head()</pre></section>
</main>"""

# What both pages' scripts use: the data, the number format, the heads grid, the heatmap and its selector.
_COMMON_APP = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const CONFIG = {displaylogo: false, responsive: true, showLink: false};
const fmt = v => v === null || v === undefined ? "-" : typeof v === "boolean" ? (v ? "yes" : "no") :
  typeof v !== "number" ? String(v) : Number.isInteger(v) ? String(v) :
  Math.abs(v) >= 1000 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : v.toFixed(4);

// Heads as a layers x heads grid: each (layer, head)'s row in the columns of H, and any column laid out on it.
function headGrid(H) {
  const N = H.layer.length, cell = {};  // "layer,head" -> row index
  const layers = [...new Set(H.layer)].sort((a, b) => a - b), heads = [...new Set(H.head)].sort((a, b) => a - b);
  for (let i = 0; i < N; i++) cell[H.layer[i] + "," + H.head[i]] = i;
  const grid = column => {
    const z = layers.map(() => heads.map(() => null));
    for (let i = 0; i < N; i++) z[layers.indexOf(H.layer[i])][heads.indexOf(H.head[i])] = column[i];
    return z;
  };
  return {N, layers, heads, cell, grid};
}

// The #heatmap plot of one column; diverging columns (deltas, locality) get symmetric limits around 0.
function drawHeatmap(G, H, metric, diverging) {
  const values = H[metric].filter(v => v !== null), limit = Math.max(...values.map(Math.abs), 1e-12);
  const trace = {type: "heatmap", x: G.heads, y: G.layers, z: G.grid(H[metric]), hoverongaps: false,
    colorscale: diverging ? "RdBu" : "Magma", reversescale: !diverging,
    zmin: diverging ? -limit : undefined, zmax: diverging ? limit : undefined,
    colorbar: {title: {text: metric}}, hovertemplate: "layer %{y}, head %{x}<br>" + metric + " %{z}<extra></extra>"};
  const layout = {margin: {t: 10, r: 10, b: 40, l: 50}, height: Math.min(900, 160 + 22 * G.layers.length),
    xaxis: {title: {text: "head"}, dtick: G.heads.length > 32 ? 8 : 1}, yaxis: {title: {text: "layer"},
    autorange: "reversed", dtick: G.layers.length > 32 ? 8 : 1}};
  return Plotly.react("heatmap", [trace], layout, CONFIG);
}

// The #metric selector: one option per name, redrawing with `draw` on change.
function fillSelect(names, draw) {
  const select = document.getElementById("metric");
  for (const m of names) { const o = document.createElement("option"); o.value = o.textContent = m;
    select.appendChild(o); }
  select.onchange = () => draw(select.value);
}
"""

_APP = r"""
const H = D.heads, G = headGrid(H), {N, layers, heads, cell} = G;
const TYPE_COLOURS = {local: "#1b9e77", copy: "#d95f02", broad: "#7570b3", mixed: "#9e9e9e"};
const ROLE_COLOURS = {"induction": "#e7298a", "duplicate-token": "#66a61e", "previous-token": "#1b9e77",
  "sink": "#d95f02", "positional": "#e6ab02", "broad": "#7570b3", "other": "#bdbdbd"};

function runDetails() {
  const r = D.run, t = r.timings || {}, a = r.architecture || {};
  document.getElementById("run-line").textContent = `${r.sentences} sentences, ${r.tokens} tokens; ` +
    `${a.layers} layers x ${a.heads} heads (${a.kv_heads} KV heads); ${r.device}, ${r.dtype}; headscope ${r.headscope}`;
  const rows = [["model", r.model], ["corpus", r.corpus], ["sentences", r.sentences], ["tokens", r.tokens],
    ["truncated sentences", r.truncated], ["device, dtype", `${r.device}, ${r.dtype}`],
    ["architecture", JSON.stringify(a)], ["timings (s)", `load ${t.load_seconds}, measure ${t.measure_seconds}, ` +
    `probes ${t.probe_seconds}, importance ${t.importance_seconds}, write ${t.write_seconds}`],
    ["tokens/s", t.tokens_per_second], ["probes", r.probes ? JSON.stringify(r.probes) : "not run"],
    ["importance", r.importance ? JSON.stringify(r.importance) : "not measured"],
    ["intervals", r.bootstrap ? `bootstrap over sentences, ${r.bootstrap.replicates} replicates` : "none"],
    ["headscope", r.headscope], ["created", r.created]];
  const dl = document.getElementById("run-details");
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k; dl.appendChild(dt);
    const dd = document.createElement("dd"); dd.textContent = fmt(v); dl.appendChild(dd);
  }
}

const heatmap = metric => drawHeatmap(G, H, metric, D.diverging.includes(metric));

function panel(i) {
  const keys = ["layer", "head", "kv_head", "head_type", "type_reason", "role", "role_reason", "entropy",
    "entropy_ci_low", "entropy_ci_high", "norm_entropy", "norm_entropy_ci_low", "norm_entropy_ci_high", "diagonal",
    "diagonal_ci_low", "diagonal_ci_high", "locality", "sink", "sink_ci_low", "sink_ci_high", "sink_rate",
    "top_offset", "top_offset_share", "prev_token", "max_weight", "probe_induction", "probe_induction_ci_low",
    "probe_induction_ci_high", "probe_induction_chance", "probe_duplicate", "probe_duplicate_ci_low",
    "probe_duplicate_ci_high", "probe_previous", "probe_previous_ci_low", "probe_previous_ci_high",
    "ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean", "n_rows"];
  const table = document.createElement("table");
  table.id = "panel-table";
  for (const k of keys) {
    if (!(k in H)) continue;
    const tr = table.insertRow(), a = tr.insertCell(), b = tr.insertCell();
    a.textContent = k; b.textContent = fmt(H[k][i]); b.dataset.key = k;
  }
  const box = document.getElementById("panel");
  box.replaceChildren();
  const title = document.createElement("h3");
  title.textContent = `layer ${H.layer[i]}, head ${H.head[i]}`; title.id = "panel-title";
  box.append(title, table);
}

function example(i) {
  const E = D.examples, box = document.getElementById("example");
  if (!E) { box.textContent = "This report has no example sentence."; return; }
  const at = E.heads.findIndex(([l, h]) => l === H.layer[i] && h === H.head[i]);
  if (at < 0) { box.textContent = "No example attention for this head."; return; }
  const n = E.tokens.length, bytes = atob(E.weights), z = [];
  for (let q = 0; q < n; q++) {
    const row = [];
    for (let k = 0; k < n; k++) row.push(bytes.charCodeAt(at * n * n + q * n + k) / 255);
    z.push(row);
  }
  const labels = E.tokens.map((t, j) => `${j}: ${t}`);
  Plotly.react("example", [{type: "heatmap", z: z, x: labels, y: labels, zmin: 0, zmax: 1, colorscale: "Blues",
    reversescale: true, hovertemplate: "query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>"}],
    {title: {text: `layer ${H.layer[i]}, head ${H.head[i]}: attention on sentence ${E.sentence_id}`},
     height: 420 + 8 * n, margin: {l: 120, b: 120, t: 40}, yaxis: {autorange: "reversed", title: {text: "query"}},
     xaxis: {title: {text: "key (attended to)"}, tickangle: -60}}, CONFIG);
}

function gradient() {
  const L = D.layers;
  if (!L) return;
  const traces = [];
  if (L.entropy_ci_low && L.entropy_ci_low.some(v => v !== null)) {
    traces.push({x: L.layer, y: L.entropy_ci_high, mode: "lines", line: {width: 0}, showlegend: false,
      hoverinfo: "skip"});
    traces.push({x: L.layer, y: L.entropy_ci_low, mode: "lines", line: {width: 0}, fill: "tonexty",
      fillcolor: "rgba(221,132,82,0.35)", name: "95% interval (bootstrap over sentences)"});
  }
  traces.push({x: L.layer, y: L.entropy, mode: "lines+markers", name: "mean entropy over heads",
    line: {color: "#4c72b0"}});
  Plotly.react("gradient", traces, {height: 380, margin: {t: 10}, xaxis: {title: {text: "layer"}},
    yaxis: {title: {text: "nats"}}, legend: {orientation: "h", y: -0.25}}, CONFIG);
}

function perLayer(target, column, colours) {
  const traces = Object.keys(colours).map(name => ({type: "bar", name: name, marker: {color: colours[name]},
    x: layers, y: layers.map(l => H[column].filter((v, i) => v === name && H.layer[i] === l).length)}));
  Plotly.react(target, traces, {barmode: "stack", height: 340, margin: {t: 30},
    title: {text: column === "role" ? "roles" : "head types"}, xaxis: {title: {text: "layer"}},
    yaxis: {title: {text: "heads"}}}, CONFIG);
}

function classification() {
  const t = D.thresholds;
  const traces = Object.keys(TYPE_COLOURS).map(name => {
    const idx = [...Array(N).keys()].filter(i => H.head_type[i] === name);
    return {type: "scatter", mode: "markers", name: name, marker: {color: TYPE_COLOURS[name], size: 6},
      x: idx.map(i => H.locality[i]), y: idx.map(i => H.norm_entropy[i]),
      text: idx.map(i => `layer ${H.layer[i]}, head ${H.head[i]}`),
      hovertemplate: "%{text}<br>locality %{x:.3f}<br>norm_entropy %{y:.3f}<extra></extra>"};
  });
  Plotly.react("classification", traces, {height: 440, margin: {t: 40}, xaxis: {title: {text: "locality"}},
    yaxis: {title: {text: "normalised entropy"}, range: [-0.02, 1.02]}, shapes: [
      {type: "line", x0: t.local_min_locality, x1: t.local_min_locality, y0: 0, y1: 1, line: {dash: "dash"}},
      {type: "line", xref: "paper", x0: 0, x1: 1, y0: t.copy_max_norm_entropy, y1: t.copy_max_norm_entropy,
       line: {dash: "dot"}},
      {type: "line", xref: "paper", x0: 0, x1: 1, y0: t.broad_min_norm_entropy, y1: t.broad_min_norm_entropy,
       line: {dash: "dot"}}]}, CONFIG);
}

let order = [...Array(N).keys()], sortKey = null, sortUp = true;
const columns = ["layer", "head", "kv_head", "head_type", "role", "entropy", "entropy_ci_low", "entropy_ci_high",
  "norm_entropy", "diagonal", "locality", "sink", "sink_rate", "top_offset", "top_offset_share", "prev_token",
  "max_weight", "probe_induction", "probe_duplicate", "probe_previous", "ablation_zero", "ablation_mean",
  "attribution_zero", "attribution_mean", "n_rows"].filter(c => c in H && H[c].some(v => v !== null));
const TEXT = new Set(["head_type", "role", "top_offset"]);
const LIMIT = 1000;

// A row's labels, each between bars: a filter term matches a whole label ("layer 3") or, without digits,
// part of one ("induct").
const LABELS = [...Array(N).keys()].map(i => `|layer ${H.layer[i]}|head ${H.head[i]}|${H.head_type[i]}|` +
  `${H.role[i]}|offset ${H.top_offset[i]}|`);
const matches = (i, t) => LABELS[i].includes(`|${t}|`) || (!/\d/.test(t) && LABELS[i].includes(t));

function table() {
  const terms = document.getElementById("filter").value.toLowerCase().split(",").map(t => t.trim())
    .filter(Boolean);
  const shown = order.filter(i => terms.every(t => matches(i, t)));
  const el = document.getElementById("heads-table");
  el.replaceChildren();
  const head = el.createTHead().insertRow();
  for (const c of columns) {
    const th = document.createElement("th");
    th.textContent = c + (sortKey === c ? (sortUp ? " ▲" : " ▼") : "");
    if (TEXT.has(c)) th.className = "text";
    th.onclick = () => sortBy(c);
    head.appendChild(th);
  }
  const body = el.createTBody();
  for (const i of shown.slice(0, LIMIT)) {
    const tr = body.insertRow();
    tr.dataset.row = i;
    for (const c of columns) {
      const td = tr.insertCell(); td.textContent = fmt(H[c][i]);
      if (TEXT.has(c)) td.className = "text";
    }
  }
  document.getElementById("table-count").textContent = `${shown.length} of ${N} heads` +
    (shown.length > LIMIT ? ` (first ${LIMIT} shown)` : "");
}

function sortBy(c) {
  sortUp = sortKey === c ? !sortUp : true; sortKey = c;
  const key = i => H[c][i], sign = sortUp ? 1 : -1;
  order.sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === null) return 1; if (y === null) return -1;
    return (x < y ? -1 : x > y ? 1 : a - b) * sign;
  });
  table();
}

function files() {
  const ul = document.getElementById("files");
  for (const name of D.files) {
    const li = document.createElement("li"), a = document.createElement("a");
    a.href = name; a.textContent = name; li.appendChild(a); ul.appendChild(li);
  }
}

function main() {
  runDetails();
  fillSelect(D.selectable, heatmap);
  heatmap(D.selectable[0]).then(gd => {
    gd.on("plotly_hover", e => { const p = e.points[0]; panel(cell[p.y + "," + p.x]); });
    gd.on("plotly_click", e => { const p = e.points[0]; const i = cell[p.y + "," + p.x]; panel(i); example(i); });
    document.body.dataset.ready = "true";
  });
  gradient(); perLayer("types", "head_type", TYPE_COLOURS); perLayer("roles", "role", ROLE_COLOURS);
  classification(); table(); files();
  document.getElementById("filter").oninput = table;
}
main();
"""


_COMPARE_BODY = """<header><h1>__TITLE__</h1><p id="method"></p></header>
<main>
<section><h2>The two reports</h2><dl id="sides"></dl></section>
<section id="heads-section"><h2>What changed, head by head (B - A)</h2>
<p>Colour by <select id="metric"></select> <span class="muted">hover a cell for both sides, the delta and its
interval</span></p>
<div class="row"><div class="grow"><div id="heatmap"></div></div>
<div id="panel"><p class="muted">Hover a head.</p></div></div></section>
<section><h2>Entropy by depth</h2><div id="gradient"></div></section>
<section id="transitions-section"><h2>Labels in A (rows) and B (columns)</h2><div class="row" id="transitions">
</div></section>
</main>"""

_COMPARE_APP = r"""
const R = D.record, H = D.heads;
document.getElementById("method").textContent = R.method + "; significance: Benjamini-Hochberg, FDR 5% over all heads";
const sides = document.getElementById("sides");
for (const side of ["a", "b"]) {
  const dt = document.createElement("dt"), dd = document.createElement("dd");
  dt.textContent = side.toUpperCase();
  dd.textContent = `${R[side].model} on ${R[side].corpus} (${R[side].layers} layers x ${R[side].heads} heads)`;
  sides.append(dt, dd);
}
const L = D.layers, traces = [];
if (R.same_grid) {
  for (const [side, colour] of [["a", "76,114,176"], ["b", "221,132,82"]]) {
    traces.push({x: L.layer, y: L[`entropy_${side}_ci_high`], mode: "lines", line: {width: 0}, showlegend: false,
      hoverinfo: "skip"});
    traces.push({x: L.layer, y: L[`entropy_${side}_ci_low`], mode: "lines", line: {width: 0}, fill: "tonexty",
      fillcolor: `rgba(${colour},0.3)`, showlegend: false, hoverinfo: "skip"});
    traces.push({x: L.layer, y: L[`entropy_${side}`], mode: "lines+markers", name: side.toUpperCase(),
      line: {color: `rgb(${colour})`}});
  }
} else {
  for (const [side, colour] of [["A", "rgb(76,114,176)"], ["B", "rgb(221,132,82)"]]) {
    const idx = L.report.map((r, i) => r === side ? i : -1).filter(i => i >= 0);
    traces.push({x: idx.map(i => L.relative_depth[i]), y: idx.map(i => L.entropy[i]), mode: "lines+markers",
      name: side, line: {color: colour}});
  }
}
Plotly.react("gradient", traces, {height: 380, margin: {t: 10}, legend: {orientation: "h", y: -0.25},
  xaxis: {title: {text: R.same_grid ? "layer" : "relative depth"}}, yaxis: {title: {text: "nats"}}}, CONFIG);
if (!H) {
  document.getElementById("heads-section").hidden = true;
  document.getElementById("transitions-section").hidden = true;
  document.body.dataset.ready = "true";
} else {
  const G = headGrid(H), cell = G.cell;
  const heatmap = metric => drawHeatmap(G, H, metric, true);  // every delta diverges around 0
  const panel = i => {
    const box = document.getElementById("panel"), table = document.createElement("table"), title =
      document.createElement("h3");
    table.id = "panel-table"; title.id = "panel-title";
    title.textContent = `layer ${H.layer[i]}, head ${H.head[i]}`;
    for (const m of ["entropy", "norm_entropy", "sink", "diagonal"]) {
      for (const suffix of ["_a", "_b", "_delta", "_delta_ci_low", "_delta_ci_high", "_p", "_significant"]) {
        if (!(m + suffix in H)) continue;
        const tr = table.insertRow(); tr.insertCell().textContent = m + suffix;
        tr.insertCell().textContent = fmt(H[m + suffix][i]);
      }
    }
    for (const k of ["head_type_a", "head_type_b", "role_a", "role_b"]) {
      const tr = table.insertRow(); tr.insertCell().textContent = k; tr.insertCell().textContent = fmt(H[k][i]);
    }
    box.replaceChildren(title, table);
  };
  fillSelect(D.selectable, heatmap);
  heatmap(D.selectable[0]).then(gd => {
    gd.on("plotly_hover", e => panel(cell[e.points[0].y + "," + e.points[0].x]));
    document.body.dataset.ready = "true";
  });
  const box = document.getElementById("transitions");
  const divs = Object.keys(D.transitions).map(name => {  // all in place first, so each plot gets its own width
    const div = document.createElement("div"); div.className = "grow"; div.id = `transition-${name}`;
    box.appendChild(div);
    return div;
  });
  for (const [index, [name, t]] of Object.entries(D.transitions).entries()) {
    Plotly.react(divs[index], [{type: "heatmap", z: t.values, x: t.columns, y: t.index, colorscale: "Greys",
      reversescale: true, showscale: false, text: t.values, texttemplate: "%{text}",
      hovertemplate: "A %{y} -> B %{x}: %{z} heads<extra></extra>"}],
      {title: {text: name.replace("_", " ")}, height: 360, yaxis: {autorange: "reversed"}, margin: {l: 110}}, CONFIG);
  }
}
"""
