"""The corpus statistics measure: every attention row reduced to per-(sentence, head) sums.

`AttentionStatistics` rides on the capture (see headscope.model.capture.Measure); the maths below it are pure
functions on tensors. A layer's attention probabilities ``attn`` have shape (batch, heads, q, k).
``head_row_sums`` reduces them to per-(sentence, head) *sums* over the valid query rows, one slot per entry
of ``headscope.columns.STATS``; headscope.estimates turns them into means at the end.

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
Positions are counted from the sentence's first real token, so left and right
padding give the same numbers. Rows holding NaN or inf (float16 overflow, say) are
counted in ``nonfinite_rows`` and left out of every metric; rows whose mass is not 1
within ``mass_tolerance`` are counted in ``unnormalised_rows`` (models with attention
sinks legitimately sum to less than 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headscope.columns import EVIDENCE_FROM, MAX_OFFSET, OFFSET_CATEGORIES, RATIOS, STATS
from headscope.config import SINK_THRESHOLD
from headscope.errors import ModelLoadError
from headscope.model.fused import RowValues
from headscope.model.masks import count_visible
from headscope.run.feed import Batch


class AttentionStatistics:
    """Per-(sentence, head) sums of every row statistic in ``STATS``, for the layers asked for.

    A Measure: after each batch, `finish` returns (wanted layers, batch, heads, stats) sums, left on the device
    of the batch (nothing synchronises per layer or per batch; the caller moves many batches' sums at once).
    """

    def __init__(
        self, *, window: int, sink_threshold: float, accum_dtype: torch.dtype, layers: Sequence[int] | None = None
    ) -> None:
        self.window = window
        self.sink_threshold = sink_threshold
        self.accum_dtype = accum_dtype
        self.layers = sorted(set(layers)) if layers is not None else None
        self._batch: Batch | None = None
        self._sums: dict[int, torch.Tensor] = {}  # layer -> (batch, heads, stats), summed over its blocks

    @classmethod
    def from_plan(cls, plan) -> AttentionStatistics:
        """The statistics a run's plan asks for: its window, sink threshold, accumulation dtype and layers."""
        settings = plan.settings
        return cls(
            window=settings.window,
            sink_threshold=settings.sink_threshold,
            accum_dtype=plan.accumulate,
            layers=plan.layers,
        )

    def start(self, batch: Batch) -> None:
        self._batch = batch
        self._sums = {}

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def last_layer(self) -> int | None:
        return None if self.layers is None else self.layers[-1]

    def attention(self, layer, block) -> None:
        common = {
            "key_visible": block.visible,
            "query_valid": block.query_valid,
            "seq_start": block.seq_start,
            "window": self.window,
            "row_offset": block.first_row,
            "accum_dtype": self.accum_dtype,
            "sink_threshold": self.sink_threshold,
        }
        if block.weights is not None:
            # float32 rows sum to 1 within ~1e-6; half-precision probabilities are rounded to ~3 digits.
            tolerance = 1e-3 if block.weights.dtype == torch.float32 else 2e-2
            sums = head_row_sums(block.weights, mass_tolerance=tolerance, **common)
        else:
            sums = head_row_sums_from_logits(block.logits, **common)
        self._add(layer, sums)

    def row_values(self, layer: int, values: RowValues, query_valid: torch.Tensor, seq_start: torch.Tensor) -> None:
        """A whole layer's per-row values from the fused pass (headscope.model.fused), computed with our `window`."""
        sums = head_row_sums_from_values(
            values,
            query_valid=query_valid,
            seq_start=seq_start,
            accum_dtype=self.accum_dtype,
            sink_threshold=self.sink_threshold,
        )
        self._add(layer, sums)

    def _add(self, layer: int, sums: torch.Tensor) -> None:
        self._sums[layer] = sums if layer not in self._sums else self._sums[layer] + sums

    def finish(self) -> torch.Tensor:
        """The batch's sums, (wanted layers, batch, heads, stats), in layer order, on the batch's device (with a
        device map, each layer's small sums move there from the device its attention ran on)."""
        if not self._sums:
            raise ModelLoadError(
                "the model never called an attention function headscope can read (no attention layers?)"
            )
        device = self._batch.input_ids.device
        # Asynchronous only towards an accelerator: a non-blocking copy into host memory may not be done yet.
        asynchronous = device.type != "cpu"
        sums = torch.stack([self._sums[layer].to(device, non_blocking=asynchronous) for layer in sorted(self._sums)])
        self._sums = {}
        return sums


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
) -> torch.Tensor:
    """Per-(sentence, head) sums of every row statistic in ``STATS``, over a block of query rows.

    attn:        (batch, heads, rows, keys) attention probabilities of query positions
                 row_offset .. row_offset + rows - 1, any float dtype (read, never modified)
    key_visible: (batch, 1 or heads, rows, keys) bool, keys each row may see
    query_valid: (batch, rows) bool, True on real (non-padding) tokens
    seq_start:   (batch,) long, index of each sentence's first real token (0 with right padding)
    window:      half-width of the diagonal band
    sink_threshold: a row counts towards `sink_rate` when its mass on the first token exceeds this
    Returns (batch, heads, len(STATS)) in ``accum_dtype``, on attn's device. Sums over disjoint row
    blocks add up to the sums over all rows.
    """
    probs = attn.float()  # reductions in float32 at least, whatever the model dtype
    largest = probs.amax(-1)
    per_row = {
        "entropy": torch.special.entr(probs).sum(-1),
        "max_weight": largest,
        "mass": probs.sum(-1),
        "top_key": probs.argmax(-1),
        "top_tied": (probs == largest[..., None]).sum(-1) > 1,  # no single key holds the largest weight
        **_positional_mass(probs, seq_start, window, row_offset),
    }
    return _sum_rows(
        per_row,
        *_visible_counts(key_visible, window, row_offset),
        query_valid,
        seq_start,
        row_offset,
        accum_dtype,
        mass_tolerance,
        sink_threshold,
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
) -> torch.Tensor:
    """``head_row_sums(softmax(logits))``, with fewer passes over the (rows, keys) block.

    logits: (batch, heads, rows, keys) pre-softmax scores with the additive mask applied (hidden keys
    at the dtype's minimum). With z = logits - max and S = sum exp(z):
        entropy = ln S - sum_s p_s z_s    (both terms >= 0: no cancellation)
        max_weight = 1 / S
    so the probabilities are never normalised in full and no logarithm is taken per key.
    """
    scores = logits.float()
    shifted = scores - scores.amax(-1, keepdim=True)  # (batch, heads, rows, keys), <= 0
    unnormalised = torch.exp(shifted)  # largest entry of each row is exactly 1
    total = unnormalised.sum(-1)  # (batch, heads, rows), >= 1
    per_row = {
        "entropy": torch.log(total) - torch.linalg.vecdot(unnormalised, shifted) / total,
        "max_weight": 1.0 / total,
        "mass": torch.ones_like(total),  # normalised by construction; overflow shows up as a non-finite total
        "top_key": shifted.argmax(-1),
        "top_tied": (shifted == 0).sum(-1) > 1,  # the largest logit is shifted to exactly 0
        **{name: mass / total for name, mass in _positional_mass(unnormalised, seq_start, window, row_offset).items()},
    }
    n_visible, band_visible = _visible_counts(key_visible, window, row_offset)
    return _sum_rows(
        per_row, n_visible, band_visible, query_valid, seq_start, row_offset, accum_dtype, 1.0, sink_threshold
    )


def head_row_sums_from_values(
    values: RowValues,
    *,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    accum_dtype: torch.dtype = torch.float64,
    sink_threshold: float = SINK_THRESHOLD,
) -> torch.Tensor:
    """``head_row_sums`` of every row of a layer, from the per-row values the fused pass computed
    (headscope.model.fused): (batch, heads, len(STATS)). query_valid: (batch, t) bool."""
    per_row = {
        "entropy": values.entropy,
        "max_weight": values.max_weight,
        "mass": torch.ones_like(values.entropy),  # normalised by construction, as on the logits path
        "top_key": values.top_key,
        "top_tied": values.top_tied,
        "diagonal": values.diagonal,
        "sink": values.sink,
        "prev_token": values.prev_token,
    }
    return _sum_rows(
        per_row,
        values.n_visible,
        values.band_visible,
        query_valid,
        seq_start,
        0,
        accum_dtype,
        1.0,
        sink_threshold,
    )


def _visible_counts(key_visible: torch.Tensor, window: int, row_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys each row may see, of them within the +-window band): (batch or 1, 1 or heads, rows) each."""
    return count_visible(key_visible), band_row_sums(key_visible.float(), window, row_offset)


def _positional_mass(
    weights: torch.Tensor, seq_start: torch.Tensor, window: int, row_offset: int
) -> dict[str, torch.Tensor]:
    """Per-row diagonal, sink and prev_token mass of (batch, heads, rows, keys) weights."""
    batch, heads, rows, keys = weights.shape
    # A block of padding rows before a left-padded sentence may end before its first key: clamp (ignored rows).
    first_key = seq_start.clamp(max=keys - 1).view(batch, 1, 1, 1).expand(batch, heads, rows, 1)
    return {
        "diagonal": band_row_sums(weights, window, row_offset),
        "sink": weights.gather(-1, first_key).squeeze(-1),
        "prev_token": diagonal_rows(weights, row_offset - 1),
    }


def _sum_rows(
    per_row: dict[str, torch.Tensor],
    n_visible: torch.Tensor,
    band_visible: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    row_offset: int,
    accum_dtype: torch.dtype,
    mass_tolerance: float,
    sink_threshold: float,
) -> torch.Tensor:
    """Sum per-row values over the valid rows of each (sentence, head): (batch, heads, len(STATS))."""
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
    top = torch.zeros(batch, heads, MAX_OFFSET + 4, dtype=accum_dtype, device=entropy.device)
    top.scatter_add_(-1, category, torch.ones_like(category, dtype=accum_dtype))

    # The rows each row count counts; a ratio's numerator is summed over its denominator's rows (columns.RATIOS).
    counted = {
        "n_rows": valid,
        "norm_rows": valid & (n_visible >= 2),
        "prev_rows": valid & (position >= 1)[:, None, :],
        "evidence_rows": evidence,
        "nonfinite_rows": nonfinite,
        "unnormalised_rows": unnormalised,
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
    }
    denominator = {numerator: rows_of for numerator, rows_of in RATIOS.values()} | {"entropy_sq": "n_rows"}
    # Every value column in one pass: (batch, heads, values, rows), summed over the rows. `where`, not multiply:
    # padding rows may hold anything, NaN included, and must add exactly 0.
    shape = (batch, heads, rows)
    values = torch.stack([value.expand(shape) for value in row_values.values()], dim=-2)
    masks = torch.stack([counted[denominator[name]].expand(shape) for name in row_values], dim=-2)
    value_sums = torch.where(masks, values, 0.0).to(accum_dtype).sum(-1)
    row_counts = torch.stack([rows_of.expand(shape) for rows_of in counted.values()], dim=-2).sum(-1)
    sums = {
        **dict(zip(row_values, value_sums.unbind(-1), strict=True)),
        **dict(zip(counted, row_counts.unbind(-1), strict=True)),
        **{f"top_{name}": top[..., i] for i, name in enumerate(OFFSET_CATEGORIES)},
    }
    return torch.stack([sums[name].to(accum_dtype) for name in STATS], dim=-1)
