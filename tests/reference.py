"""A deliberately plain re-implementation of the metric definitions, for checking headscope.

One unpadded sentence at a time, one query row at a time, in float64 numpy:
no masks, no diagonals tricks, nothing shared with headscope.measures.statistics.
"""

from __future__ import annotations

import numpy as np

METRIC_NAMES = ("entropy", "norm_entropy", "diagonal", "diagonal_uniform", "sink", "prev_token", "max_weight")


def sentence_rows(attn: np.ndarray, window: int = 2) -> dict[str, list[np.ndarray]]:
    """Per-row values of every metric for one causal sentence.

    attn: (heads, n, n) attention of one sentence without padding. Row t sees keys 0..t.
    Returns metric -> list of (heads,) arrays, one per row that the metric averages over.
    """
    heads, n, _ = attn.shape
    rows: dict[str, list[np.ndarray]] = {name: [] for name in METRIC_NAMES}
    for t in range(n):
        p = attn[:, t, : t + 1].astype(np.float64)  # the keys row t can see
        logs = np.log(np.where(p > 0, p, 1.0))
        entropy = -(p * logs).sum(axis=-1)
        rows["entropy"].append(entropy)
        if t >= 1:
            rows["norm_entropy"].append(entropy / np.log(t + 1))
        first_in_band = max(0, t - window)
        rows["diagonal"].append(p[:, first_in_band:].sum(axis=-1))
        rows["diagonal_uniform"].append(np.full(heads, (t + 1 - first_in_band) / (t + 1)))
        rows["sink"].append(p[:, 0])
        if t >= 1:
            rows["prev_token"].append(p[:, t - 1])
        rows["max_weight"].append(p.max(axis=-1))
    return rows


def corpus_means(sentences: list[np.ndarray], window: int = 2) -> dict[str, np.ndarray]:
    """Token-weighted means over all rows of all sentences, per head; plus entropy_std and n_rows."""
    pooled: dict[str, list[np.ndarray]] = {name: [] for name in METRIC_NAMES}
    for attn in sentences:
        for name, values in sentence_rows(attn, window).items():
            pooled[name].extend(values)
    out = {}
    for name, values in pooled.items():
        heads = sentences[0].shape[0]
        out[name] = np.mean(values, axis=0) if values else np.full(heads, np.nan)
    out["entropy_std"] = np.std(pooled["entropy"], axis=0)
    out["n_rows"] = np.full(sentences[0].shape[0], len(pooled["entropy"]))
    return out
