"""One set of colours for the PNG charts and the page (which receives them in its data)."""

from __future__ import annotations

TYPES = {"local": "#1b9e77", "copy": "#d95f02", "broad": "#7570b3", "mixed": "#9e9e9e"}
ROLES = {
    "induction": "#e7298a",
    "duplicate-token": "#66a61e",
    "previous-token": "#1b9e77",
    "sink": "#d95f02",
    "positional": "#e6ab02",
    "broad": "#7570b3",
    "other": "#bdbdbd",
}
MEAN = "#4c72b0"  # a layer mean, and report A
INTERVAL = "#dd8452"  # a 95% interval band, and report B
SIDES = {"a": MEAN, "b": INTERVAL}
BANDS = {"early": "#2ca02c", "late": "#d62728"}


def as_dict() -> dict:
    """The palette as the page's data carries it."""
    return {"types": TYPES, "roles": ROLES, "mean": MEAN, "interval": INTERVAL, "sides": SIDES, "bands": BANDS}
