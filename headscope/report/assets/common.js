"use strict";
// What both pages use: the data, the number format, colours, the heads grid, the heatmap and its selector.
const D = JSON.parse(document.getElementById("data").textContent);
const CONFIG = {displaylogo: false, responsive: true, showLink: false};
const fmt = v => v === null || v === undefined ? "-" : typeof v === "boolean" ? (v ? "yes" : "no") :
  typeof v !== "number" ? String(v) : Number.isInteger(v) ? String(v) :
  Math.abs(v) >= 1000 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : v.toFixed(4);
// A column's value as a reader wants it: a p-value (a name ending in "_p") below 1e-4 says only that.
const fmtIn = (key, v) => key.endsWith("_p") && typeof v === "number" && v < 1e-4 ? "< 0.0001" : fmt(v);
// Text as Plotly must show it: literally. Plotly reads its labels as a small HTML (<a href>, <span style>, <b>,
// entities), and tokens are any text a model has: escaped here, a token "<a href=...>" is shown, not followed.
const plain = text => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
// "#rrggbb" at opacity `alpha`, for bands drawn in a palette colour.
const rgba = (hex, alpha) => `rgba(${[1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16)).join(",")},${alpha})`;

// A token span shaded by a weight in [0, 1]: the share scale's colour, stronger as the weight grows.
function tint(span, w) {
  const stops = D.palette.scales.share.stops, x = Math.max(0, Math.min(1, w));
  const colour = (stops.slice(1).find(([at]) => x <= at) || stops[stops.length - 1])[1];
  span.style.background = rgba(colour, 0.15 + 0.85 * x);
  if (x > 0.5) span.style.color = "#fff";
}

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

// The #heatmap plot of one column, in its colour scale (the palette's, as the PNG charts draw it): fixed limits
// for a share, symmetric ones around 0 for a signed column, the data's own otherwise. A categorical column (role,
// head type) is drawn in its labels' colours, one colour per label.
function drawHeatmap(G, H, metric, scale, categories) {
  let trace;
  if (categories) {
    const names = Object.keys(categories), n = names.length;
    const colorscale = names.flatMap((name, k) => [[k / n, categories[name]], [(k + 1) / n, categories[name]]]);
    const z = H[metric].map(v => v === null ? null : names.indexOf(v) + 0.5);
    trace = {type: "heatmap", x: G.heads, y: G.layers, z: G.grid(z), zmin: 0, zmax: n, colorscale: colorscale,
      text: G.grid(H[metric]), hoverongaps: false, hovertemplate: "layer %{y}, head %{x}<br>" + metric +
      " %{text}<extra></extra>", colorbar: {title: {text: metric}, tickvals: names.map((_, k) => k + 0.5),
      ticktext: names}};
  } else {
    const values = H[metric].filter(v => v !== null), limit = Math.max(...values.map(Math.abs), 1e-12);
    const range = scale.range || (scale.symmetric ? [-limit, limit] : [undefined, undefined]);
    trace = {type: "heatmap", x: G.heads, y: G.layers, z: G.grid(H[metric]), hoverongaps: false,
      colorscale: scale.stops, zmin: range[0], zmax: range[1], colorbar: {title: {text: metric}},
      hovertemplate: "layer %{y}, head %{x}<br>" + metric + " %{z:.4~g}<extra></extra>"};
  }
  const layout = {margin: {t: 10, r: 10, b: 40, l: 50}, height: Math.min(900, 160 + 22 * G.layers.length),
    xaxis: {title: {text: "head"}, dtick: G.heads.length > 32 ? 8 : 1}, yaxis: {title: {text: "layer"},
    autorange: "reversed", dtick: G.layers.length > 32 ? 8 : 1}};
  return Plotly.react("heatmap", [trace], layout, CONFIG);
}

// The #metric selector: one option per name (its description as a tooltip), redrawing with `draw` on change.
function fillSelect(names, draw, about) {
  const select = document.getElementById("metric");
  for (const m of names) {
    const o = document.createElement("option");
    o.value = o.textContent = m;
    o.title = (about || {})[m] || "";
    select.appendChild(o);
  }
  select.onchange = () => draw(select.value);
}

// A two-column table of `keys` of row i of H (name, formatted value; the column's definition as its tooltip)
// under a title, in #panel; the `more` columns behind "every column" (closed: the panel stays readable).
function fillPanel(H, i, keys, about, more) {
  const rows = (names, table) => {
    for (const k of names) {
      if (!(k in H)) continue;
      const tr = table.insertRow(), a = tr.insertCell(), b = tr.insertCell();
      a.textContent = k; b.textContent = fmtIn(k, H[k][i]); b.dataset.key = k;
      tr.title = (about || {})[k] || "";
    }
    return table;
  };
  const title = document.createElement("h3"), table = rows(keys, document.createElement("table"));
  table.id = "panel-table"; title.id = "panel-title";
  title.textContent = `layer ${H.layer[i]}, head ${H.head[i]}`;
  const parts = [title, table];
  if (more && more.length) {
    const details = document.createElement("details"), summary = document.createElement("summary");
    summary.textContent = `every column (${more.length} more)`;
    details.replaceChildren(summary, rows(more, document.createElement("table")));
    parts.push(details);
  }
  document.getElementById("panel").replaceChildren(...parts);
}

// A table of H's rows in `columns`, into #<id>: click a header to sort by it (again: the other way), click a row
// for onRow(i). keep() gives the predicate of the rows shown; count names the element that says how many.
// Returns the function that redraws it.
function headTable(id, H, columns, {about = {}, text = new Set(), keep = () => () => true, onRow = null,
    selected = () => null, count = null, limit = 1000} = {}) {
  const N = H.layer.length, order = [...Array(N).keys()];
  let sortKey = null, sortUp = true;
  function sortBy(c) {
    sortUp = sortKey === c ? !sortUp : true; sortKey = c;
    const sign = sortUp ? 1 : -1;
    order.sort((a, b) => {
      const x = H[c][a], y = H[c][b];
      if (x === null) return 1; if (y === null) return -1;
      return (x < y ? -1 : x > y ? 1 : a - b) * sign;
    });
    draw();
  }
  function draw() {
    const wanted = keep(), shown = order.filter(i => wanted(i)), el = document.getElementById(id);
    el.replaceChildren();
    const head = el.createTHead().insertRow();
    for (const c of columns) {
      const th = document.createElement("th");
      th.textContent = c + (sortKey === c ? (sortUp ? " \u25b2" : " \u25bc") : "");
      th.title = about[c] || "";
      if (text.has(c)) th.className = "text";
      th.onclick = () => sortBy(c);
      head.appendChild(th);
    }
    const body = el.createTBody();
    for (const i of shown.slice(0, limit)) {
      const tr = body.insertRow();
      tr.dataset.row = i;
      if (onRow) tr.onclick = () => onRow(i);
      if (i === selected()) tr.classList.add("selected");
      for (const c of columns) {
        const td = tr.insertCell(); td.textContent = fmtIn(c, H[c][i]);
        if (text.has(c)) td.className = "text";
      }
    }
    if (count) {
      document.getElementById(count).textContent = `${shown.length} of ${N} heads` +
        (shown.length > limit ? ` (first ${limit} shown)` : "");
    }
  }
  return draw;
}
