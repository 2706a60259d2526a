"""How one layer's attention probabilities are read, and its output computed.

- ``eager``: the model's *own* module-level ``eager_attention_forward`` (so grouped KV heads, scaling,
  softcapping, sinks and sliding windows are the model's), which materialises the full (batch, heads, t, t)
  matrix.
- ``fused``: the layer's output and every row statistic in one pass over tiles of keys (attention.tile_loop), no
  t x t matrix and no probabilities at all, for measures that take per-row values (`row_values`); measures that
  want the probabilities themselves get the logits recomputed block of query rows by block, bounding memory by
  (batch x heads x block x keys). Used only when the model's eager function is, to the letter, one of the
  standard ones (Llama's or GPT-2's: softmax(q k^T * scaling + mask); Gemma 2's, which softcaps the logits
  first) *and* both our probabilities and the fused pass's output and statistics matched the eager ones on a
  few rows of the first call. Anything else stays on the model's own eager function.

A `Readout` belongs to one capture: what it has checked about each eager function (causal? do our logits
reproduce its weights?) is its own, so a second model in the same process is checked again.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from headscope.errors import ModelLoadError
from headscope.model.attention.dispatch import KERNEL_NAMES, TileKernel
from headscope.model.attention.finish_rows import softcapped
from headscope.model.attention.key_patterns import KeyPatterns
from headscope.model.attention.tile_loop import fused_attention, tile_shape
from headscope.model.masks import TileVisibility, additive_mask, key_visibility

# Rows per block, at most: small blocks let causal attention skip most keys after each block's last row.
MAX_BLOCK_ROWS = 128
# Query rows of one sentence on which a standard eager function is checked before the block-wise path is
# trusted: enough to see the first row (which a causal model lets see only itself) and rows across the
# sentence, few enough that the check costs (1, heads, CHECK_ROWS, keys) whatever the sequence length.
CHECK_ROWS = 16
# The diagonal band the first-call check compares (the measures' own window may be anything).
CHECK_WINDOW = 2


@dataclass(frozen=True)
class RowBlock:
    """One layer's attention for a block of consecutive query rows, for every sentence and head of a batch.

    Exactly one of `weights` and `logits` is set: the model's own probabilities (eager path), or the
    standard logits with hidden keys at the dtype's minimum (block-wise path; softmax gives the probabilities).
    """

    first_row: int  # query position of the block's first row
    visible: torch.Tensor  # (batch or 1, 1, rows, keys) bool: the keys each row may see
    query_valid: torch.Tensor  # (batch, rows) bool: real (non-padding) rows
    seq_start: torch.Tensor  # (batch,) long: each sentence's first real position
    weights: torch.Tensor | None = None  # (batch, heads, rows, keys)
    logits: torch.Tensor | None = None  # (batch, heads, rows, keys)
    # (batch, kv_heads, t, head_dim): the values the layer's probabilities weigh (the whole layer's, every block)
    value: torch.Tensor | None = None
    # On the eager path, where headscope's C++ kernel reduces probabilities: (window, row_offset, reference) ->
    # RowValues of `weights` (TileKernel.weight_rows); None: no kernel, the readers reduce them with torch.
    native_rows: Callable | None = None
    # With native_rows, the same kernel's per-(sentence, head) sums of rows' values (TileKernel.sums), or None
    native_sums: Callable | None = None
    # With native_rows, the same kernel's readings of patterns in `weights`: (patterns, row_offset, reference) ->
    # PatternRows (TileKernel.pattern_rows), or None
    native_patterns: Callable | None = None

    def probabilities(self, heads: Sequence[int] | None = None) -> torch.Tensor:
        """(batch, heads, rows, keys) attention probabilities, whichever path produced the block; with `heads`,
        of those heads only (computed for them alone on the block-wise path)."""
        if self.weights is not None:
            return self.weights if heads is None else self.weights[:, list(heads)]
        logits = self.logits if heads is None else self.logits[:, list(heads)]
        return torch.softmax(logits, dim=-1, dtype=torch.float32)


def _normalised_source(function: Callable) -> str:
    source = inspect.getsource(function)
    source = re.sub(r"#[^\n]*", "", source)  # comments
    return re.sub(r"\s+", "", source)


# Eager functions whose maths is exactly softmax(q k^T * scaling + mask) with repeated KV heads ("plain": sdpa
# computes the same output), or softmax(softcap(q k^T * scaling) + mask) when given a `softcap` ("softcapped").
_STANDARD_EAGER = {
    **{_normalised_source(module.eager_attention_forward): "plain" for module in (modeling_llama, modeling_gpt2)},
    _normalised_source(modeling_gemma2.eager_attention_forward): "softcapped",
}


@functools.cache
def eager_function_of(cls: type) -> tuple[Callable, str | None]:
    """The `eager_attention_forward` defined next to an attention class, and which standard one it is
    ("plain", "softcapped"; None: the model's own maths).

    A fact about the class's source code, the same for every instance: cached for the process.
    """
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if function is None:
        raise ModelLoadError(
            f"{cls.__name__} has no eager attention function in {cls.__module__}; "
            "headscope cannot read its attention weights"
        )
    return function, _STANDARD_EAGER.get(_normalised_source(function))


def standard_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    visible: torch.Tensor,
    scaling: float | None,
    rows: slice | torch.Tensor,
    keys: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """softcap(q k^T * scaling), hidden keys at the dtype's minimum, for query rows `rows` and the first `keys`
    keys, as the standard eager functions compute them.

    query: (batch, heads, t, head_dim); key: (batch, heads, t, head_dim) with KV heads already repeated;
    visible: (batch or 1, 1, rows, keys) bool from `key_visibility`; rows: a slice or (rows,) long positions.
    Returns (batch, heads, rows, keys); softmax over the last axis (in float32) gives the eager probabilities.
    """
    scaling = resolved_scaling(query, scaling)
    picked = query[..., rows, :] if isinstance(rows, slice) else query.index_select(-2, rows)
    # Scaling the (rows, head_dim) queries instead of the (rows, keys) scores: the same numbers up to
    # float rounding (verified against the eager weights), at a fraction of the memory traffic.
    scores = softcapped(torch.matmul(picked * scaling, key[:, :, :keys].transpose(2, 3)), softcap)
    return scores.masked_fill(~visible, torch.finfo(scores.dtype).min)


def resolved_scaling(query: torch.Tensor, scaling: float | None) -> float:
    """The scaling an eager function applies: the one it is given, else 1 / sqrt(head_dim)."""
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def eager_row_values(
    weights: torch.Tensor, positions: torch.Tensor, seq_start: int, window: int
) -> dict[str, torch.Tensor]:
    """Per-row statistics read straight off one sentence's probabilities, for the first-call check.

    weights: (1, heads, rows, keys) float32 of query rows `positions` ((rows,) long). Returns (1, heads, rows)
    entropy, max_weight, sink, prev_token and diagonal (mass on keys position - window .. position).
    """
    keys = torch.arange(weights.shape[-1], device=weights.device)
    offset = keys[None, :] - positions[:, None]  # (rows, keys)
    return {
        "entropy": torch.special.entr(weights).sum(-1),
        "max_weight": weights.amax(-1),
        "sink": weights[..., seq_start],
        "prev_token": (weights * (offset == -1)).sum(-1),
        "diagonal": (weights * (offset.abs() <= window)).sum(-1),
    }


def _layer_fused_pass(query, key, value, mask, kwargs, **options):
    """`fused.fused_attention` with the layer's own scaling and softcap, as its attention kwargs give them."""
    scaling = resolved_scaling(query, kwargs.get("scaling"))
    visibility = TileVisibility(mask)
    return fused_attention(query, key, value, visibility, scaling=scaling, softcap=kwargs.get("softcap"), **options)


def repeat_kv(key: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, keys, d) -> (batch, heads, keys, d): query head h reads KV head h // groups."""
    groups = heads // key.shape[1]
    return key if groups == 1 else key.repeat_interleave(groups, dim=1)


def check_rows(query_valid: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(sentence, query positions) to check on: up to CHECK_ROWS real rows spread over the longest sentence.

    query_valid: (batch, t) bool. Returns the batch index and (rows,) long positions.
    """
    sentence = int(query_valid.sum(-1).argmax())
    positions = query_valid[sentence].nonzero().squeeze(-1).cpu()
    if len(positions) > CHECK_ROWS:
        positions = positions[torch.linspace(0, len(positions) - 1, CHECK_ROWS).round().long()]
    return sentence, positions


class Readout:
    """Computes attention layers for one capture: their output, and their attention for the readers.

    The capture sets `query_valid` ((batch, t) bool) and `seq_start` ((batch,) long) of the batch in flight, on
    the device of the layer about to run. A reader with `row_values(layer, values, query_valid, seq_start)` and a
    `window` takes the fused pass's per-row values; any other reader gets `attention(layer, block)` calls.
    """

    def __init__(self, block_bytes: int, kernel: TileKernel | None = None) -> None:
        self.block_bytes = block_bytes
        self.kernel = kernel or TileKernel()
        self.query_valid: torch.Tensor | None = None  # set by the capture for each layer, on its device
        self.seq_start: torch.Tensor | None = None
        self.paths: dict[str, str] = {}  # attention class -> the path its probabilities took, for run.json
        self._causal: dict[Callable, bool] = {}  # eager function -> no weight above the diagonal
        self._verified: dict[Callable, bool] = {}  # eager function -> our logits and fused pass reproduce it
        self.kernel_reduced = False  # the last layer read had its probabilities reduced by the C++ kernel

    def unread(self, module, query, key, value, mask, kwargs) -> torch.Tensor:
        """A layer nobody reads: the fastest correct output."""
        eager, kind = eager_function_of(type(module))
        if kind == "plain" or (kind == "softcapped" and kwargs.get("softcap") is None):
            return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
        visible = key_visibility(mask, self.query_valid, slice(None), key.shape[-2])
        return eager(module, query, key, value, additive_mask(visible, query.dtype), **kwargs)[0]

    def read(self, readers: Sequence, layer: int, module, query, key, value, mask, kwargs) -> torch.Tensor:
        """The layer's output; its attention goes to every reader.

        query: (batch, heads, t, head_dim); key, value: (batch, kv_heads, t, head_dim); mask: what
        `masks.boolean_mask` built, (batch or 1, 1, t, t) bool, or None for causal attention without padding.
        """
        eager, kind = eager_function_of(type(module))
        name = type(module).__name__
        if kind is not None and eager not in self._causal:
            self._inspect_standard(eager, name, module, query, key, value, mask, kwargs)
        if self._verified.get(eager) and not self._fits_one_block(query):
            return self._fused(readers, layer, module, query, key, value, mask, kwargs)
        # The full (batch, heads, t, t) weights exist on this path anyway, so a full-size mask costs no more.
        visible = key_visibility(mask, self.query_valid, slice(None), key.shape[-2])
        output, weights = eager(module, query, key, value, additive_mask(visible, query.dtype), **kwargs)
        if weights is None:
            raise ModelLoadError(f"{name}'s eager attention returned no weights")
        if eager not in self._causal:  # a model with its own attention maths: judged on the weights it computed
            rows = torch.arange(weights.shape[-2], device=weights.device)
            self._check_causal(eager, name, weights, rows, real=self.query_valid)
        native_rows = self.kernel.weight_rows(weights, visible, self.seq_start)
        native_sums = None if native_rows is None else self.kernel.sums("row_sums")
        native_patterns = None if native_rows is None else self.kernel.pattern_rows(weights, visible)
        self.kernel_reduced = native_rows is not None  # then what the heads write is summed by the kernel too
        block = RowBlock(0, visible, self.query_valid, self.seq_start, weights=weights, value=value,
                         native_rows=native_rows, native_sums=native_sums,
                         native_patterns=native_patterns)  # fmt: skip
        weight_runs = self.kernel.weight_runs
        for reader in readers:
            reader.attention(layer, block)
        if not self.paths.get(name, "eager").startswith("fused"):  # the fused path, where it ran, is worth naming
            native = self.kernel.weight_runs > weight_runs
            reduced = " and its row statistics from headscope's C++ kernel" if native else ""
            self.paths[name] = f"eager (the model's own attention function{reduced})"
        return output

    def _fused(self, readers, layer, module, query, key, value, mask, kwargs) -> torch.Tensor:
        """The output and the row readers' values from one fused pass; the other readers' blocks recomputed."""
        self.kernel_reduced = False
        batch, heads, t, _ = query.shape
        name = type(module).__name__
        row_readers = [reader for reader in readers if hasattr(reader, "row_values")]
        windows = {reader.window for reader in row_readers}
        window = max(windows, default=0)
        if len(windows) > 1:  # one band per pass: the readers with another window read blocks
            row_readers = [reader for reader in row_readers if reader.window == window]
        rows, keys = tile_shape(batch, heads, self.block_bytes)
        step = self.kernel.step(batch * heads * t * (t + 1) // 2)
        # One pass for the output and the statistics where headscope's C++ kernel applies, or the model softcaps
        # its logits (sdpa cannot); elsewhere sdpa's output, faster than the tile loop folding the values in.
        row_state = self.kernel.row_state(query, mask)
        one_pass = row_state is not None or kwargs.get("softcap") is not None
        output = None if one_pass else sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
        native_runs = self.kernel.native_runs
        # readers of pattern targets (the exemplars' and detectors'): the kernel reads them in the same pass
        wanted = {reader: reader.key_patterns(query.device) for reader in readers if hasattr(reader, "key_patterns")}
        wanted = {reader: patterns for reader, patterns in wanted.items() if patterns is not None}
        fused_output, values, read = _layer_fused_pass(
            query,
            key,
            value if one_pass else None,
            mask,
            kwargs,
            seq_start=self.seq_start,
            window=window,
            step=step,
            block_rows=rows,
            tile_keys=keys,
            row_state=row_state,
            patterns=KeyPatterns.joined(list(wanted.values())) if wanted else None,
        )
        for reader in row_readers:
            reader.row_values(layer, values, self.query_valid, self.seq_start)
        if read is not None:  # each reader's share of the patterns, in the order they were joined
            first = 0
            for reader, patterns in wanted.items():
                share = read.part(first, first + patterns.count)
                reader.pattern_rows(layer, share, values, self.query_valid, self.seq_start)
                first += patterns.count
        block_readers = [
            reader
            for reader in readers
            if reader not in row_readers and (not hasattr(reader, "needs_blocks") or reader.needs_blocks(layer))
        ]
        if block_readers:
            self._blocks(block_readers, layer, query, key, value, mask, kwargs)
        # Recorded even if short batches took the eager weights: the fused path is the one worth naming.
        if self.kernel.native_runs > native_runs:  # the kernel ran (not refused on its first call)
            kernel = KERNEL_NAMES[query.device.type]
            self.paths[name] = f"fused (output and row statistics in one pass by headscope's {kernel} kernel)"
        elif output is None:
            self.paths[name] = "fused (output and row statistics in one pass over tiles of keys)"
        else:
            self.paths[name] = "fused (row statistics in one pass over tiles of keys; output from sdpa)"
        return fused_output if output is None else output

    def _fits_one_block(self, query: torch.Tensor) -> bool:
        """Is the whole (batch, heads, t, t) matrix within the block budget? Then the eager weights are cheapest."""
        batch, heads, t, _ = query.shape
        return 4 * batch * heads * t * t <= self.block_bytes

    def _blocks(self, readers, layer, query, key, value, mask, kwargs) -> None:
        """Recompute the logits block of query rows by block and hand each block to the readers.

        The rows of a block ending at position r see no key after r (causal attention), so only keys < r are
        computed: about half the work of the full matrix.
        """
        batch, heads, t, _ = query.shape
        key = repeat_kv(key, heads)
        rows_per_block = max(1, min(MAX_BLOCK_ROWS, self.block_bytes // (4 * batch * heads * key.shape[-2])))
        for first in range(0, t, rows_per_block):
            rows = slice(first, min(first + rows_per_block, t))
            visible = key_visibility(mask, self.query_valid, rows, rows.stop)  # (batch or 1, 1, rows, keys)
            logits = standard_logits(
                query, key, visible, kwargs.get("scaling"), rows, rows.stop, softcap=kwargs.get("softcap")
            )
            block = RowBlock(first, visible, self.query_valid[:, rows], self.seq_start, logits=logits, value=value)
            for reader in readers:
                reader.attention(layer, block)

    def _inspect_standard(self, eager, name, module, query, key, value, mask, kwargs) -> None:
        """On the first call of a standard eager function: refuse bidirectional attention, and record
        whether our softcap(q k^T * scaling) + mask softmax, and the fused pass's output and row statistics,
        reproduce the model's own (which allows the fused and block-wise paths).

        Judged on a few query rows of one sentence (`check_rows`), so the check's memory does not grow with the
        square of the sequence: the model's eager function takes the rows as a shorter query.
        """
        sentence, positions = check_rows(self.query_valid)
        one = slice(sentence, sentence + 1)
        positions = positions.to(query.device)
        mask = mask[one] if mask is not None and mask.shape[0] > 1 else mask
        visible = key_visibility(mask, self.query_valid[one], positions, key.shape[-2])  # (1, 1, rows, keys)
        rows_query = query[one].index_select(-2, positions)
        output, weights = eager(module, rows_query, key[one], value[one], additive_mask(visible, query.dtype), **kwargs)
        self._check_causal(eager, name, weights, positions)
        logits = standard_logits(
            rows_query,
            repeat_kv(key[one], query.shape[1]),
            visible,
            kwargs.get("scaling"),
            slice(None),
            key.shape[-2],
            softcap=kwargs.get("softcap"),
        )
        expected = torch.softmax(logits, dim=-1, dtype=torch.float32)
        tolerance = 1e-5 if weights.dtype == torch.float32 else 1e-2  # half types round probabilities to ~3 digits
        same_weights = bool((weights.float() - expected).abs().max() <= tolerance)
        self._verified[eager] = same_weights and self._fused_matches(
            output,
            weights.float(),
            query[one],
            key[one],
            value[one],
            mask,
            self.seq_start[one],
            positions,
            kwargs,
            tolerance,
        )

    def _fused_matches(self, output, weights, query, key, value, mask, seq_start, positions, kwargs, tolerance) -> bool:
        """Do the fused pass's output and row statistics on rows `positions` of one sentence equal those of the
        model's eager `output` ((1, rows, heads, head_dim)) and `weights` ((1, heads, rows, keys), float32)?"""
        fused_output, values, _ = _layer_fused_pass(
            query,
            key,
            value,
            mask,
            kwargs,
            seq_start=seq_start,
            window=CHECK_WINDOW,
            step=self.kernel.step(0),
            positions=positions,
        )
        expected = eager_row_values(weights, positions, int(seq_start[0]), CHECK_WINDOW)
        scale = max(1.0, float(output.abs().max()))
        if (fused_output.float() - output.float()).abs().max() > tolerance * scale:
            return False
        got = {name: getattr(values, name).float() for name in expected}
        return all(bool((got[name] - expected[name]).abs().max() <= tolerance) for name in expected)

    def _check_causal(self, eager, name: str, weights, positions, real: torch.Tensor | None = None) -> None:
        """Refuse a model whose weights (batch, heads, len(positions), keys) reach keys after their query.

        positions: (len(positions),) the query position of each row; real: (batch, len(positions)) bool, the
        rows to judge (padding rows may attend anywhere), or None when every row given is real.
        """
        later = torch.arange(weights.shape[-1], device=weights.device)[None, :] > positions[:, None]  # (rows, keys)
        above_diagonal = weights * later
        if real is not None:
            above_diagonal = above_diagonal * real[:, None, :, None]
        # `> 0`, not `max() == 0`: a NaN row (float16 overflow) is not attention to later tokens.
        self._causal[eager] = not bool((above_diagonal > 0).any())
        if not self._causal[eager]:
            raise ModelLoadError(
                f"{name} lets tokens attend to later tokens (bidirectional attention, an encoder?); "
                "headscope measures causal language models"
            )
