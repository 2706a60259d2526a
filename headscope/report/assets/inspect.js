// inspect.html: chosen heads' attention on chosen texts. Weights come as 16-bit integers (x 65535), a head's
// visible keys as bits, both base64; tokens are shown as text (textContent, plain() for Plotly).
const P = D.palette, SHARE = P.scales.share;
const VIEWS = {};  // "text|head" -> view
for (const v of D.views) VIEWS[v.text + "|" + v.head] = v;
const SUMMARY = {};  // "text|head" -> summary entry
for (const s of D.summary) SUMMARY[s.text_id + "|" + s.head] = s;
const LEFT = {};
for (const l of D.left_out) LEFT[l.text + "|" + l.head] = l.why;
const WHY = {};  // "text|head|row" -> the row's explained key and its matrix of contrasts (--why)
for (const w of D.why) WHY[w.text + "|" + w.head + "|" + w.row] = w;
let current = null;  // {text, head, t, weights: Float32Array, visible: Uint8Array}

function decode(view, t) {
  const raw = atob(view.weights), weights = new Float32Array(t * t);
  for (let i = 0; i < t * t; i++) weights[i] = (raw.charCodeAt(2 * i) | raw.charCodeAt(2 * i + 1) << 8) / 65535;
  const bits = atob(view.visible), visible = new Uint8Array(t * t);
  for (let i = 0; i < t * t; i++) visible[i] = bits.charCodeAt(i >> 3) >> (i & 7) & 1;
  return {weights, visible};
}

function options(select, items) {
  select.replaceChildren(...items.map(([value, label]) => {
    const o = document.createElement("option"); o.value = value; o.textContent = label; return o;
  }));
}

function headLabel(h) { return h.role ? `${h.name} (${h.role})` : h.name; }

function summaryLine(text, head) {
  const s = SUMMARY[text + "|" + head];
  if (!s) return "";
  const parts = [`largest weight at ${places(s)}; mean largest ${fmt(s.mean_largest)}`];
  for (const [k, v] of Object.entries(s)) if (k.startsWith("probe_") && v !== null) parts.push(`${k} ${fmt(v)}`);
  return parts.join("; ");
}
const places = s => s.largest_at.map(([name, share]) => `${name} (${fmtShare(share)} of rows)`).join(", ") || "-";
const fmtShare = v => v === null || v === undefined ? "-" : `${(100 * v).toFixed(0)}%`;

function show(text, head) {
  document.getElementById("head").value = head;
  document.getElementById("text").value = String(text);
  document.getElementById("summary").textContent = summaryLine(text, head);
  const view = VIEWS[text + "|" + head], tokens = D.texts[text].tokens, t = tokens.length;
  const left = document.getElementById("left-out");
  left.textContent = view ? "" : `This view is in attention.parquet only: ${LEFT[text + "|" + head] || "not kept"}.`;
  for (const tr of document.querySelectorAll("#summary-table tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.key === text + "|" + head);
  }
  if (!view) {  // purge drops the plot's listeners too
    Plotly.purge("attention"); Plotly.purge("row"); delete document.getElementById("attention").dataset.hover;
    current = null; strip(text, null); document.getElementById("marks").replaceChildren(); return;
  }
  current = {text, head, t, ...decode(view, t)};
  const z = [];
  for (let q = 0; q < t; q++) {
    const row = [];
    for (let k = 0; k < t; k++) row.push(current.visible[q * t + k] ? current.weights[q * t + k] : null);
    z.push(row);
  }
  const labelled = t <= 64, labels = tokens.map((token, j) => plain(`${j}: ${token}`));
  const axis = labelled ? labels : [...Array(t).keys()];
  Plotly.react("attention", [{type: "heatmap", z, x: axis, y: axis, zmin: 0, zmax: 1, colorscale: SHARE.stops,
    hoverongaps: false, colorbar: {title: {text: "weight"}},
    hovertemplate: "query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>"}],
    {title: {text: plain(`head ${head} on ${D.texts[text].label}`)}, height: Math.min(900, 380 + 10 * Math.min(t, 64)),
     margin: {l: labelled ? 130 : 60, b: labelled ? 130 : 50, t: 40},
     yaxis: {autorange: "reversed", title: {text: "query"}, type: labelled ? "category" : "linear"},
     xaxis: {title: {text: "key (attended to)"}, tickangle: labelled ? -60 : 0, type: labelled ? "category" : "linear"}},
    CONFIG).then(gd => {
    if (!gd.dataset.hover) gd.on("plotly_hover", e => query(e.points[0].pointIndex[0]));  // once per element
    gd.dataset.hover = "on";
  });
  const marks = D.texts[text].exemplars;
  document.getElementById("marks").replaceChildren(...marks.map(m => {
    const button = document.createElement("button");
    button.textContent = `${m.kind} ${m.rank}: row ${m.row}` + (m.key < 0 ? "" : ` \u2192 key ${m.key}`);
    button.title = `exemplar ${m.rank} of kind ${m.kind}: weight ${fmt(m.weight)}, score ${fmt(m.score)}`;
    button.dataset.row = m.row; button.onclick = () => query(m.row);
    return button;
  }));
  query(marks.length ? marks[0].row : t - 1);  // an exemplar sentence opens at its strongest exemplar's row
}

// Query q of the current view: its weights over the keys, as a line and on the tokens.
function query(q) {
  if (!current) return;
  const t = current.t, tokens = D.texts[current.text].tokens, keys = [], weights = [];
  for (let k = 0; k < t; k++) if (current.visible[q * t + k]) { keys.push(k); weights.push(current.weights[q * t + k]); }
  document.getElementById("query-title").textContent = `query ${q} ${JSON.stringify(tokens[q])}: weights over the keys`;
  Plotly.react("row", [{type: "scatter", mode: t <= 256 ? "lines+markers" : "lines", x: keys, y: weights,
    line: {color: P.mean}, text: keys.map(k => plain(JSON.stringify(tokens[k]))),
    hovertemplate: "key %{x} %{text}<br>weight %{y:.4f}<extra></extra>"}],
    {height: 260, margin: {t: 10, b: 40}, xaxis: {title: {text: "key position"}, range: [-0.5, t - 0.5]},
     yaxis: {title: {text: "weight"}, range: [0, 1.02]}}, CONFIG);
  strip(current.text, q);
  why(q);
}

// Why query q attends to its explained key (--why): query senders by key senders, coloured by contrast, each
// side's sums on the margins. Hidden for a view with no explained row; a note for a row --why did not explain.
function why(q) {
  const box = document.getElementById("why-box"), title = document.getElementById("why-title");
  const prefix = current.text + "|" + current.head + "|";
  const any = Object.keys(WHY).some(k => k.startsWith(prefix));
  box.hidden = !any && !D.why_left_out;
  const w = WHY[prefix + q];
  if (!w) {
    Plotly.purge("why");
    title.textContent = box.hidden ? "" : `row ${q}: not explained here (--why; qk.parquet holds what was)`;
    return;
  }
  const tokens = D.texts[current.text].tokens;
  title.textContent = `why row ${q} ${JSON.stringify(tokens[q])} attends to key ${w.key} ` +
    `${JSON.stringify(tokens[w.key])}: contrast ${fmt(w.total)}`;
  const keys = w.keys.map(plain), queries = w.query.map(plain);
  const limit = Math.max(...w.contrast.flat().map(Math.abs), 1e-12);
  Plotly.react("why", [
    {type: "heatmap", z: w.contrast, x: keys, y: queries, zmin: -limit, zmax: limit, zmid: 0,
     colorscale: P.scales.diverging.stops, colorbar: {title: {text: "contrast"}, x: 1.08},
     hovertemplate: "query sender %{y}<br>key sender %{x}<br>contrast %{z:.4f}<extra></extra>"},
    {type: "bar", x: keys, y: w.key_side, xaxis: "x", yaxis: "y2", marker: {color: P.mean},
     hovertemplate: "key side of %{x}: %{y:.4f}<extra></extra>"},
    {type: "bar", orientation: "h", x: w.query_side, y: queries, xaxis: "x2", yaxis: "y", marker: {color: P.interval},
     hovertemplate: "query side of %{y}: %{x:.4f}<extra></extra>"}],
    {height: 620, showlegend: false, margin: {l: 90, b: 90, t: 10, r: 20},
     xaxis: {domain: [0, 0.78], type: "category", tickangle: -45, title: {text: "key sender"}},
     yaxis: {domain: [0, 0.76], type: "category", autorange: "reversed", title: {text: "query sender"}},
     xaxis2: {domain: [0.82, 1], anchor: "y", zeroline: true, title: {text: "query side"}},
     yaxis2: {domain: [0.8, 1], anchor: "x", zeroline: true, title: {text: "key side"}}}, CONFIG);
}

// The text's tokens, each shaded by the weight query q gives it; hovering a token picks it as the query.
function strip(text, q) {
  const box = document.getElementById("tokens"), tokens = D.texts[text].tokens, t = tokens.length;
  if (t > 2048) { box.textContent = `(${t} tokens: too many to list)`; return; }
  box.replaceChildren(...tokens.map((token, k) => {
    const span = document.createElement("span");
    span.textContent = token; span.dataset.position = k;
    let w = null;
    if (current && q !== null && current.visible[q * t + k]) w = current.weights[q * t + k];
    span.title = `${k}: ${JSON.stringify(token)}` + (w === null ? "" : ` weight ${w.toFixed(4)}`);
    if (w !== null) { tint(span, w); }
    if (current && WHY[current.text + "|" + current.head + "|" + k]) span.classList.add("explained");
    if (k === q) span.classList.add("query");
    span.onmouseenter = span.onclick = () => query(k);
    return span;
  }));
}

// Where a head's role shows: a probe role on the probe text, when there is one.
function defaultText(head) {
  const h = D.heads.find(x => x.name === head), probe = D.texts.findIndex(x => x.source === "probe");
  return h && D.probe_roles.includes(h.role) && probe >= 0 ? probe : 0;
}

function table() {
  const el = document.getElementById("summary-table"), role = {};
  for (const h of D.heads) role[h.name] = h.role || "";
  const probes = [...new Set(D.summary.flatMap(s => Object.keys(s).filter(k => k.startsWith("probe_"))))];
  const columns = ["head", "role", "text", "largest weight at", "mean largest", ...probes];
  const head = el.createTHead().insertRow();
  for (const c of columns) { const th = document.createElement("th"); th.textContent = c; head.appendChild(th); }
  const body = el.createTBody();
  for (const s of D.summary) {
    const tr = body.insertRow();
    tr.dataset.key = s.text_id + "|" + s.head;
    tr.onclick = () => show(s.text_id, s.head);
    const cells = [s.head, role[s.head], D.texts[s.text_id].label, places(s), fmt(s.mean_largest),
      ...probes.map(p => fmt(s[p]))];
    for (const v of cells) tr.insertCell().textContent = v === undefined ? "-" : v;
  }
}

function main() {
  document.getElementById("run-line").textContent = `${D.model}; ` +
    (D.roles_from ? `roles from ${D.roles_from}` : "roles not known (pass --report, or --role to run the probes)");
  const heads = document.getElementById("head"), texts = document.getElementById("text");
  options(heads, D.heads.map(h => [h.name, headLabel(h)]));
  options(texts, D.texts.map((x, i) => [String(i), `${x.label} (${x.tokens.length} tokens)`]));
  heads.onchange = () => show(defaultText(heads.value), heads.value);
  texts.onchange = () => show(Number(texts.value), heads.value);
  table();
  show(defaultText(D.heads[0].name), D.heads[0].name);
  document.body.dataset.ready = "true";
}
main();
