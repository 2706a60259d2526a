"""Float32's error bounds, for tolerances that hold on every CPU (whatever sgemm MKL picks: AVX2, AVX-512, or
MKL_CBWR=COMPATIBLE's) rather than on the machine that wrote the test.

u = 2^-24 is float32's unit roundoff. A sum of n products computed in any order (a BLAS's blocking and fused
multiply-adds included) is within gamma_n = n u / (1 - n u) of the sum of the products' magnitudes (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. 3.5): the bound depends on the inputs' scale, never
on what one machine's rounding happened to give.
"""

from __future__ import annotations

import torch

UNIT = 2.0**-24  # float32's unit roundoff: half the gap between 1 and the next float32


def gamma(n: int) -> float:
    """Higham's gamma_n: the relative error bound of a float32 sum of n terms, in any order."""
    return n * UNIT / (1 - n * UNIT)


def row_statistic(n: int, magnitude: float = 1.0) -> float:
    """How far a statistic summed in float32 over a row of n keys may be from float64's sum of the same float32
    probabilities: every term rounded once, the log's own rounding, and the sum's gamma_n of the terms' magnitude
    (1 for a mass or a largest weight, H + 1 <= ln n + 1 for an entropy, whose terms are p ln p), in any order and
    vector width. A mean over rows keeps the bound; a sum over r rows multiplies it by r."""
    return (gamma(n) + 2 * UNIT) * magnitude


def logit_error(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """(batch, heads, t, t) float64: how far a float32 logit q . k * scaling may be from the exact one: the dot
    product's gamma_d of sum |q_i k_i|, the scaling's rounding, and one more rounding of the logit itself.
    query: (batch, heads, t, d); key: (batch, heads or fewer, t, d), repeated to the query heads."""
    q, k = query.double().abs(), key.double().abs().repeat_interleave(query.shape[1] // key.shape[1], 1)
    magnitude = q @ k.transpose(-1, -2) * abs(scaling)
    return (gamma(query.shape[-1]) + 3 * UNIT) * magnitude


def entropy_error(probs: torch.Tensor, logit_errors: torch.Tensor) -> torch.Tensor:
    """(..., t) float64: how far a row's entropy may move when each logit moves by at most its bound. With
    H = -sum p ln p, dH/ds_j = -p_j (ln p_j + H), so |dH| <= max_j |ds_j| * sum_j p_j |ln p_j + H|; doubled for
    the second-order term, plus the float32 sum of the row's n terms (gamma_n of its magnitude, H + 1)."""
    logs = torch.where(probs > 0, probs.log(), 0.0)
    entropy = -(probs * logs).sum(-1, keepdim=True)
    sensitivity = (probs * (logs + entropy).abs()).sum(-1)
    worst = torch.where(probs > 0, logit_errors, 0.0).amax(-1)
    return 2 * worst * sensitivity + gamma(probs.shape[-1]) * (entropy[..., 0] + 1)
