// circuit.html: the circuit's graph (Plotly: a line per edge, a marker per node), its faithfulness curve and its
// strongest edges. Node places follow report/circuit_charts.py.
const A = D.architecture, E = D.edges, N = D.nodes;
const EDGES = E.sender.length;
const NODE = {};
for (let i = 0; i < N.node.length; i++) NODE[N.node[i]] = i;
let picked = null;  // the edge picked in the table

function place(node) {
  if (node === "embed") return [(A.heads - 1) / 2, -1];
  if (node === "logits") return [(A.heads - 1) / 2, A.layers];
  if (node.startsWith("mlp")) return [A.heads + 0.5, +node.slice(3) + 0.5];
  const [layer, unit] = node.split(".");
  if (unit.startsWith("kv")) return [-1.5 + 0.3 * +unit.slice(2), +layer];
  return [+unit, +layer];
}

function edgeName(i) {
  const channel = E.channel[i] ? ` (${E.channel[i]})` : "";
  return `${E.sender[i]} → ${E.receiver[i]}${channel}`;
}

function edgeText(i) {
  const interval = E.score_ci_low[i] === null ? "" : ` [${fmt(E.score_ci_low[i])}, ${fmt(E.score_ci_high[i])}]`;
  const exact = E.exact[i] === null ? "" : `<br>exact ${fmt(E.exact[i])}`;
  const role = E.sender_role[i] ? `<br>sender: ${plain(E.sender_role[i])}` : "";
  return `${plain(edgeName(i))}<br>rank ${E.rank[i]}, score ${fmt(E.score[i])}${interval}${exact}${role}`;
}

function drawGraph() {
  const count = Math.max(1, Math.min(EDGES, +document.getElementById("count").value || D.first));
  const order = [...Array(EDGES).keys()].sort((a, b) => E.rank[a] - E.rank[b]).slice(0, count);
  const strongest = Math.max(...order.map(i => Math.abs(E.score[i])), 1e-12);
  const traces = order.map(i => {
    const [x0, y0] = place(E.sender[i]), [x1, y1] = place(E.receiver[i]);
    const chosen = picked === null || picked === i;
    return {x: [x0, x1], y: [y0, y1], mode: "lines", type: "scatter", hoverinfo: "text",
      text: [edgeText(i), edgeText(i)], showlegend: false,
      line: {width: 0.5 + 5 * Math.abs(E.score[i]) / strongest,
             color: rgba(E.score[i] < 0 ? "#c62828" : "#1565c0", chosen ? 0.7 : 0.12)}};
  });
  const shown = new Set(order.flatMap(i => [E.sender[i], E.receiver[i]]));
  const names = [...shown];
  const dla = names.map(n => n in NODE ? N.dla[NODE[n]] : null);
  const top = Math.max(...dla.filter(v => v !== null).map(Math.abs), 1e-12);
  traces.push({x: names.map(n => place(n)[0]), y: names.map(n => place(n)[1]), mode: "markers+text",
    type: "scatter", text: names, textposition: "top center", textfont: {size: 9}, showlegend: false,
    hovertext: names.map((n, k) => {
      if (!(n in NODE)) return plain(n);
      const j = NODE[n], role = N.role[j] ? `<br>${plain(N.role[j])}` : "";
      const interval = N.dla_ci_low[j] === null ? "" : ` [${fmt(N.dla_ci_low[j])}, ${fmt(N.dla_ci_high[j])}]`;
      return `${plain(n)}<br>DLA ${fmt(dla[k])}${interval}${role}`;
    }), hoverinfo: "text",
    marker: {size: 12, color: dla.map(v => v === null ? 0 : v), cmin: -top, cmax: top,
             colorscale: D.palette.scales.diverging.stops, line: {color: "#424242", width: 1},
             colorbar: {title: {text: "DLA"}}}});
  const layout = {height: Math.min(260 + 34 * A.layers, 1200), margin: {t: 10, l: 50, r: 10, b: 30},
    xaxis: {visible: false}, yaxis: {title: {text: "layer"}, zeroline: false}, hovermode: "closest"};
  Plotly.react("graph", traces, layout, CONFIG);
  const circuit = D.circuit ? `; the smallest circuit reaching ${fmt(D.target)} holds ${D.circuit.edges}` : "";
  document.getElementById("count-note").textContent =
    `of ${D.edge_count.toLocaleString()} (the page carries ${EDGES})${circuit}`;
}

function drawCurve() {
  const line = document.getElementById("curve-line");
  if (!D.curve.length) {
    line.textContent = "No curve was measured (--no-curve).";
    return;
  }
  const points = D.curve.filter(p => p.share > 0);
  line.textContent = `faithfulness of the circuits of the ${D.selection === "greedy" ? "greedily grown" :
    "strongest"} edges; CPR ${fmt(D.cpr)}, CMD ${fmt(D.cmd)}` + (D.circuit ?
    `; the smallest reaching ${fmt(D.target)}: ${D.circuit.edges} edges (f = ${fmt(D.circuit.faithfulness)})` : "");
  Plotly.react("curve", [
    {x: points.map(p => p.share), y: points.map(p => p.faithfulness), mode: "lines+markers", type: "scatter",
     name: "faithfulness", text: points.map(p => `${p.edges} edges`), hovertemplate: "%{text}: %{y:.3f}"},
    {x: [points[0].share, 1], y: [D.target, D.target], mode: "lines", type: "scatter", name: "target",
     line: {dash: "dot", color: "#757575"}},
  ], {height: 320, margin: {t: 10, l: 50, r: 10, b: 40}, xaxis: {type: "log", title: {text: "share of edges"}},
      yaxis: {title: {text: "faithfulness"}}}, CONFIG);
}

function fillTable() {
  const order = [...Array(EDGES).keys()].sort((a, b) => E.rank[a] - E.rank[b]).slice(0, 100);
  const table = document.getElementById("edge-table");
  const head = ["rank", "sender", "receiver", "channel", "score", "95% interval", "exact", "in circuit", "sender role"];
  const rows = order.map(i => {
    const tr = document.createElement("tr");
    const cells = [E.rank[i], E.sender[i], E.receiver[i], E.channel[i] || "", fmt(E.score[i]),
      E.score_ci_low[i] === null ? "-" : `[${fmt(E.score_ci_low[i])}, ${fmt(E.score_ci_high[i])}]`,
      fmt(E.exact[i]), E.in_circuit[i] ? "yes" : "", E.sender_role[i] || ""];
    for (const value of cells) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => {
      picked = picked === i ? null : i;
      const count = document.getElementById("count");
      if (E.rank[i] > +count.value) count.value = E.rank[i];
      drawGraph();
    });
    return tr;
  });
  const header = document.createElement("tr");
  for (const name of head) {
    const th = document.createElement("th");
    th.textContent = name;
    header.appendChild(th);
  }
  table.replaceChildren(header, ...rows);
}

document.getElementById("run-line").textContent = `${D.model}: ${D.method}` +
  (D.steps ? ` (${D.steps} steps)` : "") + `; mean m ${fmt(D.m.clean)} clean, ${fmt(D.m.corrupt)} corrupt`;
const count = document.getElementById("count");
count.value = D.first;
count.max = EDGES;
count.addEventListener("change", drawGraph);
drawGraph();
drawCurve();
fillTable();
document.body.dataset.ready = "true";
