"use strict";
// What both pages use: the data, the number format, colours, the heads grid, the heatmap and its selector.
const D = JSON.parse(document.getElementById("data").textContent);
const CONFIG = {displaylogo: false, responsive: true, showLink: false};
const fmt = v => v === null || v === undefined ? "-" : typeof v === "boolean" ? (v ? "yes" : "no") :
  typeof v !== "number" ? String(v) : Number.isInteger(v) ? String(v) :
  Math.abs(v) >= 1000 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : v.toFixed(4);
// Text as Plotly must show it: literally. Plotly reads its labels as a small HTML (<a href>, <span style>, <b>,
// entities), and tokens are any text a model has: escaped here, a token "<a href=...>" is shown, not followed.
const plain = text => String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
// "#rrggbb" at opacity `alpha`, for bands drawn in a palette colour.
const rgba = (hex, alpha) => `rgba(${[1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16)).join(",")},${alpha})`;

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

// A two-column table of `keys` of row i of H (name, formatted value) under a title, in #panel.
function fillPanel(H, i, keys, about) {
  const table = document.createElement("table"), title = document.createElement("h3");
  table.id = "panel-table"; title.id = "panel-title";
  title.textContent = `layer ${H.layer[i]}, head ${H.head[i]}`;
  for (const k of keys) {
    if (!(k in H)) continue;
    const tr = table.insertRow(), a = tr.insertCell(), b = tr.insertCell();
    a.textContent = k; b.textContent = fmt(H[k][i]); b.dataset.key = k;
    tr.title = (about || {})[k] || "";
  }
  document.getElementById("panel").replaceChildren(title, table);
}
