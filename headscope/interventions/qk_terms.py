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

import dataclasses
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
    """The terms and contrasts of a row attending to its visible key number `chosen` (`block_terms` for one row).

    queries: (senders, head_dim), each sender's part of the query at the row (they add up to the query); keys:
    (senders, visible, head_dim), each sender's part of the key at each key the row sees; attention: (visible,) the
    model's attention of the row on those keys, in the same order. row, key: their positions, as the result names
    them (key: `chosen` where not given)."""
    visible = torch.ones(1, keys.shape[1], dtype=torch.bool)
    (found,) = block_terms(queries[:, None], keys, attention[None], visible, torch.tensor([chosen]), scaling=scaling,
                           softcap=softcap, rows=[row])  # fmt: skip
    return found if key is None else dataclasses.replace(found, key=key)


def block_terms(
    queries: torch.Tensor,
    keys: torch.Tensor,
    attention: torch.Tensor,
    visible: torch.Tensor,
    chosen: torch.Tensor,
    *,
    scaling: float,
    softcap: float | None = None,
    rows: list[int],
) -> list[RowTerms]:
    """The terms and contrasts of R rows of one head, each attending to its key `chosen[r]`, in a few products.

    queries: (senders, R, head_dim), each sender's part of the query at each row; keys: (senders, t, head_dim), each
    sender's part of the key at every position; attention: (R, t) the model's attention of each row; visible:
    (R, t) the keys each row sees; chosen: (R,) the key each row is explained at (one it sees); rows: the rows'
    positions, as the results name them.

    The contrast needs no term at the other keys: sum over s' of w(s') term(a, b)(t, s') is scaling * q_a(t) . (sum
    over s' of w(s') k_b(s')), so each row reads each sender's weighted mean key, one product over positions for
    all rows at once, not every (pair, key)."""
    queries, keys = queries.double(), keys.double()
    picked = torch.arange(len(rows))
    logits = scaling * queries.sum(0) @ keys.sum(0).T  # (R, t), uncapped
    secant = torch.ones_like(logits)
    if softcap:
        capped = softcap * torch.tanh(logits / softcap)
        secant = torch.where(logits != 0, capped / torch.where(logits != 0, logits, 1.0), 1.0)
        logits = capped
    seen = attention.double() * visible
    others = seen.clone()
    others[picked, chosen] = 0.0
    total = others.sum(1, keepdim=True)
    others = torch.where(total > 0, others / torch.where(total > 0, total, 1.0), others)  # none: the term alone
    mean_others = torch.matmul(others * secant, keys).transpose(0, 1)  # (R, senders, head_dim), the secant folded in
    at_key = secant[picked, chosen][:, None, None] * keys[:, chosen].transpose(0, 1)  # (R, senders, head_dim)
    by_row = queries.transpose(0, 1)  # (R, senders, head_dim)
    term = scaling * torch.bmm(by_row, at_key.transpose(1, 2))
    contrast = term - scaling * torch.bmm(by_row, mean_others.transpose(1, 2))
    softmax = torch.softmax(logits.masked_fill(~visible, -torch.inf), -1)
    worst = ((softmax - seen) * visible).abs().amax(1)
    found = []
    for r, row in enumerate(rows):
        key = int(chosen[r])
        found.append(RowTerms(row, key, term[r].numpy(), contrast[r].numpy(), float(logits[r, key]),
                              float(attention[r, key]), float(worst[r])))  # fmt: skip
    return found


def strongest_key(attention: torch.Tensor, positions: torch.Tensor) -> int:
    """The index, among a row's visible keys (`positions`, ascending), of its strongest key off the first token
    (position 0, where most heads park what they do not use); the first token where the row sees nothing else."""
    weights = attention.double().clone()
    if len(weights) > 1:
        weights[positions == 0] = -1.0
    return int(torch.argmax(weights))
