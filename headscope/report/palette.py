"""One set of colours for the PNG charts and the page (which receives them in its data).

Colour scales are named after what they show, each with the matplotlib colormap the charts use and the same
colormap's colours at 11 even stops for the page (plotly.js has no magma; a test checks the stops against
matplotlib's own). Higher values go the same way in both: darker for entropy, brighter for a share, red for a
positive importance.
"""

from __future__ import annotations

TYPES = {"local": "#1b9e77", "copy": "#d95f02", "broad": "#7570b3", "mixed": "#9e9e9e"}
# Distinct from every type colour: a role and a type are never read as one another.
ROLES = {
    "retrieval": "#a50026",
    "induction": "#e7298a",
    "duplicate-token": "#66a61e",
    "previous-token": "#17becf",
    "dormant": "#3b3b3b",
    "sink": "#8c564b",
    "positional": "#e6ab02",
    "streaming": "#bcbd22",
    "broad": "#1f77b4",
    "other": "#c7c7c7",
}
# What a pruning did to each head (prune.html and the streaming_heads chart): kept heads pale, taken heads dark,
# and in window mode the windowed heads whose KV head another full head still reads in between.
PRUNING = {
    "kept": "#e8e8e8",
    "removed": "#5e3c99",
    "full": "#e8e8e8",
    "windowed, its KV head still full": "#fdb863",
    "windowed, its KV head freed": "#5e3c99",
}
MEAN = "#4c72b0"  # a layer mean, and report A
INTERVAL = "#dd8452"  # a 95% interval band, and report B
SIDES = {"a": MEAN, "b": INTERVAL}
BANDS = {"early": "#2ca02c", "late": "#d62728"}

_MAGMA_R = ["#fcfdbf", "#fecf92", "#fe9f6d", "#f7705c", "#de4968", "#b5367a", "#8c2981", "#641a80", "#3b0f70"]
_MAGMA_R += ["#140e36", "#000004"]
_VIRIDIS = ["#440154", "#482475", "#414487", "#355f8d", "#2a788e", "#21918c", "#22a884", "#44bf70", "#7ad151"]
_VIRIDIS += ["#bddf26", "#fde725"]
_RDBU_R = ["#053061", "#2065ab", "#4393c3", "#90c4dd", "#d1e5f0", "#f7f6f6", "#fddbc7", "#f3a481", "#d6604d"]
_RDBU_R += ["#b1182b", "#67001f"]
_GREYS = ["#ffffff", "#f3f3f3", "#e2e2e2", "#cecece", "#b5b5b5", "#959595", "#7a7a7a", "#5f5f5f", "#404040"]
_GREYS += ["#1d1d1d", "#000000"]

# scale -> (matplotlib colormap, its colours from low to high values, fixed limits or None, symmetric around 0)
SCALES: dict[str, tuple[str, list[str], tuple[float, float] | None, bool]] = {
    "entropy": ("magma_r", _MAGMA_R, None, False),  # high entropy (diffuse) dark, focused light
    "share": ("viridis", _VIRIDIS, (0.0, 1.0), False),  # a share of attention: more is brighter
    "diverging": ("RdBu_r", _RDBU_R, None, True),  # importance: red raises the loss, blue lowers it
    "count": ("Greys", _GREYS, None, False),  # how many heads: more is darker
    "magnitude": ("viridis", _VIRIDIS, None, False),  # a norm or a scale, unbounded: more is brighter
}


def as_dict() -> dict:
    """The palette as the page's data carries it."""
    scales = {}
    for name, (_, colours, limits, symmetric) in SCALES.items():
        stops = [[i / (len(colours) - 1), colour] for i, colour in enumerate(colours)]
        scales[name] = {"stops": stops, "range": limits, "symmetric": symmetric}
    return {
        "types": TYPES,
        "roles": ROLES,
        "pruning": PRUNING,
        "mean": MEAN,
        "interval": INTERVAL,
        "sides": SIDES,
        "bands": BANDS,
        "scales": scales,
    }
