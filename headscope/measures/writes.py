"""What each head writes into the residual stream, and what its sink reads: per-(sentence, head) sums from a layer's
output (headscope.model.capture.LayerOutput), whatever path its attention took.

Definitions (row t of head h, z_h(t) its output before the output projection, W_h the projection's columns for it,
x(t) the residual stream entering the layer, v_s the value vector at key s of the head's KV head):
    write_norm        ||W_h z_h(t)||_2                        (no bias; before any norm after attention)
    write_ratio       ||W_h z_h(t)||_2 / ||x(t)||_2                rows with x(t) != 0
    sink_value_ratio  ||v_first|| / mean_{s the row sees} ||v_s||     rows t >= 1 that see the first token
Each is summed over the real rows of each sentence (headscope.estimates takes the means).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headscope.columns import STATS
from headscope.model.masks import count_visible

# The slots these sums fill, in this order; the attention's row sums fill every other slot of STATS.
OUTPUT_SLOTS = ("write_norm", "write_rows", "write_ratio", "ratio_rows", "sink_value_ratio", "value_rows")
OUTPUT_INDEX = [STATS.index(name) for name in OUTPUT_SLOTS]
VALUE_BLOCK_ROWS = 256  # query rows per block of the keys-each-row-sees product


def write_norms(output: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """||W_h z_h(t)|| for every row and head: output (batch, t, heads, head_dim), grams (heads, head_dim, head_dim)
    = W_h^T W_h. Returns (batch, heads, t) float32."""
    batch, t, heads, head_dim = output.shape
    z = output.float().permute(2, 0, 1, 3).reshape(heads, batch * t, head_dim)  # one product per head: bmm
    squared = (torch.bmm(z, grams.to(z.device)) * z).sum(-1)  # (heads, batch * t)
    # rounding may take a zero write a hair below 0
    return squared.clamp(min=0).sqrt().view(heads, batch, t).transpose(0, 1)


def sink_value_ratios(
    value: torch.Tensor,
    query_valid: torch.Tensor,
    seq_start: torch.Tensor,
    heads: int,
    visible_rows: Callable[[slice], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, ||v_first|| / the mean ||v_s|| over the keys the row sees, and whether the row sees the first key
    and another (the rows it is defined on).

    value: (batch, kv_heads, t, head_dim); query_valid: (batch, t) bool, the real tokens; visible_rows(rows):
    (batch or 1, 1, rows, t) bool, the keys query rows `rows` see, or None for plain causal attention (row t sees
    the real keys 0..t). Returns (batch, heads, t) float32 and (batch, 1, t) bool; query head h reads KV head
    h // (heads // kv_heads).
    """
    batch, kv_heads, t, _ = value.shape
    norms = torch.linalg.vector_norm(value.float(), dim=-1)  # (batch, kv_heads, t)
    first = seq_start.clamp(max=t - 1).view(batch, 1, 1)
    on_first = norms.gather(-1, first.expand(batch, kv_heads, 1))  # (batch, kv_heads, 1)
    if visible_rows is None:
        sums, counts, sees_first = _causal_value_sums(norms, query_valid, first)
    else:
        sums, counts, sees_first = _masked_value_sums(norms, visible_rows, first)
    mean = sums / counts.clamp(min=1)
    ratio = (on_first / mean).repeat_interleave(heads // kv_heads, dim=1)
    return ratio, sees_first & (counts >= 2)


def _causal_value_sums(
    norms: torch.Tensor, query_valid: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention: the keys row t sees are the real keys up to t, so the sums are running sums (in float64:
    8,192 float32 additions in a row would cost digits). A (rows, t) visibility block per 256 rows cost 0.3 s a
    SmolLM2 layer at 8,192 tokens; this costs one pass over t."""
    valid = query_valid[:, None, :]  # (batch, 1, t)
    sums = torch.where(valid, norms.double(), 0.0).cumsum(-1).float()
    counts = valid.cumsum(-1)
    positions = torch.arange(query_valid.shape[-1], device=query_valid.device)
    sees_first = (positions >= first) & valid.gather(-1, first)
    return sums, counts, sees_first


def _masked_value_sums(
    norms: torch.Tensor, visible_rows: Callable[[slice], torch.Tensor], first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any mask (padding our mask function builds, sliding windows): the sum over each row's visible keys as a
    product with the visibility, VALUE_BLOCK_ROWS rows at a time."""
    batch, _, t = norms.shape
    sums, counts, sees_first = [], [], []
    for start in range(0, t, VALUE_BLOCK_ROWS):
        visible = visible_rows(slice(start, min(t, start + VALUE_BLOCK_ROWS)))  # (batch or 1, 1, rows, t)
        sums.append(torch.matmul(visible.float(), norms[..., None])[..., 0])  # (batch, kv_heads, rows)
        counts.append(count_visible(visible))
        rows = visible.shape[2]
        sees_first.append(
            visible.expand(batch, -1, -1, -1).gather(-1, first[..., None].expand(batch, 1, rows, 1))[..., 0]
        )
    return torch.cat(sums, -1), torch.cat(counts, -1), torch.cat(sees_first, -1)


def head_write_sums(
    norms: torch.Tensor,
    residual_norm: torch.Tensor,
    value_ratio: torch.Tensor,
    value_defined: torch.Tensor,
    query_valid: torch.Tensor,
    accum_dtype: torch.dtype,
) -> torch.Tensor:
    """(batch, heads, len(OUTPUT_SLOTS)) sums over each sentence's real rows, in the order of OUTPUT_SLOTS.

    norms: (batch, heads, t) write norms; residual_norm: (batch, t); value_ratio, value_defined: from
    `sink_value_ratios`; query_valid: (batch, t) bool."""
    ratio = norms / residual_norm[:, None, :].float()
    real = query_valid[:, None, :]
    written = real & torch.isfinite(norms)
    # A row whose residual stream is exactly 0 (a token embedded as zeros) has no ratio: left out of write_ratio.
    compared = written & torch.isfinite(ratio)
    valued = real & value_defined & torch.isfinite(value_ratio)
    shape = norms.shape
    values = torch.stack([norms, ratio, value_ratio.expand(shape)], dim=-2)  # (batch, heads, 3, t)
    rows = torch.stack([written.expand(shape), compared.expand(shape), valued.expand(shape)], dim=-2)
    sums = torch.where(rows, values, 0.0).to(accum_dtype).sum(-1)  # write_norm, write_ratio, sink_value_ratio
    counts = rows.sum(-1).to(accum_dtype)  # write_rows, ratio_rows, value_rows
    return torch.stack([sums[..., 0], counts[..., 0], sums[..., 1], counts[..., 1], sums[..., 2], counts[..., 2]], -1)
