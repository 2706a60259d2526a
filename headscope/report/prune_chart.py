"""The chart of a pruning: verified loss against heads removed (matplotlib only; no torch)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from headscope.report.charts import save_each, title_text
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
    ax.set_title(f"{title}\npruning ({record['mode']} removal): {removed} removed")
    return fig


def draw_prune_chart(record: dict, folder: Path, fmt: str) -> tuple[list[Path], list[str]]:
    return save_each({"prune_curve": lambda: prune_curve(record)}, folder, fmt)
