"""Charts: a tidy DataFrame in, a matplotlib Figure out. No model code.

Every chart function takes keyword-only options, titles its chart with `title` (model and corpus) and
returns the Figure it drew; `draw_charts` draws them all from the frames in hand and saves them, for
`analyze` (straight after measuring) and `plot` (from a report folder) alike.
"""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from headscope.columns import PROBE_PATTERNS
from headscope.config import Thresholds
from headscope.errors import one_line
from headscope.files import atomic_path
from headscope.labels import HEAD_TYPES, ROLES, most_typical
from headscope.layout import CHART_NAMES
from headscope.report import palette
from headscope.report.report import Report
from headscope.summary import early_late_entropy, importance_column, layer_entropy

TYPE_COLOURS, ROLE_COLOURS = palette.TYPES, palette.ROLES
ANNOTATE_UP_TO = 16  # write cell values when the grid is at most this many layers and heads


def plain(text: str) -> str:
    """Text as matplotlib must draw it: literally. A "$" would start mathtext (LaTeX): a model's "$$" token or a
    corpus named "cost $a_$.txt" would fail to parse, or turn into formulas."""
    return str(text).replace("$", r"\$")


TITLE_WIDTH = 80  # characters a title line may hold before it wraps (a figure is 6 to 22 inches wide)
LONG_PATH = 40  # a path longer than this shows as .../its last two parts


def title_text(text: str) -> str:
    """A chart title that fits: a long path (a model folder, a corpus file) cut to ".../its last two parts", then
    lines wrapped at TITLE_WIDTH; drawn literally (`plain`). Long paths used to run off the figure's edge."""
    words = []
    for word in str(text).split(" "):
        parts = word.split("/")
        words.append("…/" + "/".join(parts[-2:]) if len(word) > LONG_PATH and len(parts) > 2 else word)
    lines = [textwrap.fill(line, TITLE_WIDTH, break_long_words=True) for line in " ".join(words).split("\n")]
    return plain("\n".join(lines))


class ChartFontWarning(UserWarning):
    """Characters the charts' text holds (a token, a model or corpus name) that their font has no glyph for: drawn as
    boxes. One warning for all the charts drawn together, naming the characters and the charts (matplotlib gives one
    per character and chart, two lines each: a CJK corpus name made dozens); the CLI prints it as one line."""


MISSING_GLYPH = re.compile(r"Glyph (\d+) \(.+\) missing from font")  # its code point
SHOWN = 8  # characters (and charts) a ChartFontWarning names


def save_each(figures: dict, folder: Path, fmt: str) -> tuple[list[Path], list[str]]:
    """Draw and save each figure (name -> function returning it) as an atomically written `fmt` file. Returns the
    paths written, and "NAME.fmt (the error)" for each that failed: one failed chart never stops the others. The
    characters the charts' font lacks are one ChartFontWarning; other warnings pass as they are."""
    written, failed, missing = [], [], {}
    for name, draw in figures.items():
        path = folder / f"{name}.{fmt}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with atomic_path(path) as tmp:
                    draw().savefig(tmp, format=fmt, dpi=130)
            except Exception as err:  # any drawing failure is reported, never fatal to the tables
                failed.append(f"{path.name} ({one_line(err)})")
            else:
                written.append(path)
        for warning in caught:
            found = MISSING_GLYPH.search(str(warning.message))
            if found:
                missing.setdefault(chr(int(found.group(1))), []).append(path.name)
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if missing:
        charts = list(dict.fromkeys(chart for names in missing.values() for chart in names))
        warnings.warn(f"the chart font has no glyph for {len(missing)} characters ({_some(list(missing))}), drawn as "
                      f"boxes in {_some(charts)}", ChartFontWarning, stacklevel=3)  # fmt: skip
    return written, failed


def _some(names: list[str]) -> str:
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _figure(width: float, height: float) -> Figure:
    # Figure() rather than pyplot: no global figure registry to leak into, no GUI backend needed.
    return Figure(figsize=(width, height), layout="constrained")


def _grid(heads: pd.DataFrame, column: str) -> np.ndarray:
    """(layers, heads) array of `column`."""
    return heads.pivot(index="layer", columns="head", values=column).sort_index().to_numpy(dtype=float)


def _tick_step(n: int, most: int = 32) -> int:
    return max(1, int(np.ceil(n / most)))


def _layer_axis(ax, layers: np.ndarray) -> None:
    """x axis of whole layers: explicit integer ticks (a locator invents fractions for 1-2 layers)."""
    ax.set_xlim(layers.min() - 0.7, layers.max() + 0.7)
    ax.set_xticks(layers[:: _tick_step(len(layers), 20)])
    ax.set_xlabel("layer")


def entropy_heatmap(heads: pd.DataFrame, *, title: str) -> Figure:
    """Mean entropy of every head, layers down, heads across; colour bar in nats."""
    grid = _grid(heads, "entropy")
    layer_ids = sorted(heads["layer"].unique())
    n_layers, n_heads = grid.shape
    width = float(np.clip(2.5 + 0.42 * n_heads, 6, 22))
    height = float(np.clip(1.5 + 0.32 * n_layers, 4, 22))
    fig = _figure(width, height)
    ax = fig.subplots()
    image = ax.imshow(grid, cmap=palette.SCALES["entropy"][0], aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="mean attention entropy (nats)")
    for axis, names, label in ((ax.xaxis, list(range(n_heads)), "head"), (ax.yaxis, layer_ids, "layer")):
        ticks = np.arange(0, len(names), _tick_step(len(names)))
        axis.set_ticks(ticks)
        axis.set_ticklabels([str(names[t]) for t in ticks])
        axis.set_label_text(label)
    if n_layers <= ANNOTATE_UP_TO and n_heads <= ANNOTATE_UP_TO:
        middle = np.nanmean(grid)
        for (layer, head), value in np.ndenumerate(grid):
            colour = "white" if value > middle else "black"
            ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    ax.set_title(f"{title}\nattention entropy per head (dark = diffuse, light = focused)")
    return fig


def layer_gradient(heads: pd.DataFrame, *, title: str, depth: int, layers: pd.DataFrame | None = None) -> Figure:
    """Mean entropy per layer with the spread across heads, the early and late band means of a `depth`-layer
    model, and (from the layers table, when it has intervals) the 95% interval of each layer's mean."""
    per_layer = layer_entropy(heads)
    per_layer_ci = None
    if layers is not None and layers["entropy_ci_low"].notna().any():
        ordered = layers.set_index("layer").reindex(per_layer.index)
        per_layer_ci = (ordered["entropy_ci_low"].to_numpy(), ordered["entropy_ci_high"].to_numpy())
    layers = per_layer.index.to_numpy()
    mean, std = per_layer["mean"].to_numpy(), per_layer["std"].to_numpy()
    low, high = per_layer["min"].to_numpy(), per_layer["max"].to_numpy()
    fig = _figure(float(np.clip(4 + 0.2 * len(layers), 7, 16)), 4.5)
    ax = fig.subplots()
    # Clipped to the min-max range: entropy is never negative, whatever mean - std says.
    std_low, std_high = np.maximum(mean - std, low), np.minimum(mean + std, high)
    if len(layers) >= 3:
        ax.fill_between(layers, low, high, color=palette.MEAN, alpha=0.12, label="min-max over heads")
        ax.fill_between(layers, std_low, std_high, color=palette.MEAN, alpha=0.28, label="mean ± std over heads")
    else:  # a band needs at least a few layers to be visible: draw ranges instead
        ax.vlines(layers, low, high, color=palette.MEAN, alpha=0.3, linewidth=8, label="min-max over heads")
        ax.vlines(layers, std_low, std_high, color=palette.MEAN, alpha=0.6, linewidth=8, label="mean ± std over heads")
    if per_layer_ci is not None:
        ax.fill_between(
            layers,
            per_layer_ci[0],
            per_layer_ci[1],
            color=palette.INTERVAL,
            alpha=0.5,
            linewidth=0,
            label="95% interval of the mean (bootstrap over sentences)",
        )
    ax.plot(layers, mean, marker="o", markersize=3, color=palette.MEAN, label="mean over heads")
    bands = early_late_entropy(heads, depth)  # None for a --layers subset or a model too shallow for two bands
    if bands is not None:
        for name, colour in palette.BANDS.items():
            band = bands[f"{name}_band"]
            ax.hlines(bands[name], band.start - 0.4, band.stop - 0.6, colors=colour, linewidth=2.5)
            span = f"{band.start}-{band.stop - 1}" if len(band) > 1 else f"{band.start}"
            ax.annotate(
                f"{name} layers {span}: {bands[name]:.3f}",
                (band.start - 0.4, bands[name]),
                textcoords="offset points",
                xytext=(0, 6),
                color=colour,
                fontsize=9,
            )
    _layer_axis(ax, layers)
    ax.set_ylabel("attention entropy (nats)")
    ax.legend(loc="best", fontsize=8)
    ax.set_title(f"{title}\nmean attention entropy by layer")
    return fig


def head_types_per_layer(classified: pd.DataFrame, *, title: str) -> Figure:
    """Stacked bars: how many heads of each type every layer has."""
    return _labels_per_layer(classified, "head_type", HEAD_TYPES, TYPE_COLOURS, title=f"{title}\nhead types per layer")


def head_roles_per_layer(labelled: pd.DataFrame, *, title: str) -> Figure:
    """Stacked bars: how many heads of each role every layer has."""
    return _labels_per_layer(labelled, "role", ROLES, ROLE_COLOURS, title=f"{title}\nhead roles per layer")


def _labels_per_layer(labelled: pd.DataFrame, column: str, names, colours: dict[str, str], *, title: str) -> Figure:
    counts = labelled.groupby(["layer", column]).size().unstack(fill_value=0).reindex(columns=names, fill_value=0)
    layers = counts.index.to_numpy()
    fig = _figure(float(np.clip(4 + 0.2 * len(layers), 7, 16)), 4.5)
    ax = fig.subplots()
    bottom = np.zeros(len(layers))
    for name in names:
        total = int(counts[name].sum())
        ax.bar(layers, counts[name], bottom=bottom, color=colours[name], label=f"{name} ({total})", width=0.85)
        bottom += counts[name].to_numpy()
    _layer_axis(ax, layers)
    ax.set_ylabel("heads")
    ax.set_ylim(0, bottom.max() * 1.02)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title=column.replace("_", " "))
    ax.set_title(title)
    return fig


def probe_scores(heads: pd.DataFrame, *, title: str) -> Figure:
    """One heatmap per probe pattern, layers down and heads across, on one 0-1 colour scale."""
    layer_ids = sorted(heads["layer"].unique())
    n_heads = heads["head"].nunique()
    width = float(np.clip(2.5 + len(PROBE_PATTERNS) * (1.2 + 0.15 * n_heads), 9, 24))
    fig = _figure(width, float(np.clip(2.2 + 0.16 * len(layer_ids), 4.5, 16)))
    axes = fig.subplots(1, len(PROBE_PATTERNS), sharey=True)
    image = None
    for ax, pattern in zip(axes, PROBE_PATTERNS, strict=True):
        column = f"probe_{pattern}"
        share = palette.SCALES["share"][0]
        image = ax.imshow(_grid(heads, column), cmap=share, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        chance = float(heads[f"{column}_chance"].iloc[0])
        ax.set_title(f"{pattern} (chance {chance:.3f})", fontsize=10)
        ticks = np.arange(0, n_heads, _tick_step(n_heads, 16))
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("head")
    rows = np.arange(0, len(layer_ids), _tick_step(len(layer_ids)))
    axes[0].set_yticks(rows, [str(layer_ids[r]) for r in rows])
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="attention on the pattern's target (mean over seeds)")
    fig.suptitle(f"{title}\nprobe scores on repeated random tokens")
    return fig


def importance_heatmap(heads: pd.DataFrame, *, title: str) -> Figure:
    """Each head's importance (nats of loss), layers down, heads across; diverging colours centred at 0."""
    column = importance_column(heads)
    grid = _grid(heads, column)
    layer_ids = sorted(heads["layer"].unique())
    n_layers, n_heads = grid.shape
    fig = _figure(float(np.clip(2.5 + 0.42 * n_heads, 6, 22)), float(np.clip(1.5 + 0.32 * n_layers, 4, 22)))
    ax = fig.subplots()
    limit = float(np.nanmax(np.abs(grid))) or 1.0  # symmetric: red raises the loss, blue lowers it
    cmap = palette.SCALES["diverging"][0]
    image = ax.imshow(grid, cmap=cmap, vmin=-limit, vmax=limit, aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"{column} (nats of loss)")
    for axis, names, label in ((ax.xaxis, list(range(n_heads)), "head"), (ax.yaxis, layer_ids, "layer")):
        ticks = np.arange(0, len(names), _tick_step(len(names)))
        axis.set_ticks(ticks)
        axis.set_ticklabels([str(names[t]) for t in ticks])
        axis.set_label_text(label)
    what = "mean ablation, exact" if column.startswith("ablation") else "mean ablation, second-order estimate"
    ax.set_title(f"{title}\nloss increase without each head ({what})")
    return fig


def importance_against_entropy(heads: pd.DataFrame, *, title: str) -> Figure:
    """Every head at (entropy, importance), coloured by role: do focused heads matter more?"""
    column = importance_column(heads)
    fig = _figure(8.5, 5.5)
    ax = fig.subplots()
    for role in ROLES:
        members = heads[heads["role"] == role]
        if len(members):
            ax.scatter(
                members["entropy"],
                members[column],
                s=16,
                alpha=0.85,
                color=ROLE_COLOURS[role],
                label=f"{role} ({len(members)})",
                edgecolors="none",
            )
    ax.axhline(0.0, color="#999999", linewidth=0.8)
    ax.set_xlabel("mean attention entropy (nats)")
    ax.set_ylabel(f"{column} (nats of loss)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="role")
    what = "exact mean ablation" if column.startswith("ablation") else "its second-order estimate"
    ax.set_title(f"{title}\nloss increase without each head ({what}) against attention entropy")
    return fig


def classification_map(classified: pd.DataFrame, thresholds: Thresholds, *, title: str) -> Figure:
    """Every head at (locality, norm_entropy), coloured by type, with the rule's threshold lines."""
    fig = _figure(8.5, 5.5)
    ax = fig.subplots()
    for name in HEAD_TYPES:
        members = classified[classified["head_type"] == name]
        ax.scatter(
            members["locality"],
            members["norm_entropy"],
            s=14,
            alpha=0.8,
            color=TYPE_COLOURS[name],
            label=f"{name} ({len(members)})",
            edgecolors="none",
        )
    x_low = float(np.nanmin([classified["locality"].min(), thresholds.local_min_locality, 0.0])) - 0.05
    ax.set_xlim(x_low, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.axvline(thresholds.local_min_locality, color=TYPE_COLOURS["local"], linestyle="--", linewidth=1)
    for value, name in ((thresholds.copy_max_norm_entropy, "copy"), (thresholds.broad_min_norm_entropy, "broad")):
        ax.hlines(value, x_low, thresholds.local_min_locality, colors=TYPE_COLOURS[name], linestyles="--", linewidth=1)
    ax.text(thresholds.local_min_locality + 0.01, 1.0, "local →", va="top", fontsize=8, color=TYPE_COLOURS["local"])
    ax.text(x_low + 0.01, thresholds.copy_max_norm_entropy - 0.01, "copy ↓", va="top", fontsize=8)
    ax.text(x_low + 0.01, thresholds.broad_min_norm_entropy + 0.01, "broad ↑", va="bottom", fontsize=8)
    ax.set_xlabel("locality: band mass above uniform's, as a share of what uniform leaves outside (±window)")
    ax.set_ylabel("normalised entropy (entropy / ln visible keys)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title="head type")
    ax.set_title(f"{title}\nwhy each head got its type (locality is checked first)")
    return fig


def first_corpus_view(examples: pd.DataFrame | None) -> pd.DataFrame | None:
    """The rows of the first corpus sentence of the example views (None when there is none)."""
    if examples is None:
        return None
    corpus = examples[examples["source"] == "corpus"]
    return None if corpus.empty else corpus[corpus["sentence_id"] == corpus["sentence_id"].iloc[0]]


def example_heads(examples: pd.DataFrame, chosen: dict[str, tuple[int, int]], *, title: str) -> Figure:
    """One attention matrix per head type, for the most typical head of that type, on one real sentence.

    examples: long-form attention of one sentence: layer, head, query, key, weight, query_token, key_token.
    """
    fig = _figure(4.6 * max(len(chosen), 1), 5.2)
    axes = np.atleast_1d(fig.subplots(1, max(len(chosen), 1)))
    n = int(max(examples["query"].max(), examples["key"].max())) + 1
    tokens = [""] * n
    for query, token in examples.drop_duplicates("query")[["query", "query_token"]].itertuples(index=False):
        tokens[query] = str(token)
    image = None
    for ax, (name, (layer, head)) in zip(axes, chosen.items(), strict=False):
        part = examples[(examples["layer"] == layer) & (examples["head"] == head)]
        matrix = np.full((n, n), np.nan)
        matrix[part["query"].to_numpy(), part["key"].to_numpy()] = part["weight"].to_numpy()
        image = ax.imshow(matrix, cmap=palette.SCALES["share"][0], vmin=0, vmax=1, interpolation="nearest")
        ax.set_xticks(range(n), [plain(t) for t in tokens], rotation=90, fontsize=7)
        ax.set_yticks(range(n), [plain(t) for t in tokens], fontsize=7)
        ax.set_xlabel("key (attended to)")
        ax.set_ylabel("query")
        ax.set_title(f"{name}: layer {layer}, head {head}", color=TYPE_COLOURS[name])
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.6, label="attention weight")
    fig.suptitle(f"{title}\nthe most typical head of each type on one sentence")
    return fig


def draw_charts(report: Report, *, folder: Path, fmt: str) -> tuple[list[Path], list[str]]:
    """Draw every chart of `report` into `folder` as `fmt` files; return what `save_each` returns.

    Its layers table (when it has intervals) bands the layer gradient; its examples give the example chart. A
    chart without data (no probes, no importance, no example) is skipped.
    """
    heads, title, thresholds = report.heads, title_text(report.title), report.thresholds
    figures = {
        "entropy_heatmap": lambda: entropy_heatmap(heads, title=title),
        "layer_gradient": lambda: layer_gradient(heads, title=title, depth=report.depth, layers=report.layers),
        "head_types": lambda: head_types_per_layer(heads, title=title),
        "head_roles": lambda: head_roles_per_layer(heads, title=title),
        "probe_scores": lambda: probe_scores(heads, title=title),
        "importance_heatmap": lambda: importance_heatmap(heads, title=title),
        "importance_entropy": lambda: importance_against_entropy(heads, title=title),
        "classification_map": lambda: classification_map(heads, thresholds, title=title),
        "examples": lambda: example_heads(
            first_corpus_view(report.examples), most_typical(heads, thresholds), title=title
        ),
    }
    no_importance = importance_column(heads) is None
    skipped = {
        "examples": first_corpus_view(report.examples) is None,
        "probe_scores": heads["probe_induction"].isna().all(),
        "importance_heatmap": no_importance,
        "importance_entropy": no_importance,
    }
    return save_each({name: figures[name] for name in CHART_NAMES if not skipped.get(name)}, folder, fmt)
