"""Head labels from the per-head table: pure functions, no model, no I/O.

Types are checked in order (the first that matches wins):
    local  locality >= local_min_locality             attends to its neighbourhood
    copy   norm_entropy <= copy_max_norm_entropy      locks onto one or two tokens
    broad  norm_entropy >= broad_min_norm_entropy     spreads its attention widely
    mixed  anything else
Locality comes first because a previous-token head is also sharply peaked (low entropy): checking
entropy first would call it a copy head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import pandas as pd

from headscope.config import Thresholds

HeadType = Literal["local", "copy", "broad", "mixed"]
HEAD_TYPES: tuple[HeadType, ...] = ("local", "copy", "broad", "mixed")

# type -> (test on the heads table, reason shown for heads that pass it). Order is the rule's order.
Rule = tuple[Callable[[pd.DataFrame, Thresholds], pd.Series], Callable[[pd.Series, Thresholds], str]]
RULES: dict[HeadType, Rule] = {
    "local": (
        lambda h, t: h["locality"] >= t.local_min_locality,
        lambda r, t: f"locality {r.locality:.3f} >= {t.local_min_locality}",
    ),
    "copy": (
        lambda h, t: h["norm_entropy"] <= t.copy_max_norm_entropy,
        lambda r, t: f"norm_entropy {r.norm_entropy:.3f} <= {t.copy_max_norm_entropy}",
    ),
    "broad": (
        lambda h, t: h["norm_entropy"] >= t.broad_min_norm_entropy,
        lambda r, t: f"norm_entropy {r.norm_entropy:.3f} >= {t.broad_min_norm_entropy}",
    ),
}


def locality(diagonal: pd.Series, diagonal_uniform: pd.Series) -> pd.Series:
    """(diagonal - diagonal_uniform) / (1 - diagonal_uniform); NaN where uniform already fills the band."""
    room = 1.0 - diagonal_uniform
    return (diagonal - diagonal_uniform) / room.where(room > 1e-12)


def classify_heads(heads: pd.DataFrame, thresholds: Thresholds) -> pd.DataFrame:
    """A copy of `heads` with `locality`, `head_type` and `type_reason` (the evidence) set."""
    out = heads.copy()
    out["locality"] = locality(out["diagonal"], out["diagonal_uniform"])
    head_type = pd.Series("mixed", index=out.index, dtype=object)
    undecided = pd.Series(True, index=out.index)
    for name, (test, _) in RULES.items():
        hit = undecided & test(out, thresholds).fillna(False)
        head_type[hit] = name
        undecided &= ~hit
    out["head_type"] = head_type
    out["type_reason"] = [_reason(row, thresholds) for row in out.itertuples()]
    return out


def _reason(row, thresholds: Thresholds) -> str:
    if row.head_type in RULES:
        return RULES[row.head_type][1](row, thresholds)
    return (
        f"locality {row.locality:.3f} < {thresholds.local_min_locality}, norm_entropy {row.norm_entropy:.3f} "
        f"between {thresholds.copy_max_norm_entropy} and {thresholds.broad_min_norm_entropy}"
    )


def type_counts(classified: pd.DataFrame, bands: dict[str, range] | None = None) -> pd.DataFrame:
    """Heads per type: overall, or per named band of layers (rows: band, columns: the four types)."""
    bands = bands or {"all layers": range(int(classified["layer"].max()) + 1)}
    rows = {}
    for name, layers in bands.items():
        in_band = classified[classified["layer"].isin(layers)]
        rows[name] = in_band["head_type"].value_counts().reindex(HEAD_TYPES, fill_value=0)
    return pd.DataFrame(rows).T


def most_typical(classified: pd.DataFrame, thresholds: Thresholds) -> dict[str, tuple[int, int]]:
    """For each type present, the (layer, head) deepest inside its type's region."""
    middle = (thresholds.copy_max_norm_entropy + thresholds.broad_min_norm_entropy) / 2
    score = {
        "local": classified["locality"],
        "copy": -classified["norm_entropy"],
        "broad": classified["norm_entropy"],
        "mixed": -(classified["norm_entropy"] - middle).abs(),
    }
    chosen = {}
    for name in HEAD_TYPES:
        members = classified["head_type"] == name
        if members.any():
            best = score[name][members].astype(float).fillna(-np.inf).idxmax()
            chosen[name] = (int(classified.at[best, "layer"]), int(classified.at[best, "head"]))
    return chosen


def classification_record(classified: pd.DataFrame, thresholds: Thresholds) -> dict:
    """What run.json and the Parquet metadata say about the classification: the rule and its counts."""
    counts = classified["head_type"].value_counts().reindex(HEAD_TYPES, fill_value=0)
    return {"thresholds": thresholds.to_dict(), "counts": {name: int(n) for name, n in counts.items()}}
