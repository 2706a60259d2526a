"""Charts of a comparison: DataFrames in, matplotlib Figures out (and `draw_comparison` saves them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from headscope.labels import ROLES
from headscope.report import palette
from headscope.report.charts import _figure, _grid, _layer_axis, _tick_step, plain, save_each, title_text
from headscope.report.compare import Comparison

SIDES = {side: (side.upper(), colour) for side, colour in palette.SIDES.items()}


def delta_heatmap(heads: pd.DataFrame, *, title: str, metric: str = "entropy") -> Figure:
    """B - A of `metric` for every head, diverging colours centred at 0 on symmetric limits; a dot marks the
    heads whose change is significant (false discovery rate 5%)."""
    grid = _grid(heads, f"{metric}_delta")
    layer_ids = sorted(heads["layer"].unique())
    n_layers, n_heads = grid.shape
    fig = _figure(float(np.clip(2.5 + 0.42 * n_heads, 6, 22)), float(np.clip(1.5 + 0.32 * n_layers, 4, 22)))
    ax = fig.subplots()
    limit = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 0.0
    limit = limit or 1.0
    cmap = palette.SCALES["diverging"][0]
    image = ax.imshow(grid, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"{metric}: B - A")
    significant = heads[heads[f"{metric}_significant"]] if f"{metric}_significant" in heads else heads.iloc[:0]
    rows = {layer: i for i, layer in enumerate(layer_ids)}
    ax.scatter(significant["head"], significant["layer"].map(rows), s=8, color="black", label="significant")
    for axis, names, label in ((ax.xaxis, list(range(n_heads)), "head"), (ax.yaxis, layer_ids, "layer")):
        ticks = np.arange(0, len(names), _tick_step(len(names)))
        axis.set_ticks(ticks)
        axis.set_ticklabels([str(names[t]) for t in ticks])
        axis.set_label_text(label)
    ax.set_title(f"{title}\nchange in {metric} per head (dots: significant, FDR 5%)")
    return fig


def layer_gradients(comparison: Comparison, *, title: str) -> Figure:
    """Both reports' mean entropy per layer with their 95% bands, on one axis (relative depth across models)."""
    fig = _figure(9, 4.8)
    ax = fig.subplots()
    for side, (name, colour) in SIDES.items():
        x, mean, low, high = _gradient(comparison, side)
        ax.fill_between(x, low, high, color=colour, alpha=0.25, linewidth=0)
        label = comparison.record[side]["model"], Path(str(comparison.record[side]["corpus"])).name
        ax.plot(x, mean, marker="o", markersize=3, color=colour, label=plain(f"{name}: {label[0]} on {label[1]}"))
    if comparison.same_grid:
        _layer_axis(ax, comparison.layers["layer"].to_numpy())
    else:
        ax.set_xlabel("relative depth: layer / (layers - 1)")
        ax.set_xlim(-0.03, 1.03)
    ax.set_ylabel("mean attention entropy (nats)")
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{title}\nmean attention entropy by depth, with 95% intervals")
    return fig


def _gradient(comparison: Comparison, side: str):
    layers = comparison.layers
    if comparison.same_grid:
        return (
            layers["layer"].to_numpy(),
            layers[f"entropy_{side}"],
            layers[f"entropy_{side}_ci_low"],
            layers[f"entropy_{side}_ci_high"],
        )
    mine = layers[layers["report"] == side.upper()]
    return mine["relative_depth"], mine["entropy"], mine["entropy_ci_low"], mine["entropy_ci_high"]


def transitions(comparison: Comparison, *, title: str) -> Figure:
    """How heads moved between labels: A's head type (role) down, B's across, counts in the cells."""
    fig = _figure(12, 5.5)
    axes = fig.subplots(1, len(comparison.transitions))
    for ax, (label, table) in zip(np.atleast_1d(axes), comparison.transitions.items(), strict=True):
        ax.imshow(table.to_numpy(), cmap=palette.SCALES["count"][0], aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(table.columns)), table.columns, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(table.index)), table.index, fontsize=8)
        middle = table.to_numpy().max() / 2 if table.to_numpy().size else 0
        for (i, j), count in np.ndenumerate(table.to_numpy()):
            if count:
                ax.text(
                    j, i, str(count), ha="center", va="center", fontsize=8, color="white" if count > middle else "black"
                )
        ax.set_xlabel(f"{label.replace('_', ' ')} in B")
        ax.set_ylabel(f"{label.replace('_', ' ')} in A")
    fig.suptitle(f"{title}\nheads per label in A (rows) and B (columns)")
    return fig


def band_shares(bands: pd.DataFrame, *, title: str) -> Figure:
    """Share of each role per third of the depth, A beside B: does early-broad, late-focused hold in both?"""
    roles = bands[bands["kind"] == "role"]
    fig = _figure(10, 4.8)
    ax = fig.subplots()
    positions, names = [], []
    for i, band in enumerate(("early", "middle", "late")):
        for j, report in enumerate(("A", "B")):
            x = i * 3 + j
            shares = roles[(roles["band"] == band) & (roles["report"] == report)].set_index("label")["share"]
            bottom = 0.0
            for role in ROLES:
                value = float(shares.get(role, 0.0) or 0.0)
                ax.bar(
                    x,
                    value,
                    bottom=bottom,
                    color=palette.ROLES[role],
                    width=0.85,
                    label=role if (i, j) == (0, 0) else None,
                )
                bottom += value
            positions.append(x)
            names.append(f"{band}\n{report}")
    ax.set_xticks(positions, names, fontsize=8)
    ax.set_ylabel("share of the band's heads")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="role")
    ax.set_title(f"{title}\nroles per third of the depth")
    return fig


def draw_comparison(comparison: Comparison, *, folder: Path, fmt: str) -> tuple[list[Path], list[str]]:
    """Every comparison chart into `folder` (the per-head ones only for the same grid); returns what
    charts.save_each returns."""
    title = title_text(comparison.title)
    figures = {
        "layer_gradients": lambda: layer_gradients(comparison, title=title),
        "band_shares": lambda: band_shares(comparison.bands, title=title),
    }
    if comparison.same_grid:
        figures["delta_heatmap"] = lambda: delta_heatmap(comparison.heads, title=title)
        figures["transitions"] = lambda: transitions(comparison, title=title)
    return save_each(figures, folder, fmt)
