"""A layer's attention output and every per-row statistic in one pass over tiles of keys (the flash recurrence).

The probabilities are never materialised. For each query row t, over the key tiles seen so far (every key but the
sentence's first, which attention.finish_rows puts back: the statistics off the sink come from the same state),
the pass keeps

    m    the largest logit                          A    sum_s e^(s_s - m)
    B    sum_s e^(s_s - m) (s_s - m)    (<= 0)      O    sum_s e^(s_s - m) v_s
    n    how many keys hold exactly m                top  the first key that does
    seen, mean, spread   how many keys, their logits' mean and sum of squared deviations (merged tile by tile)

and when a tile raises the maximum to m' it rescales A, B and O by alpha = e^(m - m') (B also gains
(m - m') A). At the end the row's

    entropy     = ln A - B / A        (both terms >= 0: no cancellation)
    max_weight  = 1 / A               (the largest probability is e^0 / A)
    output      = O / A

Sink, previous-token and diagonal-band mass are probabilities of single keys, e^(s - m) / A: their logits are
recomputed by one dot product each, for the few keys concerned. Logits are those of the standard eager
functions: softcap(q k^T * scaling) (softcap(x) = c tanh(x / c), Gemma 2's), hidden keys at the dtype's minimum.

Attention here is causal (headscope refuses other models), so tiles after a block's last row are skipped, and so
is any tile the mask hides entirely (a sliding window).

On long sequences the tile step runs through `torch.compile` (C++ loops on CPU, Triton kernels on CUDA), so the
several elementwise passes over a tile become one or two passes in cache; if compiling fails (no C++ compiler,
say) the same function runs op by op, with the same maths. For a float32 or half-precision model, headscope's
kernels replace the tile loop, the output included (same state, same read-off): its C++ kernel on the CPU
(attention.cpu_kernel), which also finishes each row's output itself, straight into the layer's output, and its
Triton kernel on CUDA (headscope.model.attention.cuda_kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headscope.model.attention.finish_rows import RowValues, read_off, softcapped
from headscope.model.attention.key_patterns import KeyPatterns, PatternRows, finish
from headscope.model.masks import TileVisibility

# Query rows per block and keys per tile: a tile of logits for 9 heads is 9 x 128 x 1,024 floats (4.5 MiB),
# which stays in the CPU's last-level cache between the passes over it. Measured on one SmolLM2 layer at 8,192
# tokens (benchmarks/README.md): 128 x 512, 256 x 1,024, 256 x 2,048 and 512 x 1,024 within noise of it,
# 64 x 512 and 128 x 256 slower (more tiles, more dispatch).
BLOCK_ROWS = 128
TILE_KEYS = 1024
# A kernel's state covers every row in one call, and read_off is some sixty small tensor operations whatever
# its rows: read 128 rows at a time, they cost 64 calls a layer at 8,192 tokens (1.5 s of an analysis of SmolLM2).
# So rows are read off in the budget a block's logits would take (block_rows x tile_keys), at this many floats a
# row (read_off's temporaries are some sixty (batch, heads, rows) tensors): 1,024 rows by default.
READ_OFF_FLOATS = 128
# What every fold leaves: m, A, B, n, top, seen, mean, spread, O (a kernel may add its key points after them).
FOLD_STATE = 9


def _tile_step(
    query: torch.Tensor,  # (batch, kv_heads, groups * rows, head_dim), already scaled
    key: torch.Tensor,  # (batch, kv_heads, keys, head_dim)
    value: torch.Tensor | None,  # (batch, kv_heads, keys, head_dim); None: no output wanted
    hidden: torch.Tensor | None,  # (batch or 1, 1, 1, rows, keys) bool, True = hidden; or (rows,) long, the
    # last key of the tile each row sees (causal); None: all visible
    state: tuple,  # m, A, B, n, top, seen, mean, spread: (batch, kv_heads, groups * rows); O: (..., head_dim) or None
    key_start: int,
    softcap: float | None,
    first_key: torch.Tensor,  # (batch,) long: each sentence's first key, left out of the fold
    fold: Callable | None = None,
) -> tuple:
    """One tile of keys folded into the running state of a block of query rows (`fold`: `_fold`, or a compiled
    copy of it)."""
    m, total, weighted, count, top, seen, mean, spread, output = state
    scores = torch.matmul(query, key.transpose(-1, -2))  # (batch, kv_heads, groups * rows, keys)
    batch, kv_heads, group_rows, keys = scores.shape
    limit = None
    if hidden is not None and hidden.dtype != torch.bool:  # (rows,) long: each row sees the tile's keys <= limit
        limit = hidden.expand(batch, kv_heads, group_rows // hidden.shape[-1], -1).reshape(-1)
        hidden = None
    elif hidden is not None:  # as (batch * kv_heads * groups * rows, keys), like the scores
        rows = hidden.shape[-2]
        hidden = hidden.expand(batch, kv_heads, group_rows // rows, rows, keys).reshape(-1, keys)
    skip = (first_key - key_start).view(batch, 1, 1).expand(batch, kv_heads, group_rows).reshape(-1)
    flat = [x.reshape(-1) for x in (m, total, weighted, count, seen, mean, spread)]
    weights, alpha, *folded, found = (fold or _fold)(
        scores.reshape(-1, keys), hidden, limit, skip, *flat, softcap, value is not None
    )
    m, total, weighted, count, seen, mean, spread, found = (x.view(m.shape) for x in (*folded, found))
    top = torch.where(found >= 0, found + key_start, top)
    if value is not None:
        output = alpha.view(m.shape)[..., None] * output + torch.matmul(weights.view(scores.shape), value.float())
    return m, total, weighted, count, top, seen, mean, spread, output


def _fold(scores, hidden, limit, skip, m, total, weighted, count, seen, mean, spread, softcap: float | None, keep):
    """The elementwise heart of a tile step, on (rows, keys) scores and (rows,) running values: what is
    compiled. Returns the tile's weights e^(s - m') (if `keep`, for the output; None otherwise), alpha, the
    new m, A, B, n, seen, mean, spread, and where in the tile the new maximum first sits (-1: not in this tile).

    The tile's top key is the first key holding the new maximum, found in the same pass as the sums (a
    max-with-index pass vectorises poorly); when several keys hold it the row is tied and `top` is not used.
    Key `skip` of the tile (the sentence's first key, when it is in the tile) is left out like a hidden one: the
    read-off adds it back. seen, mean, spread: how many visible keys, their logits' mean and sum of squared
    deviations, merged tile by tile (Chan et al.'s pairwise update: no digits lost to a large mean).
    """
    lowest = torch.finfo(torch.float32).min
    scores = softcapped(scores.float(), softcap)
    columns = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    if hidden is not None:
        scores = scores.masked_fill(hidden, lowest)
    if limit is not None:  # causal, computed in the loop: no (rows, keys) mask to read
        scores = scores.masked_fill(columns > limit[:, None], lowest)
    scores = scores.masked_fill(columns == skip[:, None], lowest)
    visible = scores > lowest
    tile_seen = visible.sum(-1)
    tile_mean = torch.where(visible, scores, 0.0).sum(-1) / tile_seen.clamp(min=1)
    tile_spread = torch.where(visible, scores - tile_mean[:, None], 0.0).square().sum(-1)
    new_seen = seen + tile_seen
    delta = tile_mean - mean
    share = tile_seen / new_seen.clamp(min=1)
    spread = spread + tile_spread + delta.square() * seen * share
    mean = mean + delta * share
    new_m = torch.maximum(m, scores.amax(-1))
    shifted = scores - new_m[:, None]  # <= 0
    weights = torch.exp(shifted)
    alpha = torch.exp(m - new_m)
    # alpha * (m - new_m), not (m - new_m) * A: where alpha is 0 the product is 0, never 0 * an overflow.
    weighted = alpha * weighted + (alpha * (m - new_m)) * total + (weights * shifted).sum(-1)
    total = alpha * total + weights.sum(-1)
    at_max = shifted == 0
    holding = at_max.sum(-1)
    count = torch.where(new_m == m, count, 0) + holding
    first = torch.where(at_max, torch.arange(scores.shape[-1], device=scores.device), scores.shape[-1]).amin(-1)
    found = torch.where((new_m > m) & (holding > 0), first, -1)
    return (weights if keep else None), alpha, new_m, total, weighted, count, new_seen, mean, spread, found


def tile_shape(batch: int, heads: int, block_bytes: int) -> tuple[int, int]:
    """(query rows per block, keys per tile) whose float32 logits, batch x heads x rows x keys, fit
    `block_bytes`: BLOCK_ROWS x TILE_KEYS when they do, fewer keys then fewer rows when they do not."""
    elements = max(1, block_bytes // (4 * batch * heads))
    keys = max(1, min(TILE_KEYS, elements // BLOCK_ROWS))
    return max(1, min(BLOCK_ROWS, elements // keys)), keys


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    visibility: TileVisibility,
    *,
    scaling: float,
    softcap: float | None,
    seq_start: torch.Tensor,
    window: int,
    step: Callable,
    positions: torch.Tensor | None = None,
    block_rows: int = BLOCK_ROWS,
    tile_keys: int = TILE_KEYS,
    row_state: Callable | None = None,
    patterns: KeyPatterns | None = None,
) -> tuple[torch.Tensor | None, RowValues, PatternRows | None]:
    """The attention output, per-row statistics and pattern readings of query rows `positions` (default: every row).

    query: (batch, heads, t, head_dim); key, value: (batch, kv_heads, t, head_dim), unrepeated (query head h
    reads KV head h // (heads // kv_heads)); value None: the statistics alone (the output comes from elsewhere);
    seq_start: (batch,) long; positions: (rows,) long, increasing. step: `TileKernel.step(...)`
    (headscope.model.attention.dispatch), or `_tile_step` itself. row_state: `TileKernel.row_state(...)`: when given, it
    computes every row's running state (and output sum, or the finished output in place) in one call instead of the
    tile loop, and reads the `patterns`' targets in the same pass where it folds them
    (headscope.model.attention.key_patterns). Returns the output (batch, rows, heads, head_dim) in the query's dtype,
    as attention functions return it (None without `value`), the rows' `RowValues`, and their `PatternRows` (None
    where no kernel read the patterns: the tile loop reads none).
    """
    batch, heads, t, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    every_row = positions is None
    positions = torch.arange(t, device=query.device) if positions is None else positions
    dtype = query.dtype
    if row_state is not None and dtype != torch.float32:
        # A half-precision layer taken by a kernel: its bfloat16/float16 numbers are exact in float32, and every
        # product and sum from here on (the kernel's and the read-off's) is float32, as in sdpa's CPU kernel.
        query, key, value = (None if x is None else x.float() for x in (query, key, value))
    # (batch, rows, heads, head_dim), as attention functions return it: the C++ kernel writes its rows' finished
    # output there, the tile loop each block's (a list of blocks joined at the end held the output three times over
    # at its peak, 57 MiB more at 8,192 tokens). In float32 where a kernel computes it, in `dtype` at the end.
    output = None if value is None else query.new_empty((batch, len(positions), heads, head_dim))
    states, folded = None, None
    if row_state is not None:  # the C++ kernel reads the model's queries, keys and values where they are
        arguments = (query, key, value, positions, seq_start, visibility, softcap, window)
        states, folded = row_state(*arguments, scaling=scaling, out=output, patterns=patterns) or (None, None)
    # The read-off picks single keys (no kernel, or one that folds no key points) and the tile loop reads keys tile by
    # tile: contiguous keys, once per layer, and the scaled queries. With the kernel's key points the read-off reads
    # no query (the unscaled view stands in for its shape): no scaled copy of the queries.
    picks = states is None or len(states) == FOLD_STATE
    if picks:
        key = key.contiguous()
    grouped_query = (query * scaling if picks else query).view(batch, kv_heads, groups, t, head_dim)
    values = []
    block_rows = block_rows if states is None else max(block_rows, block_rows * tile_keys // READ_OFF_FLOATS)
    for first in range(0, len(positions), block_rows):
        rows = positions[first : first + block_rows]
        # Every row (the default): a block is a view of the queries, not a copy.
        block_query = (
            grouped_query[:, :, :, first : first + len(rows)] if every_row else grouped_query.index_select(3, rows)
        )
        if states is None:
            state = _fold_tiles(block_query, key, value, visibility, rows, softcap, step, tile_keys, seq_start)
        else:
            block = slice(first, first + block_rows)
            state = tuple(None if x is None else x[:, :, block] for x in states)
        block_output, row_values = read_off(
            block_query, key, value, visibility, rows, state, softcap, seq_start, window
        )
        if block_output is not None:  # (None where the kernel wrote the finished output: states[8] is None)
            output[:, first : first + len(rows)] = block_output.transpose(1, 2)
        values.append(row_values)
    columns = [v.columns() for v in values]
    joined = RowValues(**{name: torch.cat([present[name] for present in columns], -1) for name in columns[0]})
    read = None if folded is None else finish(folded, joined, patterns.first_target[..., positions], seq_start)
    return None if output is None else output.to(dtype), joined, read


def _fold_tiles(grouped_query, key, value, visibility, rows, softcap, step, tile_keys, first_key) -> tuple:
    """Fold every key tile a block of query rows may see, but each sentence's first key (first_key: (batch,) long):
    its m, A, B, n, top, seen, mean, spread ((batch, heads, rows) each) and output sum ((batch, heads, rows,
    head_dim); None without `value`)."""
    batch, kv_heads, groups, n_rows, head_dim = grouped_query.shape
    flat_query = grouped_query.reshape(batch, kv_heads, groups * n_rows, head_dim)
    shape = (batch, kv_heads, groups * n_rows)
    device = grouped_query.device
    state = (
        torch.full(shape, torch.finfo(torch.float32).min, device=device),  # m: a finite start, see _tile_step
        torch.zeros(shape, device=device),
        torch.zeros(shape, device=device),
        torch.zeros(shape, dtype=torch.long, device=device),
        torch.zeros(shape, dtype=torch.long, device=device),
        torch.zeros(shape, dtype=torch.long, device=device),  # seen
        torch.zeros(shape, device=device),  # mean
        torch.zeros(shape, device=device),  # spread
        None if value is None else torch.zeros((*shape, head_dim), device=device),
    )
    # The tile of the block's own diagonal first (every real row sees itself, so the running maximum is a real
    # logit from the start), then full tiles leftwards, then what is left: no key computed in vain.
    for keys in _tiles(int(rows[0]), int(rows[-1]) + 1, tile_keys):
        seen, hidden = visibility.tile(rows, keys)
        if not seen:
            continue
        tile_values = None if value is None else value[:, :, keys]
        state = step(flat_query, key[:, :, keys], tile_values, hidden, state, keys.start, softcap, first_key)
    return tuple(None if x is None else x.view(batch, kv_heads * groups, n_rows, *x.shape[3:]) for x in state)


def _tiles(first: int, last: int, width: int) -> list[slice]:
    """Key tiles for query rows first..last-1: [first, last), then [first - width, first), ... down to key 0."""
    tiles = [slice(first, last)]
    while first > 0:
        tiles.append(slice(max(0, first - width), first))
        first -= width
    return tiles
