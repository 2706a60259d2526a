"""Small pure summaries of the heads table shared by the CLI and the charts."""

from __future__ import annotations

import pandas as pd


def importance_column(heads: pd.DataFrame) -> str | None:
    """The importance column to show: exact mean ablation when measured, else its first-order estimate."""
    for column in ("ablation_mean", "attribution_mean"):
        if column in heads and heads[column].notna().any():
            return column
    return None


def most_important(heads: pd.DataFrame, count: int = 10) -> pd.DataFrame:
    """The `count` heads whose removal raises the loss most (by `importance_column`), most important first."""
    column = importance_column(heads)
    if column is None:
        return heads.iloc[0:0]
    return heads.sort_values(column, ascending=False).head(count)


def depth_bands(n_layers: int) -> tuple[range, range]:
    """Early and late layer bands: the first and last third of the model (at least one layer each).

    GPT-2 small (12 layers) gives layers 0-3 and 8-11, the bands of the seed analysis.
    """
    width = max(1, n_layers // 3)
    return range(0, width), range(n_layers - width, n_layers)


def layer_bands(n_layers: int) -> dict[str, range]:
    """Named bands for tables of counts: early, middle (when there is one), late, and all layers."""
    early, late = depth_bands(n_layers)
    bands = {_band_name(early): early}
    if late.start > early.stop:
        middle = range(early.stop, late.start)
        bands[_band_name(middle)] = middle
    if late.start >= early.stop:
        bands[_band_name(late)] = late
    bands["all layers"] = range(n_layers)
    return bands


def _band_name(band: range) -> str:
    return f"layers {band.start}-{band.stop - 1}" if len(band) > 1 else f"layer {band.start}"


def layer_entropy(heads: pd.DataFrame) -> pd.DataFrame:
    """Per layer: mean, standard deviation (over heads, population), min and max of the heads' mean entropy."""
    grouped = heads.groupby("layer")["entropy"]
    return pd.DataFrame(
        {"mean": grouped.mean(), "std": grouped.std(ddof=0), "min": grouped.min(), "max": grouped.max()}
    )


def covers_all_layers(heads: pd.DataFrame) -> bool:
    """Are the table's layers 0..n-1 (not a --layers subset)? Early and late bands need the full depth."""
    layers = sorted(heads["layer"].unique())
    return layers == list(range(len(layers)))


def early_late_entropy(heads: pd.DataFrame) -> dict[str, float] | None:
    """Mean head entropy of the early and late bands, and late minus early (the depth gradient).

    None for a table of a layer subset, or of a model too shallow to have distinct bands.
    """
    n_layers = int(heads["layer"].max()) + 1
    early, late = depth_bands(n_layers)
    if not covers_all_layers(heads) or late.start < early.stop:
        return None
    early_mean = float(heads.loc[heads["layer"].isin(early), "entropy"].mean())
    late_mean = float(heads.loc[heads["layer"].isin(late), "entropy"].mean())
    return {
        "early_layers": f"{early.start}-{early.stop - 1}",
        "late_layers": f"{late.start}-{late.stop - 1}",
        "early_band": early,
        "late_band": late,
        "early": early_mean,
        "late": late_mean,
        "gradient": late_mean - early_mean,
    }
