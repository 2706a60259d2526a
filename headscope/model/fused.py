"""A layer's attention output and every per-row statistic in one pass over tiles of keys (the flash recurrence).

The probabilities are never materialised. For each query row t, over the key tiles seen so far (every key but the
sentence's first, which headscope.model.readoff puts back: the statistics off the sink come from the same state),
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
(headscope.model.native), its Triton kernel on CUDA (headscope.model.triton_state).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from headscope.model import native
from headscope.model.masks import TileVisibility
from headscope.model.readoff import RowValues, read_off, softcapped

# Query rows per block and keys per tile: a tile of logits for 9 heads is 9 x 128 x 1,024 floats (4.5 MiB),
# which stays in the CPU's last-level cache between the passes over it. Measured on one SmolLM2 layer at 8,192
# tokens (benchmarks/README.md): 128 x 512, 256 x 1,024, 256 x 2,048 and 512 x 1,024 within noise of it,
# 64 x 512 and 128 x 256 slower (more tiles, more dispatch).
BLOCK_ROWS = 128
TILE_KEYS = 1024
# Logits a capture folds op by op before compiling (see TileKernel): 2^25 is a quarter of SmolLM2's 30 layers on
# one 1,024-token sentence, a fifth of one layer at 8,192 tokens.
COMPILE_FROM = 2**25
# Logits a capture folds before it takes a kernel (C++, Triton): one layer of a 9-head, 1,000-token sentence. Loading
# the built kernel takes 0.07 s; building it (once per machine and source) 45 s, worth it only for long work. The fused
# path itself starts where a layer's (batch, heads, t, t) float32 weights exceed the block budget (32 MiB: 4M
# visible pairs), so by default the kernel takes every fused layer; the tile loop before it measured 0.8 s for
# SmolLM2's first 7 layers at 1,024 tokens where the kernel took 0.37 s for the other 23.
NATIVE_FROM = 2**22
# The kernel of each device type, as run.json and warnings name it.
KERNEL_NAMES = {"cpu": "C++", "cuda": "Triton"}
# What the kernels read: float32, and half precision read as float32 (float64 stays on the tile loop).
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows on which a kernel's first result is checked against the tile loop.
NATIVE_CHECK_ROWS = 8
# A kernel's state covers every row in one call, and read_off is some sixty small tensor operations whatever
# its rows: read 128 rows at a time, they cost 64 calls a layer at 8,192 tokens (1.5 s of an analysis of SmolLM2).
# So rows are read off in the budget a block's logits would take (block_rows x tile_keys), at this many floats a
# row (read_off's temporaries are some sixty (batch, heads, rows) tensors): 1,024 rows by default.
READ_OFF_FLOATS = 128

_log = logging.getLogger(__name__)


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


@functools.cache
def _compiled_fold() -> Callable:
    # Static shapes but for the rows (marked dynamic at each call): the loop over a tile's keys is then fixed
    # and fully vectorised, which measured faster than dynamic=True's masked tails. No Python number may vary
    # between calls (each value would be compiled anew): the tile's first key is added outside.
    return torch.compile(_fold, dynamic=False)


def _compiled(scores, hidden, limit, *rest):
    # Rows vary with the batch; keys with the tile (full tiles are TILE_KEYS wide, the rest are few per block).
    for tensor in (scores, hidden, limit, *rest[:8]):
        if tensor is not None:
            torch._dynamo.mark_dynamic(tensor, 0)
    if scores.shape[-1] != TILE_KEYS:
        torch._dynamo.mark_dynamic(scores, 1)
        if hidden is not None:
            torch._dynamo.mark_dynamic(hidden, 1)
    return _compiled_fold()(scores, hidden, limit, *rest)


class TileKernel:
    """Chooses how a capture's fused passes run.

    - Tile steps (`step`) run op by op until `compile_from` logits have gone through this kernel (one per
      capture), compiled from then on (compiling costs about 20 s once per process, a few seconds from torch's
      disk cache, and pays off only on long work), op by op again if compiling fails. The maths is the same
      either way (tested to 1e-6).
    - Past `native_from` logits, float32 and half-precision attention (statistics and output, in float32) comes
      from headscope's C++ kernel on the CPU (headscope.model.native) or its Triton kernel on CUDA
      (headscope.model.triton_state), once it is loaded and its first result agrees with the tile loop on a few
      rows; otherwise from the tile loop.
    """

    def __init__(
        self,
        compile_from: int = COMPILE_FROM,
        native_loader: Callable | None = None,
        native_from: int = NATIVE_FROM,
        triton_loader: Callable | None = None,
    ) -> None:
        self.compile_from = compile_from
        self.native_from = native_from
        # device type -> () -> the kernel's module (its `row_state`), or why there is none (one line)
        self.loaders = {
            "cpu": native_loader or native.row_state_module,
            "cuda": triton_loader or native.triton_module,
        }
        self.folded = 0  # logits handed to `step` so far
        self.failed: str | None = None  # why compiling failed, once it has
        self.failed_kernels: dict[str, str] = {}  # device type -> why its kernel is not used, once that is known
        self.native_runs = 0  # passes whose row states a kernel computed: run.json names the path that ran
        self._checked: set[str] = set()  # device types whose kernel's first result was checked

    def step(self, logits: int) -> Callable:
        """The tile step for a layer of `logits` (batch x heads x visible pairs) logits."""
        self.folded += logits
        if self.folded < self.compile_from or self.failed is not None:
            return _tile_step
        return self._compiled

    def _compiled(self, *args) -> tuple[torch.Tensor, ...]:
        if self.failed is None:
            try:
                return _tile_step(*args, fold=_compiled)
            except Exception as err:  # any compiler failure: the same maths, uncompiled
                self.failed = f"{type(err).__name__}: {err}".splitlines()[0]
                _log.warning("torch.compile of the fused statistics failed (%s); running them op by op", self.failed)
        return _tile_step(*args)

    def row_state(self, query: torch.Tensor, mask: torch.Tensor | None) -> Callable | None:
        """The kernel for a layer's row states and output on its device (the C++ kernel on the CPU, the Triton
        kernel on CUDA), after `step` has counted the layer; None where it does not apply: fewer logits than
        `native_from` so far, not float32, bfloat16 or float16, a mask it does not take (`mask`: what the attention
        function received), another device, or a kernel that could not be loaded or disagreed."""
        device = query.device.type
        if (
            self.folded < self.native_from
            or device not in self.loaders
            or device in self.failed_kernels
            or query.dtype not in NATIVE_DTYPES
            or not native.takes_mask(mask, query.shape[-2])
        ):
            return None
        module = self.loaders[device]()
        if isinstance(module, str):
            self.failed_kernels[device] = module
            return None
        return functools.partial(self._native, module)

    def _native(self, module, scaled, key, value, positions, first_key, visibility, softcap) -> tuple | None:
        device = scaled.device.type
        try:
            states = native.row_state(module, scaled, key, value, positions, first_key, visibility, softcap)
        except Exception as err:  # a kernel that cannot compile here (Triton) or refuses its inputs: the tile loop
            return self._drop(device, f"failed ({native.one_line(err)})")
        if device in self._checked:
            self.native_runs += 1
            return states
        # Its first result against the tile loop, on the last rows (they see the most keys).
        batch, heads, t, head_dim = scaled.shape
        rows = positions[-NATIVE_CHECK_ROWS:]
        grouped = scaled.view(batch, key.shape[1], heads // key.shape[1], t, head_dim).index_select(3, rows)
        expected = _fold_tiles(grouped, key, value, visibility, rows, softcap, _tile_step, TILE_KEYS, first_key)
        # Rows that see some key but the first (padding sees none; a row that sees only the first has no state).
        seen = expected[5] > 0
        got = [None if x is None else x[:, :, -len(rows) :][seen] for x in states]
        expected = [None if x is None else x[seen] for x in expected]
        close = (1, 2, 6, 7) if value is None else (1, 2, 6, 7, 8)  # A, B, mean, spread (and O)
        agrees = all(torch.allclose(got[i], expected[i], rtol=1e-5, atol=1e-5) for i in close)
        agrees = agrees and torch.equal(got[3] > 1, expected[3] > 1) and torch.equal(got[5], expected[5])
        self._checked.add(device)
        if not agrees:
            return self._drop(device, "its first result disagreed with the tile loop")
        self.native_runs += 1
        return states

    def _drop(self, device: str, why: str) -> None:
        """Stop using `device`'s kernel, with a warning: the tile loop computes this pass and the next ones."""
        self.failed_kernels[device] = why
        _log.warning("headscope's %s attention kernel is dropped (%s): the tile loop computes this layer and the "
                     "rest", KERNEL_NAMES[device], why)  # fmt: skip


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
) -> tuple[torch.Tensor | None, RowValues]:
    """The attention output and per-row statistics of query rows `positions` (default: every row).

    query: (batch, heads, t, head_dim); key, value: (batch, kv_heads, t, head_dim), unrepeated (query head h
    reads KV head h // (heads // kv_heads)); value None: the statistics alone (the output comes from elsewhere);
    seq_start: (batch,) long; positions: (rows,) long, increasing. step: `TileKernel.step(...)`, or `_tile_step`
    itself. row_state: `TileKernel.row_state(...)`: when given, it computes every row's running state
    (and output sum) in one call instead of the tile loop. Returns the output (batch, rows, heads, head_dim) in the
    query's dtype, as attention functions return it (None without `value`), and the rows' `RowValues`.
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
    # Contiguous keys, once per layer: the kernels and the read-off's picks of single keys read them as rows.
    key = key.contiguous()
    scaled = query * scaling
    grouped_query = scaled.view(batch, kv_heads, groups, t, head_dim)
    states = None
    if row_state is not None:
        states = row_state(scaled, key, value, positions, seq_start, visibility, softcap)
    # (batch, rows, heads, head_dim), as attention functions return it: each block's rows written in place (a list
    # of blocks joined at the end held the output three times over at its peak, 57 MiB more at 8,192 tokens)
    output = None if value is None else query.new_empty((batch, len(positions), heads, head_dim), dtype=dtype)
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
        if output is not None:
            output[:, first : first + len(rows)] = block_output.transpose(1, 2)
        values.append(row_values)
    columns = zip(*(vars(v).values() for v in values), strict=True)
    joined = RowValues(*(torch.cat(parts, dim=-1) for parts in columns))
    return output, joined


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
