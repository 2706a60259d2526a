"""The charts of a pruning: verified loss against heads removed, and for a window-mode pruning which heads are
windowed and which KV heads that frees (matplotlib only; no torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

from headscope.report import palette
from headscope.report.charts import save_each, title_text
from headscope.report.prune_page import FREED, FULL, WINDOWED, head_states
from headscope.summary import model_name


def prune_curve(record: dict) -> Figure:
    """Every accepted step of the search at (heads removed, verified loss), the budget's ceiling drawn across."""
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    removed = [step["heads_removed"] for step in record["curve"]]
    losses = [step["loss"] for step in record["curve"]]
    ax.plot(removed, losses, marker="o", markersize=4, color="#3b528b", label="verified loss (heads removed together)")
    ax.axhline(record["clean_loss"], color="#999999", linewidth=0.8, label=f"clean loss {record['clean_loss']:.4f}")
    ceiling = record["clean_loss"] + record["budget"]
    ax.axhline(ceiling, color="#b2182b", linewidth=0.8, linestyle="--", label=f"budget +{record['budget']:g} nats")
    ax.set_xlabel("heads removed")
    ax.set_ylabel("corpus loss (nats per predicted token)")
    ax.legend(loc="upper left", fontsize=8)
    title = title_text(f"{model_name(record)} on {Path(record['corpus']['path']).name}")
    removed = f"{len(record['heads'])} of {record['total_heads']} heads"
    done = "windowed" if record["mode"] == "window" else "removed"
    ax.set_title(f"{title}\npruning ({record['mode']} removal): {removed} {done}")
    return fig


POLICY_STATES = (FULL, WINDOWED, FREED)
POLICY_COLOURS = tuple(palette.PRUNING[state] for state in POLICY_STATES)


def streaming_heads(record: dict, policy: dict) -> Figure:
    """kv-policy.json on the (layer, head) grid: each query head full or windowed, and where windowed, whether its
    KV head's cache can shrink (every query head reading it windowed) or not."""
    states = head_states(record, policy)
    layers, heads, kv_heads = len(policy["layers"]), max(states["head"]) + 1, max(states["kv_head"]) + 1
    grid = np.array([POLICY_STATES.index(state) for state in states["state"]]).reshape(layers, heads)
    fig = Figure(figsize=(max(7.5, 0.35 * heads + 2.5), max(3.5, 0.22 * layers + 1.5)), layout="constrained")
    ax = fig.subplots()
    ax.imshow(grid, cmap=ListedColormap(POLICY_COLOURS), vmin=0, vmax=2, aspect="auto", interpolation="nearest")
    for boundary in range(heads // kv_heads, heads, heads // kv_heads):  # the query heads that share a KV head
        ax.axvline(boundary - 0.5, color="white", linewidth=1.5)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(0, layers, max(1, layers // 15)))
    for label, colour in zip(POLICY_STATES, POLICY_COLOURS, strict=True):
        ax.plot([], [], "s", color=colour, markersize=8, label=label)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08 - 0.3 / max(layers, 1)), ncol=3, fontsize=8)
    query, kv = policy["query_heads"], policy["kv_heads"]
    ax.set_title(f"{title_text(policy['model']['name'])}: {query['windowed']} of {query['total']} heads windowed "
                 f"to the first {policy['sink']} and last {policy['window']} keys\n{kv['windowed']} of {kv['total']} "
                 f"KV heads freed; loss {policy['loss']['delta']:+.4f} of {policy['loss']['budget']:g} nats",
                 fontsize=9)  # fmt: skip
    return fig


def draw_prune_chart(record: dict, folder: Path, fmt: str, policy: dict | None = None) -> tuple[list[Path], list[str]]:
    """prune_curve, and with a window-mode pruning's kv-policy.json, streaming_heads."""
    figures = {"prune_curve": lambda: prune_curve(record)}
    if policy is not None:
        figures["streaming_heads"] = lambda: streaming_heads(record, policy)
    return save_each(figures, folder, fmt)
