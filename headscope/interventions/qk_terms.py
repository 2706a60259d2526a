"""Why a head attends where it does: its attention logit split exactly into pairs of the components that write its
query and its key (docs/why.md has the definitions). Pure maths on the senders' query and key vectors; where they
come from (one pass of the model, its norms frozen): interventions.qk_senders.

For head h, query row t and key s, with q_a(t) the query vector sender a alone gives (through the input norm with its
scale frozen, W_Q, any q norm frozen, RoPE at t) and k_b(s) likewise on the key side:

    logit(t, s) = scaling * q(t) . k(s) = sum over (a, b) of term(a, b),  term(a, b) = scaling * q_a(t) . k_b(s)

(each side's biases are one more sender, `bias`). A softcap c tanh(x / c) is linearised at the run by its secant:
every term of key s times capped(s) / logit(s), so that the terms still add up to the logit the softmax reads.

    contrast(a, b) = term(a, b)(t, s) - sum over s' != s of w(s') term(a, b)(t, s')

with w the row's attention on its other visible keys, renormalised without s: why s rather than the others. The
contrasts add up to logit(t, s) minus the w-weighted mean of the other keys' logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowTerms:
    """One (row, key) of a head: every (query sender, key sender) pair's term and contrast, (senders, senders)
    float64, rows the query side's senders and columns the key side's; the logit and its check."""

    row: int
    key: int
    term: np.ndarray
    contrast: np.ndarray
    logit: float  # the sum of the terms: the logit the softmax reads (after any softcap)
    weight: float  # the model's attention on (row, key)
    worst_error: float  # largest difference between the row's softmax of the summed logits and the model's attention


def row_terms(
    queries: torch.Tensor,
    keys: torch.Tensor,
    attention: torch.Tensor,
    chosen: int,
    *,
    scaling: float,
    softcap: float | None = None,
    row: int = 0,
    key: int | None = None,
) -> RowTerms:
    """The terms and contrasts of a row attending to its visible key number `chosen`.

    queries: (senders, head_dim), each sender's part of the query at the row (they add up to the query); keys:
    (senders, visible, head_dim), each sender's part of the key at each key the row sees; attention: (visible,) the
    model's attention of the row on those keys, in the same order. row, key: their positions, as the result names
    them (key: `chosen` where not given)."""
    key, index = (chosen if key is None else key), chosen
    queries, keys = queries.double(), keys.double()
    logits = scaling * torch.einsum("d,bsd->s", queries.sum(0), keys)  # (visible,) uncapped
    secant = torch.ones_like(logits)
    if softcap:
        capped = softcap * torch.tanh(logits / softcap)
        secant = torch.where(logits != 0, capped / torch.where(logits != 0, logits, 1.0), 1.0)
        logits = capped
    others = attention.double().clone()
    others[index] = 0.0
    total = others.sum()
    others = others / total if total > 0 else others  # renormalised without the key; none: the contrast is the term
    # the key side of each sender: at the key, and the others' weighted mean (the secant folded in, per key)
    at_key = secant[index] * keys[:, index]  # (senders, head_dim)
    mean_others = torch.einsum("s,bsd->bd", others * secant, keys)
    term = scaling * queries @ at_key.T
    contrast = term - scaling * queries @ mean_others.T
    worst = float((torch.softmax(logits, -1) - attention.double()).abs().max())
    return RowTerms(row, key, term.numpy(), contrast.numpy(), float(logits[index]), float(attention[index]), worst)


def strongest_key(attention: torch.Tensor, positions: torch.Tensor) -> int:
    """The index, among a row's visible keys (`positions`, ascending), of its strongest key off the first token
    (position 0, where most heads park what they do not use); the first token where the row sees nothing else."""
    weights = attention.double().clone()
    if len(weights) > 1:
        weights[positions == 0] = -1.0
    return int(torch.argmax(weights))
