// compare.html: what changed between two reports. Metrics and colours come from the data (D).
const R = D.record, H = D.heads, P = D.palette;
document.getElementById("method").textContent = R.method + "; significance: Benjamini-Hochberg, FDR 5% over all heads";
const sides = document.getElementById("sides");
for (const side of ["a", "b"]) {
  const dt = document.createElement("dt"), dd = document.createElement("dd");
  dt.textContent = side === "a" ? "A (before)" : "B (after)";
  dd.textContent = `${R[side].name}: ${R[side].layers} layers x ${R[side].heads} heads; corpus ${R[side].corpus}; ` +
    `folder ${R[side].folder}`;
  sides.append(dt, dd);
}
const L = D.layers, traces = [];
if (R.same_grid) {
  for (const side of ["a", "b"]) {
    const colour = P.sides[side];
    traces.push({x: L.layer, y: L[`entropy_${side}_ci_high`], mode: "lines", line: {width: 0}, showlegend: false,
      hoverinfo: "skip"});
    traces.push({x: L.layer, y: L[`entropy_${side}_ci_low`], mode: "lines", line: {width: 0}, fill: "tonexty",
      fillcolor: rgba(colour, 0.3), showlegend: false, hoverinfo: "skip"});
    traces.push({x: L.layer, y: L[`entropy_${side}`], mode: "lines+markers", name: R[side].name,
      line: {color: colour}});
  }
} else {
  for (const side of ["a", "b"]) {
    const name = side.toUpperCase(), idx = L.report.map((r, i) => r === name ? i : -1).filter(i => i >= 0);
    traces.push({x: idx.map(i => L.relative_depth[i]), y: idx.map(i => L.entropy[i]), mode: "lines+markers",
      name: R[side].name, line: {color: P.sides[side]}});
  }
}
Plotly.react("gradient", traces, {height: 380, margin: {t: 10}, legend: {orientation: "h", y: -0.25},
  xaxis: {title: {text: R.same_grid ? "layer" : "relative depth"}}, yaxis: {title: {text: "nats"}}}, CONFIG);
if (!H || !D.selectable.length) {  // different grids, or no delta with a value
  document.getElementById("heads-section").hidden = true;
  document.getElementById("transitions-section").hidden = true;
  document.getElementById("table-section").hidden = true;
  document.body.dataset.ready = "true";
} else {
  const G = headGrid(H), cell = G.cell;
  const heatmap = metric => drawHeatmap(G, H, metric, P.scales.diverging);  // every delta diverges around 0
  const keys = [];
  for (const m of D.metrics) {
    for (const suffix of ["_a", "_b", "_delta", "_delta_ci_low", "_delta_ci_high", "_p", "_significant"]) {
      keys.push(m + suffix);
    }
  }
  keys.push("head_type_a", "head_type_b", "role_a", "role_b");
  // The table: the chosen metric's A, B, delta, its interval and p-value beside both sides' labels (every metric
  // at once made a table 5,000 px wide); sortable, and filtered to the heads with a significant change of any
  // metric when the box is ticked. Choosing a metric above redraws the heatmap and the table.
  const significant = D.metrics.map(m => `${m}_significant`).filter(c => c in H);
  const only = document.getElementById("significant-only");
  let table = () => {};
  const showTable = metric => {
    const m = metric.replace(/_delta$/, "");
    const columns = ["layer", "head", "role_a", "role_b", "head_type_a", "head_type_b", `${m}_a`, `${m}_b`,
      `${m}_delta`, `${m}_delta_ci_low`, `${m}_delta_ci_high`, `${m}_p`].filter(c => c in H);
    table = headTable("compare-table", H, columns, {text: new Set(["role_a", "role_b", "head_type_a",
      "head_type_b"]), count: "table-count", onRow: i => fillPanel(H, i, keys),
      keep: () => only.checked ? i => significant.some(c => H[c][i]) : () => true});
    table();
  };
  only.onchange = () => table();
  fillSelect(D.selectable, metric => { showTable(metric); return heatmap(metric); });
  showTable(D.selectable[0]);
  heatmap(D.selectable[0]).then(gd => {
    gd.on("plotly_hover", e => fillPanel(H, cell[e.points[0].y + "," + e.points[0].x], keys));
    document.body.dataset.ready = "true";
  });
  const box = document.getElementById("transitions");
  const divs = Object.keys(D.transitions).map(name => {  // all in place first, so each plot gets its own width
    const div = document.createElement("div"); div.className = "grow"; div.id = `transition-${name}`;
    box.appendChild(div);
    return div;
  });
  for (const [index, [name, t]] of Object.entries(D.transitions).entries()) {
    Plotly.react(divs[index], [{type: "heatmap", z: t.values, x: t.columns, y: t.index, colorscale: P.scales.count.stops,
      showscale: false, text: t.values, texttemplate: "%{text}",
      hovertemplate: "A %{y} -> B %{x}: %{z} heads<extra></extra>"}],
      {title: {text: name.replace("_", " ")}, height: 360, yaxis: {autorange: "reversed"}, margin: {l: 110}}, CONFIG);
  }
}
