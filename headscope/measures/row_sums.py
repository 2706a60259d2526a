"""Every attention row reduced to per-(sentence, head) sums: pure functions on tensors (the measure that rides on
the capture is headscope.measures.statistics.AttentionStatistics). A layer's attention probabilities ``attn``
have shape (batch, heads, q, k); ``head_row_sums`` reduces them to per-(sentence, head) *sums* over the valid
query rows, one slot per entry of ``headscope.columns.STATS``; headscope.estimates turns them into means at the end.

Definitions (row t of one head, A[t, s] the probability it gives key s):
    entropy          -sum_s A[t,s] ln A[t,s]                  (nats, 0 ln 0 = 0)
    norm_entropy     entropy / ln(keys row t can see)          rows seeing >= 2 keys
    diagonal         sum_{|t-s| <= window} A[t,s]
    diagonal_uniform what `diagonal` would be if the row spread its mass
                     uniformly over the keys it can see
    sink             A[t, first position of the sentence]
    prev_token       A[t, t-1]                                 rows t >= 1
    max_weight       max_s A[t,s]
    sink_rate        share of rows t >= 4 with A[t, first position] > sink_threshold (0.3)
    top_offset       over rows t >= 4: where most rows put their largest weight: "first" (the first
                     position), an offset k = t - argmax_s A[t,s] in 0..8, or "other" (further back, or
                     a largest weight shared by several keys); top_offset_share is the share of rows it holds
    logit_std        sqrt(mean_s (l[t,s] - mean_s l[t,s])^2) over the keys row t sees, l the pre-softmax scores
                     (from ln A on the eager path: the same up to one number per row)    rows seeing >= 2 keys
  Off the sink: R = sum_{s != f} A[t,s] (f the first position), A'[t,s] = A[t,s] / R for s != f; rows with R > 0
    active_rows      share of rows with A[t, f] <= sink_threshold
    offsink_prev_token   A'[t, t-1]                                      rows t >= 2
    offsink_norm_entropy -sum A' ln A' / ln(keys row t sees but f)        rows seeing >= 2 such keys
    offsink_top_offset   top_offset of A' (an offset 0..8, or other)     rows t >= 4
Positions are counted from the sentence's first real token, so left and right
padding give the same numbers. Rows holding NaN or inf (float16 overflow, say) are
counted in ``nonfinite_rows`` and left out of every metric; rows whose mass is not 1
within ``mass_tolerance`` are counted in ``unnormalised_rows`` (models with attention
sinks legitimately sum to less than 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from headscope.columns import EVIDENCE_FROM, MAX_OFFSET, OFFSET_CATEGORIES, OFFSINK_CATEGORIES, RATIOS, STATS
from headscope.config import SINK_THRESHOLD
from headscope.measures.rows import first_key, first_visible, masked_std, without_first
from headscope.model.attention.finish_rows import RowValues
from headscope.model.masks import count_visible

# What `_sum_rows` (and the C++ kernel's row_sums, in the same order) sums per (sentence, head), side by side: each
# value over the rows its denominator counts, the counts, then the rows holding their largest weight in each place
# (OFFSET_CATEGORIES, then rows that are not evidence), and the same off the sink.
VALUE_NAMES = (
    *("entropy", "norm_entropy", "diagonal", "diagonal_uniform", "sink", "prev_token", "max_weight", "sink_hits"),
    *("entropy_sq", "logit_std", "active_hits", "offsink_prev_token", "offsink_norm_entropy"),
)
COUNT_NAMES = (
    *("n_rows", "norm_rows", "prev_rows", "evidence_rows", "nonfinite_rows", "unnormalised_rows", "offsink_rows"),
    *("offsink_norm_rows", "offsink_prev_rows", "offsink_evidence_rows"),
)
SIDE_BY_SIDE = (
    *VALUE_NAMES,
    *COUNT_NAMES,
    *(f"top_{name}" for name in OFFSET_CATEGORIES),
    "top_not_kept",
    *(f"offsink_top_{name}" for name in OFFSINK_CATEGORIES),
    "offsink_top_not_kept",
)


def diagonal_rows(x: torch.Tensor, offset: int) -> torch.Tensor:
    """x[..., r, r + offset] for every row r (0 where that key is outside x). x: (..., rows, keys) -> (..., rows)."""
    rows, keys = x.shape[-2:]
    out = x.new_zeros(x.shape[:-1])
    if -rows < offset < keys:
        diag = x.diagonal(offset=offset, dim1=-2, dim2=-1)
        first = max(0, -offset)
        out[..., first : first + diag.shape[-1]] = diag
    return out


def band_row_sums(x: torch.Tensor, window: int, row_offset: int = 0) -> torch.Tensor:
    """Sum of x[..., r, s] over keys s with |(row_offset + r) - s| <= window, for every row r.

    x: (..., rows, keys), rows being query positions row_offset, row_offset + 1, ... Returns (..., rows).
    Reads only the diagonals that the band and the block share (at most rows + keys - 1 of them, however
    wide the window), so it never builds a band mask and a huge window costs no more than the block.
    """
    rows, keys = x.shape[-2:]
    # Offsets (key - query) present in this block run from -(row_offset + rows - 1) to keys - 1 - row_offset.
    lowest = max(-window, -(row_offset + rows - 1))
    highest = min(window, keys - 1 - row_offset)
    out = x.new_zeros(x.shape[:-1])
    for k in range(lowest, highest + 1):
        out += diagonal_rows(x, row_offset + k)
    return out


def head_row_sums(
    attn: torch.Tensor,
    *,
    key_visible: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    window: int,
    row_offset: int = 0,
    accum_dtype: torch.dtype = torch.float64,
    mass_tolerance: float = 1e-3,
    sink_threshold: float = SINK_THRESHOLD,
    first_at_zero: bool | None = None,
) -> torch.Tensor:
    """Per-(sentence, head) sums of every row statistic in ``STATS``, over a block of query rows.

    attn:        (batch, heads, rows, keys) attention probabilities of query positions
                 row_offset .. row_offset + rows - 1, any float dtype (read, never modified)
    key_visible: (batch, 1 or heads, rows, keys) bool, keys each row may see
    query_valid: (batch, rows) bool, True on real (non-padding) tokens
    seq_start:   (batch,) long, index of each sentence's first real token (0 with right padding)
    window:      half-width of the diagonal band
    sink_threshold: a row counts towards `sink_rate` when its mass on the first token exceeds this
    first_at_zero: every sentence starts at position 0 (right padding: the keys off the sink are a view, not a
                 copy); None: find out (one look at seq_start)
    Returns (batch, heads, len(STATS)) in ``accum_dtype``, on attn's device. Sums over disjoint row
    blocks add up to the sums over all rows.
    """
    geometry = {"seq_start": seq_start, "row_offset": row_offset}
    values = weight_row_values(attn, key_visible=key_visible, window=window, first_at_zero=first_at_zero, **geometry)
    return head_row_sums_from_values(
        values, query_valid=query_valid, accum_dtype=accum_dtype, mass_tolerance=mass_tolerance,
        sink_threshold=sink_threshold, **geometry,
    )  # fmt: skip


def weight_row_values(
    attn: torch.Tensor,
    *,
    key_visible: torch.Tensor,
    seq_start: torch.Tensor,
    window: int,
    row_offset: int = 0,
    first_at_zero: bool | None = None,
) -> RowValues:
    """Every row's values of a block of attention probabilities (arguments as `head_row_sums`'s), for
    `head_row_sums_from_values`; headscope's C++ kernel computes the same (attention.cpu_kernel.weight_rows).

    Every statistic over all keys is put together from the same statistic over the keys off the sink (every key
    but the sentence's first) and the first key's weight, so the off-sink statistics cost no extra pass and the
    off-sink mass is summed, never taken as 1 - sink (which loses every digit when the sink holds nearly all).
    """
    probs = attn.float()  # reductions in float32 at least, whatever the model dtype
    first = first_key(seq_start, probs.shape)
    on_first = probs.gather(-1, first).squeeze(-1)
    # One logarithm per weight, for the entropy and the logits' spread; a weight below the dtype's smallest normal
    # number (0 when it underflowed, and every hidden key) counts as that number (its entropy term stays 0).
    logs = torch.log(probs.clamp(min=torch.finfo(attn.dtype).tiny))
    rest, index_shift = without_first(probs, seq_start, first_at_zero)
    rest_logs, _ = without_first(logs, seq_start, first_at_zero)
    rest_largest = rest.amax(-1)
    rest_top = rest.argmax(-1) + index_shift
    rest_holding = (rest == rest_largest[..., None]).sum(-1)
    # Summed in float64: a row nearly all on the sink leaves a small mass whose digits the renormalising divides up,
    # and float32 sums of it would depend on where padding puts the zeros.
    rest_mass = rest.sum(-1, dtype=torch.float64)
    rest_entropy = -(rest * rest_logs).sum(-1, dtype=torch.float64)
    largest = torch.maximum(rest_largest, on_first)
    n_visible, band_visible = _visible_counts(key_visible, window, row_offset)
    return RowValues(
        entropy=(rest_entropy + torch.special.entr(on_first)).float(),
        max_weight=largest,
        top_key=torch.where(on_first > rest_largest, first[..., 0], rest_top),
        # no single key holds the largest weight
        top_tied=(on_first == largest).long() + torch.where(rest_largest == largest, rest_holding, 0) > 1,
        **_positional_mass(probs, seq_start, window, row_offset),
        n_visible=n_visible,
        band_visible=band_visible,
        first_visible=first_visible(key_visible, first),
        rest_mass=rest_mass,
        rest_entropy=rest_entropy / rest_mass + torch.log(rest_mass),
        rest_top_key=rest_top,
        rest_top_tied=rest_holding > 1,
        logit_std=masked_std(logs, key_visible),  # ln A = logit - ln(sum e^logit): the same spread
        mass=(rest_mass + on_first).float(),
    )


def head_row_sums_from_logits(
    logits: torch.Tensor,
    *,
    key_visible: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    window: int,
    row_offset: int = 0,
    accum_dtype: torch.dtype = torch.float64,
    sink_threshold: float = SINK_THRESHOLD,
    first_at_zero: bool | None = None,
) -> torch.Tensor:
    """``head_row_sums(softmax(logits))``, with fewer passes over the (rows, keys) block.

    logits: (batch, heads, rows, keys) pre-softmax scores with the additive mask applied (hidden keys
    at the dtype's minimum). With z = logits - max and S = sum exp(z):
        entropy = ln S - sum_s p_s z_s    (both terms >= 0: no cancellation)
        max_weight = 1 / S
    so the probabilities are never normalised in full and no logarithm is taken per key. The sums run over the
    keys off the sink, the first key's term added after (as in `head_row_sums`).
    """
    scores = logits.float()
    shifted = scores - scores.amax(-1, keepdim=True)  # (batch, heads, rows, keys), <= 0
    unnormalised = torch.exp(shifted)  # largest entry of each row is exactly 1
    total = unnormalised.sum(-1)  # (batch, heads, rows), >= 1
    first = first_key(seq_start, scores.shape)
    # Off the sink: the first key's weight 0 and its logit the lowest (the sums and the top key skip it).
    rest, index_shift = without_first(unnormalised, seq_start, first_at_zero)
    rest_shifted, _ = without_first(shifted, seq_start, first_at_zero, fill=torch.finfo(torch.float32).min)
    rest_total = rest.sum(-1)
    rest_largest = rest_shifted.amax(-1)
    per_row = {
        "entropy": torch.log(total) - torch.linalg.vecdot(unnormalised, shifted) / total,
        "max_weight": 1.0 / total,
        "mass": torch.ones_like(total),  # normalised by construction; overflow shows up as a non-finite total
        "top_key": shifted.argmax(-1),
        "top_tied": (shifted == 0).sum(-1) > 1,  # the largest logit is shifted to exactly 0
        "rest_mass": rest_total / total,
        "rest_entropy": torch.log(rest_total) - torch.linalg.vecdot(rest, rest_shifted) / rest_total,
        "rest_top_key": rest_shifted.argmax(-1) + index_shift,
        "rest_top_tied": (rest_shifted == rest_largest[..., None]).sum(-1) > 1,
        "logit_std": masked_std(shifted, key_visible),
        **{name: mass / total for name, mass in _positional_mass(unnormalised, seq_start, window, row_offset).items()},
    }
    n_visible, band_visible = _visible_counts(key_visible, window, row_offset)
    return in_stats_order(
        side_by_side_sums(
            per_row,
            n_visible,
            band_visible,
            first_visible(key_visible, first),
            query_valid,
            seq_start,
            row_offset,
            accum_dtype,
            1.0,
            sink_threshold,
        )
    )


def head_row_sums_from_values(
    values: RowValues,
    *,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    row_offset: int = 0,
    accum_dtype: torch.dtype = torch.float64,
    mass_tolerance: float = 1.0,
    sink_threshold: float = SINK_THRESHOLD,
    kernel: Callable | None = None,
) -> torch.Tensor:
    """``head_row_sums`` of a block of rows (query positions row_offset, row_offset + 1, ...) from their per-row
    values: the fused pass's (headscope.model.attention.tile_loop; every row of a layer), or those of probabilities
    (`weight_row_values`, or headscope's C++ kernel): (batch, heads, len(STATS)). query_valid: (batch, rows) bool.
    mass_tolerance: rows whose `mass` is off 1 by more count as unnormalised (values without a mass have none).
    kernel: headscope's C++ kernel summing the rows in one pass (attention.dispatch.TileKernel.sums), used for
    float64 sums; None: torch's operations."""
    per_row = {
        "entropy": values.entropy,
        "max_weight": values.max_weight,
        # the fused pass's rows are normalised by construction, as on the logits path
        "mass": torch.ones_like(values.entropy) if values.mass is None else values.mass,
        "top_key": values.top_key,
        "top_tied": values.top_tied,
        "diagonal": values.diagonal,
        "sink": values.sink,
        "prev_token": values.prev_token,
        "rest_mass": values.rest_mass,
        "rest_entropy": values.rest_entropy,
        "rest_top_key": values.rest_top_key,
        "rest_top_tied": values.rest_top_tied,
        "logit_std": values.logit_std,
    }
    rows = {"n_visible": values.n_visible, "band_visible": values.band_visible, "first_visible": values.first_visible}
    geometry = {"query_valid": query_valid, "seq_start": seq_start, "row_offset": row_offset}
    thresholds = {"mass_tolerance": mass_tolerance, "sink_threshold": sink_threshold}

    def by_torch() -> torch.Tensor:
        return side_by_side_sums(per_row, **rows, **geometry, accum_dtype=accum_dtype, **thresholds)

    if kernel is None or accum_dtype != torch.float64:
        return in_stats_order(by_torch())
    layout = {"value_rows": value_rows(), "max_offset": MAX_OFFSET, "evidence_from": EVIDENCE_FROM}
    sums = kernel(values, query_valid, seq_start, row_offset, reference=by_torch, **thresholds, **layout)
    return in_stats_order(sums)


def _visible_counts(key_visible: torch.Tensor, window: int, row_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys each row may see, of them within the +-window band): (batch or 1, 1 or heads, rows) each."""
    return count_visible(key_visible), band_row_sums(key_visible.float(), window, row_offset)


def _positional_mass(
    weights: torch.Tensor, seq_start: torch.Tensor, window: int, row_offset: int
) -> dict[str, torch.Tensor]:
    """Per-row diagonal, sink and prev_token mass of (batch, heads, rows, keys) weights."""
    return {
        "diagonal": band_row_sums(weights, window, row_offset),
        "sink": weights.gather(-1, first_key(seq_start, weights.shape)).squeeze(-1),
        "prev_token": diagonal_rows(weights, row_offset - 1),
    }


def side_by_side_sums(
    per_row: dict[str, torch.Tensor],
    n_visible: torch.Tensor,
    band_visible: torch.Tensor,
    first_visible: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    row_offset: int,
    accum_dtype: torch.dtype,
    mass_tolerance: float,
    sink_threshold: float,
) -> torch.Tensor:
    """Sum per-row values over the valid rows of each (sentence, head): (batch, heads, len(SIDE_BY_SIDE)), in the
    order of SIDE_BY_SIDE (`in_stats_order` puts them in the order of STATS)."""
    entropy = per_row["entropy"]
    batch, heads, rows = entropy.shape
    mass = per_row["mass"]
    finite = torch.isfinite(entropy) & torch.isfinite(per_row["max_weight"]) & torch.isfinite(mass)
    # n_visible, band_visible: (batch or 1, 1 or heads, rows), keys each row may see, and of them within the band.
    # ln(1) = 0 for rows seeing one key: they are left out of norm_entropy, so clamp to avoid 0/0.
    norm_entropy = entropy / torch.log(n_visible.clamp(min=2).float())
    diagonal_uniform = band_visible / n_visible.clamp(min=1)

    # Row masks, (batch, 1, rows): padding rows count nowhere.
    position = torch.arange(row_offset, row_offset + rows, device=entropy.device)[None, :] - seq_start[:, None]
    real = query_valid[:, None, :]
    nonfinite = real & ~finite  # (batch, heads, rows)
    valid = real & finite
    unnormalised = valid & ((mass - 1.0).abs() > mass_tolerance)
    evidence = valid & (position >= EVIDENCE_FROM)[:, None, :]
    # Where each row's largest weight sits (columns.OFFSET_CATEGORIES): on the sentence's first token, this many
    # positions back (0..MAX_OFFSET), or "other" (further, or a largest weight shared by several keys: uniform
    # attention has no such place). Rows before EVIDENCE_FROM go to an extra category that is not kept.
    offset = torch.arange(row_offset, row_offset + rows, device=entropy.device) - per_row["top_key"]
    on_first = per_row["top_key"] == seq_start[:, None, None]  # (batch, heads, rows)
    other = per_row["top_tied"] | (offset < 0) | (offset > MAX_OFFSET)
    category = torch.where(other, MAX_OFFSET + 2, offset + 1).masked_fill(on_first & ~per_row["top_tied"], 0)
    category = category.masked_fill(~evidence, MAX_OFFSET + 3)
    top = _category_counts(category, MAX_OFFSET + 4, accum_dtype)

    # Off the sink: rows that see some key besides the sentence's first (whose off-sink mass did not underflow to
    # 0), where the off-sink top key sits (it cannot be the first token), and how many keys they see besides it.
    rest_mass = per_row["rest_mass"]
    offsink = valid & (rest_mass > 0)
    rest_visible = n_visible - first_visible.long()
    offsink_norm_entropy = per_row["rest_entropy"] / torch.log(rest_visible.clamp(min=2).float())
    rest_offset = torch.arange(row_offset, row_offset + rows, device=entropy.device) - per_row["rest_top_key"]
    rest_other = per_row["rest_top_tied"] | (rest_offset < 0) | (rest_offset > MAX_OFFSET)
    offsink_evidence = evidence & offsink
    rest_category = torch.where(rest_other, MAX_OFFSET + 1, rest_offset).masked_fill(~offsink_evidence, MAX_OFFSET + 2)
    rest_top = _category_counts(rest_category, MAX_OFFSET + 3, accum_dtype)

    # The rows each row count counts; a ratio's numerator is summed over its denominator's rows (columns.RATIOS).
    counted = {
        "n_rows": valid,
        "norm_rows": valid & (n_visible >= 2),
        "prev_rows": valid & (position >= 1)[:, None, :],
        "evidence_rows": evidence,
        "nonfinite_rows": nonfinite,
        "unnormalised_rows": unnormalised,
        "offsink_rows": offsink,
        "offsink_norm_rows": offsink & (rest_visible >= 2),
        "offsink_prev_rows": offsink & (position >= 2)[:, None, :],
        "offsink_evidence_rows": offsink_evidence,
    }
    row_values = {  # the numerators of columns.RATIOS, and the squares for the spread, per row
        "entropy": entropy,
        "norm_entropy": norm_entropy,
        "diagonal": per_row["diagonal"],
        "diagonal_uniform": diagonal_uniform,
        "sink": per_row["sink"],
        "prev_token": per_row["prev_token"],
        "max_weight": per_row["max_weight"],
        "sink_hits": (per_row["sink"] > sink_threshold).to(entropy.dtype),
        "entropy_sq": entropy.square(),
        "logit_std": per_row["logit_std"],
        "active_hits": (per_row["sink"] <= sink_threshold).to(entropy.dtype),
        "offsink_prev_token": per_row["prev_token"] / rest_mass,
        "offsink_norm_entropy": offsink_norm_entropy,
    }
    # Every value column in one pass: (batch, heads, values, rows), summed over the rows. `where`, not multiply:
    # padding rows may hold anything, NaN included, and must add exactly 0.
    shape = (batch, heads, rows)
    values = torch.stack([row_values[name].expand(shape) for name in VALUE_NAMES], dim=-2)
    masks = torch.stack([counted[COUNT_NAMES[rows_of]].expand(shape) for rows_of in value_rows()], dim=-2)
    value_sums = torch.where(masks, values, 0.0).to(accum_dtype).sum(-1)
    row_counts = torch.stack([counted[name].expand(shape) for name in COUNT_NAMES], dim=-2).sum(-1)
    return torch.cat([value_sums, row_counts.to(accum_dtype), top, rest_top], dim=-1)


def in_stats_order(side_by_side: torch.Tensor) -> torch.Tensor:
    """(batch, heads, len(SIDE_BY_SIDE)) sums -> (batch, heads, len(STATS)): one gather, not an operation per slot
    (on short sentences each costs more than its arithmetic); the slots of what heads write stay 0."""
    zero = side_by_side.new_zeros(*side_by_side.shape[:-1], 1)
    order = _stats_order(str(side_by_side.device))
    return torch.cat([side_by_side, zero], dim=-1).index_select(-1, order)


@functools.cache
def value_rows() -> tuple[int, ...]:
    """For each of VALUE_NAMES, the place in COUNT_NAMES of the rows it is summed over (its denominator)."""
    denominator = {numerator: rows_of for numerator, rows_of in RATIOS.values()} | {"entropy_sq": "n_rows"}
    return tuple(COUNT_NAMES.index(denominator[name]) for name in VALUE_NAMES)


@functools.cache
def _stats_order(device: str) -> torch.Tensor:
    """Where each slot of STATS is among SIDE_BY_SIDE (the last column, a 0, for a slot not among them)."""
    where = {name: i for i, name in enumerate(SIDE_BY_SIDE)}
    return torch.tensor([where.get(name, len(SIDE_BY_SIDE)) for name in STATS], device=device)


def _category_counts(category: torch.Tensor, categories: int, accum_dtype: torch.dtype) -> torch.Tensor:
    """(batch, heads, rows) category numbers -> (batch, heads, categories) how many rows hold each."""
    batch, heads, _ = category.shape
    counts = torch.zeros(batch, heads, categories, dtype=accum_dtype, device=category.device)
    return counts.scatter_add_(-1, category, torch.ones_like(category, dtype=accum_dtype))
