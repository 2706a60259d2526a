"""A block of query rows' output and statistics from the fused pass's folded state (attention.tile_loop).

The fold leaves each sentence's first key out; here it is put back, which gives the statistics over every key and,
from the same state, those off the sink (every key but the first) with nothing subtracted:
    m = max(m', s_f)    A = A' e^(m' - m) + e^(s_f - m)    B = e^(m' - m) (B' + (m' - m) A') + e^(s_f - m) (s_f - m)
(primes: the fold's state; s_f the first key's logit, recomputed by one dot product). Sink, previous-token and
diagonal-band mass are probabilities of single keys, e^(s - m) / A, likewise recomputed, unless the state brings
them (the C++ kernel's key points: s_f, the previous key's logit, and the band's e^(s - m') and count off the sink,
folded as it went).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from headscope.model.masks import TileVisibility

# Offsets of the diagonal band handled per gather: bounds the (rows x offsets x head_dim) keys gathered.
BAND_CHUNK = 32


@dataclass(frozen=True)
class RowValues:
    """Per-row statistics of one layer, (batch, heads, rows) each, plus what the mask shows of each row."""

    entropy: torch.Tensor
    max_weight: torch.Tensor
    top_key: torch.Tensor  # long: the first key holding the row's largest logit
    top_tied: torch.Tensor  # bool: several keys hold it
    diagonal: torch.Tensor
    sink: torch.Tensor
    prev_token: torch.Tensor
    n_visible: torch.Tensor  # (batch or 1, 1 or heads, rows): keys the row may see
    band_visible: torch.Tensor  # (batch or 1, 1 or heads, rows): of them, within the diagonal band
    first_visible: torch.Tensor  # (batch, 1 or heads, rows) bool: the row may see its sentence's first key
    rest_mass: torch.Tensor  # mass off the sink (on every key but the sentence's first)
    rest_entropy: torch.Tensor  # entropy of that mass renormalised
    rest_top_key: torch.Tensor  # long: the first key off the sink holding its largest logit
    rest_top_tied: torch.Tensor  # bool: several keys off the sink hold it
    logit_std: torch.Tensor  # standard deviation of the logits over the keys the row may see
    # the row's total probability, where it was summed (probabilities the model computed); None: 1 by construction
    mass: torch.Tensor | None = None
    # the largest weight off the sink, where the path has it at no cost (the fused read-off); None: read it from the
    # probabilities at rest_top_key
    rest_max_weight: torch.Tensor | None = None

    def columns(self) -> dict[str, torch.Tensor]:
        """The values present, by name (`mass` only where it was summed)."""
        return {name: value for name, value in vars(self).items() if value is not None}


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """c tanh(scores / c), Gemma 2's logit softcapping (the scores themselves when there is none)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def read_off(grouped_query, key, value, visibility, rows, state, softcap, seq_start, window):
    """A block of rows' output and statistics from its folded state (every key but the sentence's first) and the
    first key's logit, put together here: m = max(m', s_f), A = A' e^(m' - m) + e^(s_f - m), and so on. The state
    is the fold's nine tensors, or those and the four key points the C++ kernel folds (kernels/row_state.cpp)."""
    batch, _, _, n_rows, _ = grouped_query.shape
    rest_m, rest_total, rest_weighted, rest_count, rest_top, seen, mean, spread, output, *points = state
    sink_key = seq_start.view(batch, 1).expand(batch, n_rows)[..., None]  # (batch, rows, 1)
    sink = sink_key[:, None, :, 0]  # (batch, 1, rows)
    logit = functools.partial(_point_logits, grouped_query, key, softcap)
    prev_key = (rows - 1).view(1, n_rows, 1).expand(batch, n_rows, 1)
    if points:
        first_logit, prev_logit, rest_band, rest_band_seen = points
    else:  # the first key's and the previous key's logits, (batch, heads, rows) each, from one pick of their keys
        first_and_prev = logit(torch.cat([sink_key, prev_key], dim=-1))
        first_logit, prev_logit = first_and_prev[..., 0], first_and_prev[..., 1]
    n_visible = visibility.counts(rows)
    first_visible = visibility.points(rows, sink_key).squeeze(-1)  # (batch, 1, rows)
    # A row that sees no key but the first has no state off the sink (its fold held only hidden keys).
    rest_seen = (n_visible - first_visible.long()) > 0
    rest_m = torch.where(rest_seen, rest_m, -math.inf)
    first_logit = torch.where(first_visible, first_logit, -math.inf)
    # A row that sees no key at all (padding) reads off as 0s, never NaN: the next layer reads its output.
    m = torch.maximum(rest_m, first_logit)
    m = torch.where(torch.isfinite(m), m, 0.0)
    rest_scale = torch.where(rest_seen, torch.exp(rest_m - m), 0.0)
    first_weight = torch.exp(first_logit - m)  # 0 when the first key is hidden
    rest_total = torch.where(rest_seen, rest_total, 0.0)
    total = rest_total * rest_scale + first_weight
    total = torch.where(total > 0, total, 1.0)
    rest_shift = torch.where(rest_seen, rest_m - m, 0.0)
    weighted = rest_scale * (torch.where(rest_seen, rest_weighted, 0.0) + rest_shift * rest_total)
    weighted = weighted + torch.where(first_visible, first_weight * (first_logit - m), 0.0)
    first_holds = first_logit == m
    count = torch.where(rest_m == m, rest_count, 0) + first_holds.long()
    top = torch.where(first_logit > rest_m, sink, rest_top)
    # The logits' spread over every visible key: the fold's, and the first key's as one more sample.
    with_first = seen + first_visible.long()
    delta = first_logit - mean
    share = first_visible / with_first.clamp(min=1)
    spread = spread + torch.where(first_visible, delta.square() * seen * share, 0.0)
    if output is not None:  # the first key's value, weighed in here
        groups = grouped_query.shape[2]
        first = seq_start.view(batch, 1, 1, 1).expand(batch, value.shape[1], 1, value.shape[-1])
        first_value = value.gather(2, first).float().repeat_interleave(groups, dim=1)  # (batch, heads, 1, head_dim)
        # In place: the fold's sums are this block's alone, and four (rows x head_dim) temporaries a layer were most
        # of what a long text's read-off allocated.
        output = output.mul_(rest_scale[..., None]).addcmul_(first_weight[..., None], first_value)
        output = output.div_(total[..., None])
    if points:  # the band off the sink, rescaled to m, and the first key where it lies in the band
        first_in_band = first_visible & (sink >= rows - window) & (sink <= rows)
        diagonal = (rest_band * rest_scale + torch.where(first_in_band, first_weight, 0.0)) / total
        band_visible = rest_band_seen + first_in_band.long()
    else:
        point = functools.partial(_point_probability, logit, m, total)
        diagonal, band_visible = _band(point, visibility, rows, window, batch)
    values = RowValues(
        entropy=torch.log(total) - weighted / total,
        max_weight=1.0 / total,
        top_key=top,
        top_tied=count > 1,
        diagonal=diagonal,
        sink=(first_weight / total) * first_visible,
        prev_token=(_probability(prev_logit[..., None], m, total) * visibility.points(rows, prev_key)).squeeze(-1),
        n_visible=n_visible,
        band_visible=band_visible,
        first_visible=first_visible,
        rest_mass=rest_total * rest_scale / total,
        # rows with no key but the first: no mass off the sink, and 0s (not whatever their empty fold held)
        rest_entropy=torch.where(rest_seen, torch.log(rest_total) - rest_weighted / rest_total, 0.0),
        rest_top_key=torch.where(rest_seen, rest_top, 0),
        rest_top_tied=rest_seen & (rest_count > 1),
        logit_std=torch.sqrt(spread / with_first.clamp(min=1)),
        rest_max_weight=torch.where(rest_seen, rest_scale / total, 0.0),
    )
    return output, values


def _point_logits(grouped_query, key, softcap, key_positions: torch.Tensor) -> torch.Tensor:
    """The logit of key `key_positions[b, r, j]` of each row r: (batch, heads, rows, j).

    Positions outside 0..t-1 are clamped (the caller zeroes them by their visibility). The keys are picked by one
    index_select on the flattened keys and multiplied as (groups x head_dim) by (head_dim x j) matrices: a third
    of the time of a gather and a broadcast dot product, which built (rows x j x head_dim) products per head.
    """
    batch, kv_heads, groups, n_rows, head_dim = grouped_query.shape
    points = key_positions.shape[-1]
    t = key.shape[2]
    # Laid out (batch, rows, kv_heads, ...): the model's queries are (batch, t, heads, head_dim) in memory (a
    # transposed view), so the rows' (groups x head_dim) matrices are one batch of them with no copy.
    rows_first = grouped_query.permute(0, 3, 1, 2, 4)  # (batch, rows, kv_heads, groups, head_dim)
    first_of_head = torch.arange(0, batch * kv_heads * t, t, device=key.device).view(batch, 1, kv_heads, 1)
    index = first_of_head + key_positions.clamp(0, t - 1)[:, :, None, :]  # (batch, rows, kv_heads, j) flat rows
    picked = key.reshape(-1, head_dim).index_select(0, index.reshape(-1)).view(batch, n_rows, kv_heads, points, -1)
    scores = torch.matmul(rows_first, picked.transpose(-1, -2)).float()  # (batch, rows, kv_heads, groups, j)
    return softcapped(scores, softcap).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads * groups, n_rows, points)


def _point_probability(logit, m, total, key_positions: torch.Tensor) -> torch.Tensor:
    """e^(s - m) / A for key `key_positions[b, r, j]` of each row r: (batch, heads, rows, j)."""
    return _probability(logit(key_positions), m, total)


def _probability(logits: torch.Tensor, m: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """e^(s - m) / A of (batch, heads, rows, j) logits s of single keys, m and A (batch, heads, rows) each."""
    return torch.exp(logits - m[..., None]) / total[..., None]


def _band(point, visibility: TileVisibility, rows: torch.Tensor, window: int, batch: int):
    """Mass within +-window of the diagonal, and how many keys there each row may see.

    Causal rows see no key after themselves, so the offsets are -window..0 (fewer near the sentence start).
    """
    offsets = torch.arange(-min(window, int(rows[-1])), 1, device=rows.device)
    mass, seen = 0.0, 0
    for chunk in offsets.split(BAND_CHUNK):
        key_positions = (rows[:, None] + chunk[None, :]).expand(batch, -1, -1)  # (batch, rows, offsets)
        visible = visibility.points(rows, key_positions)  # (batch, 1, rows, offsets)
        mass = mass + (point(key_positions) * visible).sum(-1)
        seen = seen + visible.sum(-1)
    return mass, seen
