"""Numbers from per-head sums, in numpy alone (classify, plot and compare never import torch).

The measurements keep *sums* over attention rows, one slot per entry of ``STATS`` (see
``headscope.measures.statistics`` for how each is computed). Sums over sentences add up exactly to sums over
the corpus, so the means in ``METRICS`` are taken only at the end: every metric is a token-weighted mean over
all non-padding query rows of all sentences.
"""

from __future__ import annotations

import numpy as np

# Slots of the per-head sums, in order. Denominators are counted alongside.
STATS: tuple[str, ...] = (
    "n_rows",  # valid query rows
    "entropy",
    "entropy_sq",  # sum of squared row entropies, for the spread
    "norm_entropy",
    "norm_rows",  # rows that see at least 2 keys
    "diagonal",
    "diagonal_uniform",
    "sink",
    "prev_token",
    "prev_rows",  # rows at position >= 1
    "max_weight",
    "nonfinite_rows",  # valid rows holding NaN or inf (left out of every metric)
    "unnormalised_rows",  # finite rows whose mass is not 1 within tolerance (kept in the metrics)
)
STAT_INDEX: dict[str, int] = {name: i for i, name in enumerate(STATS)}

# metric name -> (numerator stat, denominator stat)
METRICS: dict[str, tuple[str, str]] = {
    "entropy": ("entropy", "n_rows"),
    "norm_entropy": ("norm_entropy", "norm_rows"),
    "diagonal": ("diagonal", "n_rows"),
    "diagonal_uniform": ("diagonal_uniform", "n_rows"),
    "sink": ("sink", "n_rows"),
    "prev_token": ("prev_token", "prev_rows"),
    "max_weight": ("max_weight", "n_rows"),
}


def metric_means(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Turn stat sums (..., len(STATS)) into metric means (...), ``entropy_std`` and the row counts.

    A metric with no rows to average (e.g. prev_token of one-token sentences) is NaN.
    """
    sums = np.asarray(sums, dtype=np.float64)

    def stat(name: str) -> np.ndarray:
        return sums[..., STAT_INDEX[name]]

    out: dict[str, np.ndarray] = {
        name: stat(name).astype(np.int64) for name in ("n_rows", "nonfinite_rows", "unnormalised_rows")
    }
    with np.errstate(invalid="ignore", divide="ignore"):
        for metric, (numerator, denominator) in METRICS.items():
            count = stat(denominator)
            out[metric] = np.where(count > 0, stat(numerator) / np.where(count > 0, count, 1), np.nan)
        n = stat("n_rows")
        variance = stat("entropy_sq") / np.where(n > 0, n, 1) - out["entropy"] ** 2
        out["entropy_std"] = np.where(n > 0, np.sqrt(np.clip(variance, 0.0, None)), np.nan)
    return out
