"""headscope's Triton kernel for the fused pass on CUDA: the C++ kernel's work (kernels/row_state.cpp) on a GPU.

One program takes 64 query rows of one head and walks the keys they may see in blocks of 64 (FlashAttention's forward
pass: one read of each key and value block per row block, the logits never leave the chip), folding each block into
the same running state the C++ kernel and the tile loop keep for every row, every key but its sentence's first:

    m  the largest logit        A  sum e^(s - m)        B  sum e^(s - m) (s - m)
    n  keys holding exactly m   top  the first of them
    seen, mean, spread  how many keys, their logits' mean and sum of squared deviations (merged block by block)
    O  sum e^(s - m) v  (when values are given)

and attention.finish_rows puts the first key back, as for the other two. Products are float32 in IEEE precision
(not TF32: the statistics are held to 1e-5), inputs float32 (fused.py reads half precision as float32).

Imported only where Triton is (torch's CUDA builds ship it); `attention.cpu_kernel.triton_module` says why not
elsewhere. Runs on the CPU too under Triton's interpreter (TRITON_INTERPRET=1), which is how CPU-only CI tests it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 64
BLOCK_KEYS = 64
# float32's lowest: the start of every row's maximum, as in the C++ kernel. A constexpr: a compiled Triton kernel reads
# no other globals (the interpreter, which CPU CI runs, does not check; Triton 3.6 on an H200 refused a plain float).
LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^(2x) + 1): exact limits (+-1) where e^(2x) overflows or vanishes; tl has no tanh of its own.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _row_state_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, first_ptr, mask_ptr,
    m_ptr, total_ptr, weighted_ptr, count_ptr, top_ptr, seen_ptr, mean_ptr, spread_ptr, out_ptr,
    heads, groups, rows, keys, dim, mask_batch, mask_rows, softcap,
    HAS_VALUE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    head_row = tl.program_id(0)  # sentence * heads + head
    sentence = head_row // heads
    kv = sentence * (heads // groups) + (head_row % heads) // groups
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < rows
    d_ok = offs_d < dim
    position = tl.load(pos_ptr + offs_m, mask=row_ok, other=-1)
    query_rows = (head_row * rows + offs_m).to(tl.int64)
    q = tl.load(q_ptr + query_rows[:, None] * dim + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    first_key = tl.load(first_ptr + sentence)
    mask_rows_base = (sentence % mask_batch).to(tl.int64) * mask_rows * keys + position.to(tl.int64) * keys

    m = tl.full([BLOCK_M], LOWEST, tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    weighted = tl.zeros([BLOCK_M], tl.float32)
    count = tl.zeros([BLOCK_M], tl.int64)
    top = tl.zeros([BLOCK_M], tl.int64)
    seen = tl.zeros([BLOCK_M], tl.int64)
    mean = tl.zeros([BLOCK_M], tl.float32)
    spread = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    stop = tl.max(position) + 1  # causal: no key after the block's last row
    for start in range(0, stop, BLOCK_N):
        key_index = start + offs_n
        key_ok = key_index < keys
        kv_rows = (kv * keys + key_index).to(tl.int64)
        block_keys = tl.load(
            k_ptr + kv_rows[:, None] * dim + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0
        )
        s = tl.dot(q, tl.trans(block_keys), input_precision="ieee")
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (key_index[None, :] <= position[:, None]) & key_ok[None, :] & row_ok[:, None]
        visible = visible & (key_index[None, :] != first_key)
        if HAS_MASK:
            shown = tl.load(mask_ptr + mask_rows_base[:, None] + key_index[None, :], mask=visible, other=0)
            visible = visible & (shown != 0)
        s = tl.where(visible, s, LOWEST)
        # The block's count, logits' mean and squared deviations about it, merged into the row's (Chan et al.).
        block_seen = tl.sum(visible.to(tl.int64), 1)
        block_mean = tl.sum(tl.where(visible, s, 0.0), 1) / tl.maximum(block_seen, 1).to(tl.float32)
        deviation = tl.where(visible, s - block_mean[:, None], 0.0)
        merged = seen + block_seen
        delta = block_mean - mean
        share = block_seen.to(tl.float32) / tl.maximum(merged, 1).to(tl.float32)
        spread = spread + tl.sum(deviation * deviation, 1) + delta * delta * seen.to(tl.float32) * share
        mean = mean + delta * share
        seen = merged
        # The softmax state, rescaled by alpha = e^(m - m') where the block raises the maximum.
        new_m = tl.maximum(m, tl.max(s, 1))
        shifted = tl.where(visible, s - new_m[:, None], 0.0)
        weights = tl.where(visible, tl.exp(shifted), 0.0)
        alpha = tl.exp(m - new_m)
        # alpha * (m - new_m), not (m - new_m) * A: where alpha is 0 the product is 0 (see fused.py).
        weighted = alpha * weighted + (alpha * (m - new_m)) * total + tl.sum(weights * shifted, 1)
        total = alpha * total + tl.sum(weights, 1)
        at_max = visible & (s == new_m[:, None])
        holding = tl.sum(at_max.to(tl.int64), 1)
        first_at = tl.min(tl.where(at_max, key_index[None, :], keys), 1).to(tl.int64)
        top = tl.where((new_m > m) & (holding > 0), first_at, top)
        count = tl.where(new_m == m, count, 0) + holding
        m = new_m
        if HAS_VALUE:
            block_values = tl.load(
                v_ptr + kv_rows[:, None] * dim + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(weights, block_values, input_precision="ieee")

    tl.store(m_ptr + query_rows, m, mask=row_ok)
    tl.store(total_ptr + query_rows, total, mask=row_ok)
    tl.store(weighted_ptr + query_rows, weighted, mask=row_ok)
    tl.store(count_ptr + query_rows, count, mask=row_ok)
    tl.store(top_ptr + query_rows, top, mask=row_ok)
    tl.store(seen_ptr + query_rows, seen, mask=row_ok)
    tl.store(mean_ptr + query_rows, mean, mask=row_ok)
    tl.store(spread_ptr + query_rows, spread, mask=row_ok)
    if HAS_VALUE:
        tl.store(out_ptr + query_rows[:, None] * dim + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


def row_state(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    positions: torch.Tensor,
    first_key: torch.Tensor,
    mask: torch.Tensor | None,
    softcap: float,
    window: int = -1,
    scaling: float = 1.0,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The C++ kernel's `row_state`, the same arguments and results (kernels/row_state.cpp): query (batch, heads,
    rows, dim) times `scaling`, key and value (batch, kv_heads, keys, dim), float32 and contiguous; positions (rows,)
    long; first_key (batch,) long; mask (batch or 1, query positions, keys) bool or None; softcap 0 for none.
    Returns m, A, B, n, top, seen, mean, spread ((batch, heads, rows)) and O ((batch, heads, rows, dim); empty
    without values). `window` and `out` are taken and left: this kernel folds no key points (the read-off picks
    them) and returns O for the read-off to finish."""
    # The kernel's pointer arithmetic takes contiguous rows: the queries scaled into a contiguous copy, one pass (a
    # plain product keeps a transposed view's strides and would need a second copy).
    query = torch.mul(query, scaling, out=torch.empty_like(query, memory_format=torch.contiguous_format))
    key = key.contiguous()
    value = None if value is None else value.contiguous()
    batch, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    device = query.device
    floats = [torch.empty(batch, heads, rows, device=device) for _ in range(3)]
    longs = [torch.empty(batch, heads, rows, dtype=torch.long, device=device) for _ in range(3)]
    moments = [torch.empty(batch, heads, rows, device=device) for _ in range(2)]
    output = torch.empty((batch, heads, rows, dim) if value is not None else (0,), device=device)
    mask_bytes = mask.view(torch.uint8) if mask is not None else torch.empty(1, dtype=torch.uint8, device=device)
    grid = (batch * heads, triton.cdiv(rows, BLOCK_ROWS))
    _row_state_kernel[grid](
        query, key, value if value is not None else query, positions, first_key, mask_bytes,
        *floats, *longs, *moments, output,
        heads, heads // kv_heads, rows, keys, dim,
        mask.shape[0] if mask is not None else 1, mask.shape[1] if mask is not None else 0, float(softcap or 1.0),
        HAS_VALUE=value is not None, HAS_MASK=mask is not None, HAS_SOFTCAP=bool(softcap),
        BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_KEYS, BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )  # fmt: skip
    return [*floats, *longs, *moments, output]
