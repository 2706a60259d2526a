// report.html: every head of one report. Columns, their descriptions and colours come from the data (D).
const H = D.heads, G = headGrid(H), {N, layers, cell} = G;
const C = D.columns, P = D.palette, V = D.views;
const CATEGORIES = {role: P.roles, head_type: P.types};  // coloured by label, not by a scale
let selected = null;  // the head shown in the panel and the example view

const number = (v, digits = 3) => v === null || v === undefined ? "-" : Number(v).toFixed(digits);
const count = v => v === null || v === undefined ? "-" : Number(v).toLocaleString("en");

function runDetails() {
  const r = D.run, t = r.timings || {}, a = r.architecture || {}, p = r.probes, im = r.importance, b = r.bootstrap;
  document.getElementById("run-line").textContent = `${count(r.sentences)} sentences, ${count(r.tokens)} tokens; ` +
    `${a.layers} layers x ${a.heads} heads (${a.kv_heads} KV heads); ${r.device}, ${r.dtype}; headscope ${r.headscope}`;
  const chance = p && p.chance ? Object.entries(p.chance).map(([k, v]) => `${k} ${number(v)}`).join(", ") : "";
  const rows = [["model", r.model], ["corpus", r.corpus], ["sentences", count(r.sentences)],
    ["tokens", count(r.tokens)], ["truncated sentences", count(r.truncated)], ["device, dtype", `${r.device}, ${r.dtype}`],
    ["architecture", `${a.model_type || "?"}: ${a.layers} layers, ${a.heads} query heads on ${a.kv_heads} key/value ` +
      `heads, head size ${a.head_dim}`],
    ["timings", `load ${number(t.load_seconds, 1)} s, measure ${number(t.measure_seconds, 1)} s, probes ` +
      `${number(t.probe_seconds, 1)} s, importance ${number(t.importance_seconds, 1)} s, write ` +
      `${number(t.write_seconds, 1)} s`],
    ["speed", `${count(Math.round(t.tokens_per_second || 0))} tokens/s`],
    ["probes", p ? `${p.seeds} sequences of ${p.length} random tokens x ${p.repeats}; chance: ${chance}` : "not run"],
    ...(p && p.retrieval ? [["retrieval probe", `${p.seeds} sequences of ${p.retrieval.tokens} tokens, a span of ` +
      `${p.length} planted early and repeated; chance ${p.retrieval.chance.toFixed(4)}`]] : []),
    ["importance", im ? `${im.mode}: clean loss ${number(im.clean_loss, 4)} nats over ${count(im.predicted_tokens)} ` +
      "predicted tokens" : "not measured"],
    ["intervals", b ? `95%, bootstrap over sentences, ${count(b.replicates)} replicates (seed ${b.seed})` : "none"],
    ["headscope", r.headscope], ["created", r.created]];
  const dl = document.getElementById("run-details");
  for (const [k, v] of rows) {
    const dt = document.createElement("dt"); dt.textContent = k; dl.appendChild(dt);
    const dd = document.createElement("dd"); dd.textContent = v === undefined || v === null ? "-" : v; dl.appendChild(dd);
  }
}

const heatmap = metric => drawHeatmap(G, H, metric, P.scales[C.scales[metric]], CATEGORIES[metric]);
const panel = i => fillPanel(H, i, C.panel, C.about, C.panel_more);

// The views of the example texts that hold head i: [view, index] pairs.
const viewsOf = i => V.map((v, n) => [v, n]).filter(([v]) => v.heads.some(([l, h]) => l === H.layer[i] &&
  h === H.head[i]));

// Head i's attention on example view n; by default where its role shows (a probe role on the probe sequence).
function example(i, n) {
  const box = document.getElementById("example"), pick = document.getElementById("views"), views = viewsOf(i);
  if (!views.length) {
    pick.replaceChildren();
    box.textContent = "No example view of this page holds this head: see examples.parquet, or headscope inspect.";
    return;
  }
  if (n === undefined || !views.some(([, m]) => m === n)) {
    const probe = views.find(([v]) => v.source === "probe");
    n = H.role[i] in D.probe_roles && probe ? probe[1] : views[0][1];
  }
  pick.replaceChildren(...views.map(([v, m]) => {
    const button = document.createElement("button");
    button.textContent = v.label; button.disabled = m === n; button.dataset.view = v.source;
    button.onclick = () => example(i, m);
    return button;
  }));
  const view = V[n], t = view.tokens.length, bytes = atob(view.weights), z = [];
  const at = view.heads.findIndex(([l, h]) => l === H.layer[i] && h === H.head[i]);
  for (let q = 0; q < t; q++) {
    const row = [];
    for (let k = 0; k < t; k++) row.push(k > q ? null : bytes.charCodeAt(at * t * t + q * t + k) / 255);
    z.push(row);
  }
  const labels = view.tokens.map((token, j) => plain(`${j}: ${token}`));
  Plotly.react("example", [{type: "heatmap", z: z, x: labels, y: labels, zmin: 0, zmax: 1, colorscale: P.scales.share.stops,
    hoverongaps: false, hovertemplate: "query %{y}<br>key %{x}<br>weight %{z:.3f}<extra></extra>"}],
    {title: {text: `layer ${H.layer[i]}, head ${H.head[i]} (${H.role[i]}): attention on ${view.label}`},
     height: 420 + 8 * t, margin: {l: 120, b: 120, t: 40}, yaxis: {autorange: "reversed", title: {text: "query"}},
     xaxis: {title: {text: "key (attended to)"}, tickangle: -60}}, CONFIG);
}

// The exemplars: "layer,head" -> kind index -> rows of D.exemplars in rank order.
const E = D.exemplars, EXEMPLARS = {};
if (E) for (let r = 0; r < E.rank.length; r++) ((EXEMPLARS[E.layer[r] + "," + E.head[r]] ||= {})[E.kind[r]] ||= []).push(r);

// Head i's corpus exemplars of one kind, a token strip each: the query outlined, the key it attends to most shaded
// by its weight (a key far back is shown before the strip, after "...").
function exemplars(i, kind) {
  const title = document.getElementById("exemplars-title"), about = document.getElementById("exemplars-about");
  const pick = document.getElementById("exemplar-kinds"), box = document.getElementById("exemplars");
  const mine = EXEMPLARS[H.layer[i] + "," + H.head[i]] || {};
  title.textContent = `Where layer ${H.layer[i]}, head ${H.head[i]} does it in the corpus`;
  const kinds = E ? E.kinds.map((name, k) => [name, k]).filter(([, k]) => mine[k]) : [];
  if (!kinds.length) {
    pick.replaceChildren(); box.replaceChildren();
    about.textContent = !E ? "This run kept no exemplars (analyze --exemplars 0)." : E.shown ? "None for this head." :
      `The page has no room for ${E.kept} exemplars per head and kind: see exemplars.parquet.`;
    return;
  }
  if (kind === undefined || !mine[kind]) {
    const preferred = E.kinds.indexOf(D.probe_roles[H.role[i]]);  // its role's pattern, else its sharpest rows
    kind = mine[preferred] ? preferred : kinds[0][1];
  }
  pick.replaceChildren(...kinds.map(([name, k]) => {
    const button = document.createElement("button");
    button.textContent = name; button.title = E.about[k]; button.disabled = k === kind; button.dataset.kind = name;
    button.onclick = () => exemplars(i, k);
    return button;
  }));
  about.textContent = `The ${mine[kind].length} corpus rows with the highest score, ${E.about[kind]}` +
    (E.shown < E.kept ? ` (the page shows the top ${E.shown} of the ${E.kept} in exemplars.parquet).` : ".");
  box.replaceChildren(...mine[kind].map(r => strip(r)));
}

function strip(r) {
  const div = document.createElement("div"), caption = document.createElement("span"), line = document.createElement("div");
  div.className = "exemplar"; line.className = "tokens";
  const key = E.key[r], row = E.row[r], start = E.context_start[r], weight = E.weight[r] || 0;
  caption.className = "muted";
  caption.textContent = `${E.rank[r]}. sentence ${E.sentence[r]}, row ${row}` +
    (key === null || key < 0 ? "" : ` \u2192 key ${key} (weight ${number(E.weight[r])})`) + `; score ${fmt(E.score[r])}`;
  const token = (text, position) => {
    const span = document.createElement("span");
    span.textContent = text; span.title = `${position}: ${JSON.stringify(text)}`; span.dataset.position = position;
    if (position === key) { tint(span, weight); span.classList.add("key"); }
    if (position === row) span.classList.add("query");
    return span;
  };
  const spans = E.context[r].map((t, j) => token(E.tokens[t], start + j));
  if (key !== null && key >= 0 && key < start) {
    const gap = document.createElement("span"); gap.textContent = "\u2026"; gap.className = "gap";
    spans.unshift(token(E.tokens[E.key_token[r]], key), gap);
  }
  line.replaceChildren(...spans);
  div.replaceChildren(caption, line);
  return div;
}

// Head i everywhere: the panel, its exemplars, its example view, a ring on its heatmap cell, its row in the table.
function select(i) {
  selected = i;
  panel(i); exemplars(i); example(i);
  Plotly.relayout("heatmap", {shapes: [{type: "rect", x0: H.head[i] - 0.5, x1: H.head[i] + 0.5,
    y0: H.layer[i] - 0.5, y1: H.layer[i] + 0.5, line: {color: "#00bcd4", width: 3}}]});
  for (const tr of document.querySelectorAll("#heads-table tbody tr")) {
    tr.classList.toggle("selected", Number(tr.dataset.row) === i);
  }
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

const columns = C.table.filter(c => c in H && H[c].some(v => v !== null));

// A row's labels, each between bars: a filter term matches a whole label ("layer 3") or, without digits,
// part of one ("induct").
const LABELS = [...Array(N).keys()].map(i => `|layer ${H.layer[i]}|head ${H.head[i]}|${H.head_type[i]}|` +
  `${H.role[i]}|offset ${H.top_offset[i]}|`);
const matches = (i, t) => LABELS[i].includes(`|${t}|`) || (!/\d/.test(t) && LABELS[i].includes(t));
const table = headTable("heads-table", H, columns, {about: C.about, text: new Set(C.text), count: "table-count",
  onRow: i => { select(i); document.getElementById("panel").scrollIntoView({block: "start"}); }, selected: () => selected, keep: () => {
    const terms = document.getElementById("filter").value.toLowerCase().split(",").map(t => t.trim())
      .filter(Boolean);
    return i => terms.every(t => matches(i, t));
  }});

function files() {
  const ul = document.getElementById("files");
  for (const name of D.files) {
    const li = document.createElement("li"), a = document.createElement("a");
    a.href = name; a.textContent = name; li.appendChild(a); ul.appendChild(li);
  }
}

function main() {
  runDetails();
  const metrics = [...C.selectable, ...Object.keys(CATEGORIES).filter(c => c in H)];
  fillSelect(metrics, heatmap, C.about);
  if (C.selectable.length) {
    heatmap(C.selectable[0]).then(gd => {
      gd.on("plotly_hover", e => { const p = e.points[0]; panel(cell[p.y + "," + p.x]); });
      gd.on("plotly_click", e => { const p = e.points[0]; select(cell[p.y + "," + p.x]); });
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
