// prune.html: what a pruning did to each head on the (layer, head) grid, the KV memory a window-mode policy frees,
// and the search's verified loss curve. The states and their colours come from report/prune_page.py.
const H = D.heads, G = headGrid(H);
const taken = D.mode === "window" ? "windowed" : "removed";
const TAKEN = H.order.filter(v => v !== null).length;

function headText(i) {
  const name = `${H.layer[i]}.${H.head[i]} (KV head ${H.kv_head[i]})`;
  if (H.order[i] === null) return `${name}<br>${H.state[i]}`;
  return `${name}<br>${H.state[i]}<br>${taken} ${H.order[i]} of ${TAKEN}, ` +
    `at step ${H.step[i]}<br>verified loss then ${fmt(H.loss[i])}`;
}

function drawHeads() {
  const counts = Object.keys(D.states).map(state => `${H.state.filter(s => s === state).length} ${state}`);
  document.getElementById("grid-line").textContent = counts.join("; ") +
    (D.mode === "window" ? `. A windowed head keeps each row's first ${D.window.sink} keys and its last ` +
      `${D.window.size}, its own included.` : ".") + " Hover a head for when the search took it.";
  return drawHeatmap(G, H, "state", null, D.states).then(() =>
    Plotly.restyle("heatmap", {text: [G.grid(H.state.map((_, i) => headText(i)))],
                               hovertemplate: "%{text}<extra></extra>"}));
}

function fillCache() {
  const box = document.getElementById("cache-box");
  if (!D.policy) { box.hidden = true; return; }
  const q = D.policy.query_heads, kv = D.policy.kv_heads, rows = [
    ["query heads windowed", `${q.windowed} of ${q.total} (${(100 * q.share).toFixed(1)}%)`],
    ["KV heads freed", `${kv.windowed} of ${kv.total} (${(100 * kv.share).toFixed(1)}%)`]];
  for (const [key, name] of [["longest_text", "the corpus's longest text"], ["context_length", "the context length"]]) {
    const m = D.policy.memory[key];
    if (!m) continue;
    rows.push([`KV cache at ${name} (${m.tokens.toLocaleString()} tokens)`,
      `${(m.policy_bytes / 2 ** 20).toFixed(1)} MiB of ${(m.full_bytes / 2 ** 20).toFixed(1)} MiB: ` +
      `${(100 * m.freed_share).toFixed(1)}% freed`]);
  }
  document.getElementById("cache").replaceChildren(...rows.flatMap(([name, value]) => {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = name; dd.textContent = value;
    return [dt, dd];
  }));
}

function drawCurve() {
  const x = D.curve.map(p => p.heads_removed), y = D.curve.map(p => p.loss), ceiling = D.clean_loss + D.budget;
  const s = D.search;
  document.getElementById("curve-line").textContent = `Every accepted step, verified by a forward pass with ` +
    `every head taken so far taken together: ${s.rounds} rounds, ${s.gradient_passes} gradient passes, ` +
    `${D.seconds} s; ${s.candidates} heads could be taken. Stopped: ${s.stopped}.`;
  const across = [0, Math.max(...x, 1)];
  Plotly.react("curve", [
    {x, y, mode: "lines+markers", type: "scatter", name: "verified loss",
     text: y.map((_, k) => `step ${k}: ${x[k]} heads ${taken}`), hovertemplate: "%{text}<br>loss %{y:.5f}"},
    {x: across, y: [D.clean_loss, D.clean_loss], mode: "lines", type: "scatter", name: "clean loss",
     line: {color: "#999999", width: 1}},
    {x: across, y: [ceiling, ceiling], mode: "lines", type: "scatter", name: `budget +${D.budget} nats`,
     line: {color: "#b2182b", width: 1, dash: "dash"}},
  ], {height: 360, margin: {t: 10, l: 60, r: 10, b: 40}, legend: {orientation: "h", x: 0, y: 1.12},
      xaxis: {title: {text: `heads ${taken}`}},
      yaxis: {title: {text: "corpus loss (nats per predicted token)"}}}, CONFIG);
}

document.getElementById("run-line").textContent = `${D.model}: ${D.mode} mode, budget ${D.budget} nats; ` +
  `loss ${fmt(D.clean_loss)} clean, ${fmt(D.pruned_loss)} pruned (${D.pruned_loss >= D.clean_loss ? "+" : ""}` +
  `${fmt(D.pruned_loss - D.clean_loss)})`;
const draw = headTable("heads-table", H, ["order", "layer", "head", "kv_head", "state", "step", "loss"],
  {text: new Set(["state"]), keep: () => i => H.order[i] !== null});
const orderHeader = () => document.querySelector("#heads-table th");
draw();
orderHeader().click();  // removal order first
fillCache();
drawCurve();
drawHeads().then(() => { document.body.dataset.ready = "true"; });
