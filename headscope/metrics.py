"""Per-head attention statistics: pure functions, no model code.

A layer's attention probabilities ``attn`` have shape (batch, heads, q, k).
``head_row_sums`` reduces them to per-(sentence, head) *sums* over the valid
query rows, one slot per entry of ``STATS``. Sums (not means) are what we keep,
because sums over sentences add up exactly to sums over the corpus; the means
in ``METRICS`` are taken only at the end, so every metric is a token-weighted
mean over all non-padding query rows of all sentences.

Definitions (row t of one head, A[t, s] the probability it gives key s):
    entropy          -sum_s A[t,s] ln A[t,s]                  (nats, 0 ln 0 = 0)
    norm_entropy     entropy / ln(keys row t can see)          rows seeing >= 2 keys
    diagonal         sum_{|t-s| <= window} A[t,s]
    diagonal_uniform what `diagonal` would be if the row spread its mass
                     uniformly over the keys it can see
    sink             A[t, first position of the sentence]
    prev_token       A[t, t-1]                                 rows t >= 1
    max_weight       max_s A[t,s]
Positions are counted from the sentence's first real token, so left and right
padding give the same numbers.
"""

from __future__ import annotations

import numpy as np
import torch

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


def visible_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """Which keys each query row may attend to, from the mask the attention function receives.

    attention_mask: (batch, 1 or heads, q, k), either boolean (True = visible) or additive
    float (0 = visible, the dtype's minimum = hidden). Returns a boolean tensor of the same shape.
    """
    if attention_mask.dtype == torch.bool:
        return attention_mask
    # Additive masks use finfo.min (not -inf) for hidden keys; half of it is a safe cut.
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def causal_visible_keys(query_valid: torch.Tensor) -> torch.Tensor:
    """Visibility for plain causal attention over right- or left-padded sequences.

    query_valid: (batch, t) bool, True for real tokens. Returns (batch, 1, t, t) bool.
    """
    t = query_valid.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=query_valid.device).tril()
    return causal[None, None] & query_valid[:, None, None, :]


def band_row_sums(x: torch.Tensor, window: int) -> torch.Tensor:
    """Sum of x[..., t, s] over keys s with |t - s| <= window, for every row t.

    x: (..., t, t). Returns (..., t). Reads only 2 * window + 1 diagonals, so it
    never builds a (t, t) band mask.
    """
    t = x.shape[-1]
    out = x.new_zeros(x.shape[:-1])
    for offset in range(-window, window + 1):
        if abs(offset) >= t:
            continue
        diag = x.diagonal(offset=offset, dim1=-2, dim2=-1)  # (..., t - |offset|): x[r, r + offset]
        if offset >= 0:
            out[..., : t - offset] += diag
        else:
            out[..., -offset:] += diag
    return out


def head_row_sums(
    attn: torch.Tensor,
    *,
    key_visible: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    window: int,
    accum_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Per-(sentence, head) sums of every row statistic in ``STATS``.

    attn:        (batch, heads, t, t) attention probabilities, any float dtype (read, never modified)
    key_visible: (batch, 1 or heads, t, t) bool, keys each row may see
    query_valid: (batch, t) bool, True on real (non-padding) tokens
    seq_start:   (batch,) long, index of each sentence's first real token (0 with right padding)
    window:      half-width of the diagonal band
    Returns (batch, heads, len(STATS)) in ``accum_dtype``, on attn's device.
    """
    batch, heads, t_q, t_k = attn.shape
    if t_q != t_k:
        raise ValueError(f"expected square attention (no KV cache); got q={t_q}, k={t_k}")
    probs = attn.float()  # reductions in float32 at least, whatever the model dtype

    # Per-row values, each (batch, heads or 1, t).
    entropy = torch.special.entr(probs).sum(-1)
    n_visible = key_visible.sum(-1)
    # ln(1) = 0 for rows seeing one key: they are left out of norm_entropy, so clamp to avoid 0/0.
    norm_entropy = entropy / torch.log(n_visible.clamp(min=2).float())
    diagonal = band_row_sums(probs, window)
    diagonal_uniform = band_row_sums(key_visible.float(), window) / n_visible.clamp(min=1)
    first_key = seq_start.view(batch, 1, 1, 1).expand(batch, heads, t_q, 1)
    sink = probs.gather(-1, first_key).squeeze(-1)
    prev_token = torch.zeros_like(entropy)
    prev_token[..., 1:] = probs.diagonal(offset=-1, dim1=-2, dim2=-1)
    max_weight = probs.amax(-1)

    # Row masks, (batch, 1, t): padding rows count nowhere.
    position = torch.arange(t_q, device=attn.device)[None, :] - seq_start[:, None]
    rows = query_valid[:, None, :]
    norm_rows = rows & (n_visible >= 2)
    prev_rows = rows & (position >= 1)[:, None, :]

    def row_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # `where`, not multiply: padding rows may hold anything, NaN included, and must add exactly 0.
        values = torch.where(mask, values, 0.0).to(accum_dtype)
        return values.expand(batch, heads, t_q).sum(-1)  # (batch, heads)

    ones = torch.ones_like(entropy)
    columns = {
        "n_rows": row_sum(ones, rows),
        "entropy": row_sum(entropy, rows),
        "entropy_sq": row_sum(entropy.square(), rows),
        "norm_entropy": row_sum(norm_entropy, norm_rows),
        "norm_rows": row_sum(ones, norm_rows),
        "diagonal": row_sum(diagonal, rows),
        "diagonal_uniform": row_sum(diagonal_uniform, rows),
        "sink": row_sum(sink, rows),
        "prev_token": row_sum(prev_token, prev_rows),
        "prev_rows": row_sum(ones, prev_rows),
        "max_weight": row_sum(max_weight, rows),
    }
    return torch.stack([columns[name] for name in STATS], dim=-1)


def metric_means(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Turn stat sums (..., len(STATS)) into metric means (...), plus ``entropy_std`` and ``n_rows``.

    A metric with no rows to average (e.g. prev_token of one-token sentences) is NaN.
    """
    sums = np.asarray(sums, dtype=np.float64)

    def stat(name: str) -> np.ndarray:
        return sums[..., STAT_INDEX[name]]

    out: dict[str, np.ndarray] = {"n_rows": stat("n_rows").astype(np.int64)}
    with np.errstate(invalid="ignore", divide="ignore"):
        for metric, (numerator, denominator) in METRICS.items():
            count = stat(denominator)
            out[metric] = np.where(count > 0, stat(numerator) / np.where(count > 0, count, 1), np.nan)
        n = stat("n_rows")
        variance = stat("entropy_sq") / np.where(n > 0, n, 1) - out["entropy"] ** 2
        out["entropy_std"] = np.where(n > 0, np.sqrt(np.clip(variance, 0.0, None)), np.nan)
    return out
