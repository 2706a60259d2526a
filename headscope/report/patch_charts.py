"""The charts of a patching (matplotlib only; no torch): layers x heads of effects, and heads x positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure

from headscope.report.charts import plain, save_each, title_text
from headscope.summary import model_name, strongest_positions

POSITION_ROWS = 24  # heads shown by position: those with the largest effect anywhere
NOT_PATCHED = "#9e9e9e"  # a head (or position) outside --heads / --layers: grey, not the colour of 0


def _colours():
    return colormaps["RdBu_r"].with_extremes(bad=NOT_PATCHED)


def _norm(values: np.ndarray) -> TwoSlopeNorm:
    """Diverging, centred at 0, symmetric: the same colour means the same size of effect either way."""
    finite = np.abs(values[np.isfinite(values)])
    top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    return TwoSlopeNorm(vcenter=0.0, vmin=-top, vmax=top)


def _title(record: dict) -> str:
    return title_text(f"{model_name(record)}: {record['direction']} patching of each head's {record['what']} "
                 f"on {record['pairs']['count']} pairs ({record['method']})")  # fmt: skip


def patch_heatmap(effects: pd.DataFrame, record: dict) -> Figure:
    depth, heads = record["model"]["architecture"]["layers"], record["model"]["architecture"]["heads"]
    grid = np.full((depth, heads), np.nan)
    shown = strongest_positions(effects)
    grid[shown["layer"].to_numpy(), shown["head"].to_numpy()] = shown["effect"].to_numpy(dtype=float)
    fig = Figure(figsize=(min(3 + 0.45 * heads, 16), min(2.5 + 0.28 * depth, 16)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid, cmap=_colours(), norm=_norm(grid), aspect="auto", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(depth))
    ax.tick_params(labelsize=7)
    where = " (at each head's strongest position)" if "position" in effects else ""
    fig.colorbar(image, ax=ax, label=f"effect{where}: 1 = the behaviour's whole gap, grey = not patched")
    ax.set_title(_title(record), fontsize=9)
    return fig


def patch_positions(effects: pd.DataFrame, record: dict) -> Figure:
    top = strongest_positions(effects).head(POSITION_ROWS).sort_values(["layer", "head"])
    names = [f"{layer}.{head}" for layer, head in zip(top["layer"], top["head"], strict=True)]
    tokens = record.get("roles") or record["tokens"]
    grid = np.full((len(top), len(tokens)), np.nan)
    for row, (layer, head) in enumerate(zip(top["layer"], top["head"], strict=True)):
        mine = effects[(effects["layer"] == layer) & (effects["head"] == head)]
        grid[row, mine["position"].to_numpy()] = mine["effect"].to_numpy(dtype=float)
    fig = Figure(figsize=(min(3 + 0.5 * len(tokens), 18), 2 + 0.3 * len(top)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(grid, cmap=_colours(), norm=_norm(grid), aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xticks(range(len(tokens)), [plain(t) for t in tokens], rotation=60, ha="right", fontsize=7)
    axis = "key position (the value patched)" if record["what"] == "values" else "query position (the row patched)"
    ax.set_xlabel(f"{axis}; {'roles marked in the pairs' if record.get('roles') else 'tokens of the first pair'}"
                  f"{'' if record.get('roles') else chr(39) + 's clean prompt'}")  # fmt: skip
    ax.set_ylabel("layer.head")
    fig.colorbar(image, ax=ax, label="effect")
    ax.set_title(_title(record), fontsize=9)
    return fig


def draw_patch_charts(effects: pd.DataFrame, record: dict, folder: Path, fmt: str) -> tuple[list[Path], list[str]]:
    figures = {"patch_heatmap": lambda: patch_heatmap(effects, record)}
    if "position" in effects:
        figures["patch_positions"] = lambda: patch_positions(effects, record)
    return save_each(figures, folder, fmt)
