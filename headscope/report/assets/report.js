// report.html: every head of one report. Columns, their descriptions and colours come from the data (D).
const H = D.heads, G = headGrid(H), {N, layers, cell} = G;
const C = D.columns, P = D.palette;

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

const heatmap = metric => drawHeatmap(G, H, metric, C.diverging.includes(metric));
const panel = i => fillPanel(H, i, C.panel, C.about);

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
  const labels = E.tokens.map((t, j) => plain(`${j}: ${t}`));
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
      fillcolor: rgba(P.interval, 0.35), name: "95% interval (bootstrap over sentences)"});
  }
  traces.push({x: L.layer, y: L.entropy, mode: "lines+markers", name: "mean entropy over heads",
    line: {color: P.mean}});
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
  const traces = Object.keys(P.types).map(name => {
    const idx = [...Array(N).keys()].filter(i => H.head_type[i] === name);
    return {type: "scatter", mode: "markers", name: name, marker: {color: P.types[name], size: 6},
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
const columns = C.table.filter(c => c in H && H[c].some(v => v !== null));
const TEXT = new Set(C.text);
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
    th.title = C.about[c] || "";
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
  fillSelect(C.selectable, heatmap, C.about);
  if (C.selectable.length) {
    heatmap(C.selectable[0]).then(gd => {
      gd.on("plotly_hover", e => { const p = e.points[0]; panel(cell[p.y + "," + p.x]); });
      gd.on("plotly_click", e => { const p = e.points[0]; const i = cell[p.y + "," + p.x]; panel(i); example(i); });
      document.body.dataset.ready = "true";
    });
  } else {
    document.getElementById("heatmap").textContent = "No metric has a value for any head (every row overflowed?).";
    document.body.dataset.ready = "true";
  }
  gradient(); perLayer("types", "head_type", P.types); perLayer("roles", "role", P.roles);
  classification(); table(); files();
  document.getElementById("filter").oninput = table;
}
main();
