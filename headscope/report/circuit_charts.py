"""The charts of a circuit (matplotlib only; no torch): the circuit as a graph, layers bottom to top, and its
faithfulness curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from headscope.report.charts import save_each, title_text
from headscope.summary import model_name

GRAPH_EDGES = 40  # edges drawn when the smallest faithful circuit is larger, or there is none: the strongest


def _title(record: dict, what: str) -> str:
    return title_text(f"{model_name(record)}: {what} on {record['pairs']['count']} pairs ({record['method']})")


def _place(node: str, heads: int, depth: int) -> tuple[float, float]:
    """(x, y) of a node: embed at the bottom, each layer's heads on its row and its MLP at the row's right end, the
    logits on top; a KV head's receiver (L.kvG) sits among its layer's heads."""
    if node == "embed":
        return (heads - 1) / 2, -1.0
    if node == "logits":
        return (heads - 1) / 2, float(depth)
    if node.startswith("mlp"):
        return heads + 0.5, int(node[3:]) + 0.5
    layer, unit = node.split(".")
    if unit.startswith("kv"):
        return -1.5 + 0.3 * int(unit[2:]), int(layer)
    return float(int(unit)), float(layer)


def circuit_graph(edges: pd.DataFrame, nodes: pd.DataFrame, record: dict) -> Figure:
    """The circuit's edges (or the strongest GRAPH_EDGES) as arrows, width by |score|, red where corrupting the edge
    lowers m; its heads and MLPs coloured by DLA."""
    architecture = record["model"]["architecture"]
    heads, depth = architecture["heads"], architecture["layers"]
    chosen = edges[edges["in_circuit"]] if edges["in_circuit"].any() else edges
    chosen = chosen.nsmallest(GRAPH_EDGES, "rank")
    fig = Figure(figsize=(min(4 + 0.6 * heads, 16), min(3 + 0.35 * depth, 18)), layout="constrained")
    ax = fig.subplots()
    strongest = float(chosen["score"].abs().max()) if len(chosen) else 1.0
    for row in chosen.itertuples():
        (x0, y0), (x1, y1) = _place(row.sender, heads, depth), _place(row.receiver, heads, depth)
        colour = "#c62828" if row.score < 0 else "#1565c0"
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": colour, "alpha": 0.7,
                    "lw": 0.5 + 3 * abs(row.score) / (strongest or 1.0), "shrinkA": 4, "shrinkB": 4})  # fmt: skip
    shown = set(chosen["sender"]) | set(chosen["receiver"])
    placed = nodes[nodes["node"].isin(shown)]
    dla = placed["dla"].to_numpy(dtype=float)
    top = float(np.abs(dla).max()) if dla.size and np.abs(dla).max() > 0 else 1.0
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-top, vmax=top)
    points = [_place(name, heads, depth) for name in placed["node"]]
    image = ax.scatter([x for x, _ in points], [y for _, y in points], c=dla, cmap=colormaps["RdBu_r"], norm=norm,
                       s=60, edgecolors="#424242", zorder=3)  # fmt: skip
    for name, (x, y) in zip(placed["node"], points, strict=True):
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6)
    for name in sorted(shown - set(placed["node"])):  # receivers without a DLA: KV heads, the logits
        x, y = _place(name, heads, depth)
        ax.scatter([x], [y], marker="s", s=40, color="#e0e0e0", edgecolors="#424242", zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6)
    ax.set_ylabel("layer (embed below, logits above)")
    ax.set_xlabel("head (KV heads left, MLPs right)")
    ax.set_ylim(-1.6, depth + 0.6)
    fig.colorbar(image, ax=ax, label="direct logit attribution (nats of m)")
    size = int(edges["in_circuit"].sum())
    which = f"the {len(chosen)} strongest edges" + (f" of the smallest faithful circuit ({size:,})" if size else "")
    ax.set_title(_title(record, f"{which}; red: corrupting the edge lowers m"), fontsize=9)
    return fig


def faithfulness_curve(record: dict) -> Figure:
    curve = record["faithfulness"]
    shares = [point["share"] for point in curve[1:]]  # the empty circuit has no place on a log axis
    values = [point["faithfulness"] for point in curve[1:]]
    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(shares, values, marker="o")
    ax.set_xscale("log")
    ax.axhline(record["target"], color="#9e9e9e", linestyle="--", linewidth=1, label=f"target {record['target']}")
    ax.axhline(1.0, color="#424242", linewidth=0.5)
    ax.set_xlabel("share of edges in the circuit (the strongest first)")
    ax.set_ylabel("faithfulness")
    ax.legend(fontsize=8)
    ax.set_title(_title(record, f"faithfulness: CPR {record['cpr']:.3f}, CMD {record['cmd']:.3f}"), fontsize=9)
    return fig


def draw_circuit_charts(edges: pd.DataFrame, nodes: pd.DataFrame, record: dict, folder: Path,
                        fmt: str) -> tuple[list[Path], list[str]]:  # fmt: skip
    figures = {"circuit_graph": lambda: circuit_graph(edges, nodes, record)}
    if record["faithfulness"]:
        figures["circuit_faithfulness"] = lambda: faithfulness_curve(record)
    return save_each(figures, folder, fmt)
