"""The attention router: run a batch through a model and hand each layer's attention to the measurements
riding on the pass, as soon as it exists.

How: we register an attention function named ``headscope`` with transformers' attention interface.
`measuring(model, measures)` switches the model to it and gives every module of that model one `Capture`
(its own state: the measures, the current batch, which eager functions it has checked). For every layer
the capture computes the layer's output, hands the attention probabilities to each measure that wants
that layer (as `RowBlock`s of query rows), and returns no weights, so nothing holds more than one layer's
attention (or one block of it) at a time.

Where the probabilities come from:
- ``eager``: the model's *own* module-level ``eager_attention_forward`` (so grouped KV heads,
  scaling, softcapping, sinks and sliding windows are the model's), which materialises the full
  (batch, heads, t, t) matrix.
- ``blockwise``: the layer's output comes from ``sdpa`` (fast, no t x t matrix) and the logits are
  recomputed block of query rows by block, bounding memory by (batch x heads x block x keys).
  Used only when the model's eager function is, to the letter, one of the standard ones (Llama's or
  GPT-2's: softmax(q k^T * scaling + mask)) *and* our recomputed probabilities matched the eager
  ones on a few rows of the first call. Anything else stays on the model's own eager function.

Two pitfalls this module exists to avoid (see FINDINGS.md):
- a custom attention name needs a *mask* function too, or transformers builds no causal or padding
  mask at all: we register sdpa's boolean one (see `masks.boolean_mask`);
- the attention function never sees the 2-D padding mask, so the capture is told which query rows
  are real before every forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from headscope.config import BLOCK_BYTES
from headscope.errors import ModelLoadError, ResourceError
from headscope.feed import Batch
from headscope.masks import additive_mask, boolean_mask, key_visibility

ATTENTION_NAME = "headscope"
CAPTURE_ATTRIBUTE = "_headscope_capture"  # set on every module of a model while it is being measured
# Rows per block, at most: small blocks let causal attention skip most keys after each block's last row.
MAX_BLOCK_ROWS = 128
# Query rows of one sentence on which a standard eager function is checked before the block-wise path is
# trusted: enough to see the first row (which a causal model lets see only itself) and rows across the
# sentence, few enough that the check costs (1, heads, CHECK_ROWS, keys) whatever the sequence length.
CHECK_ROWS = 16


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

    def probabilities(self) -> torch.Tensor:
        """(batch, heads, rows, keys) attention probabilities, whichever path produced the block."""
        if self.weights is not None:
            return self.weights
        return torch.softmax(self.logits, dim=-1, dtype=torch.float32)


class Measure(Protocol):
    """A measurement riding on a forward pass. The capture calls, for every batch: `start`, then
    `attention` once or more (one call per block of rows) for every layer `wants` says yes to, then the
    caller collects what the measure kept (each measure has its own `finish`)."""

    def start(self, batch: Batch) -> None:
        """A batch is about to run."""

    def wants(self, layer: int) -> bool:
        """Does this measure read `layer`'s attention?"""

    def last_layer(self) -> int | None:
        """The last layer it reads (the forward pass may stop after the last one any measure reads); None: all."""

    def attention(self, layer: int, block: RowBlock) -> None:
        """Read one block of `layer`'s attention (never modify it; it is dropped after the call)."""


class OutputEditor(Protocol):
    """Something that reads, and may replace, the heads' outputs of a layer: what the attention function
    returns for every query head before the output projection mixes them, (batch, t, heads, head_dim).
    Head importance ablates and differentiates through it."""

    def start(self, batch: Batch) -> None:
        """A batch is about to run."""

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """`layer`'s head outputs; return them, or a replacement of the same shape."""


class _StopForward(Exception):
    """Raised after the last wanted layer: later layers cannot change what we measure."""


def _normalised_source(function: Callable) -> str:
    source = inspect.getsource(function)
    source = re.sub(r"#[^\n]*", "", source)  # comments
    return re.sub(r"\s+", "", source)


# Eager functions whose maths is exactly softmax(q k^T * scaling + mask) with repeated KV heads.
_STANDARD_EAGER = frozenset(
    _normalised_source(module.eager_attention_forward) for module in (modeling_llama, modeling_gpt2)
)


@functools.cache
def eager_function_of(cls: type) -> tuple[Callable, bool]:
    """The `eager_attention_forward` defined next to an attention class, and whether it is a standard one.

    A fact about the class's source code, the same for every instance: cached for the process.
    """
    function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
    if function is None:
        raise ModelLoadError(
            f"{cls.__name__} has no eager attention function in {cls.__module__}; "
            "headscope cannot read its attention weights"
        )
    return function, _normalised_source(function) in _STANDARD_EAGER


def standard_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    visible: torch.Tensor,
    scaling: float | None,
    rows: slice | torch.Tensor,
    keys: int,
) -> torch.Tensor:
    """q k^T * scaling, hidden keys at the dtype's minimum, for query rows `rows` and the first `keys` keys,
    as the standard eager functions compute them.

    query: (batch, heads, t, head_dim); key: (batch, heads, t, head_dim) with KV heads already repeated;
    visible: (batch or 1, 1, rows, keys) bool from `key_visibility`; rows: a slice or (rows,) long positions.
    Returns (batch, heads, rows, keys); softmax over the last axis (in float32) gives the eager probabilities.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    picked = query[..., rows, :] if isinstance(rows, slice) else query.index_select(-2, rows)
    # Scaling the (rows, head_dim) queries instead of the (rows, keys) scores: the same numbers up to
    # float rounding (verified against the eager weights), at a fraction of the memory traffic.
    scores = torch.matmul(picked * scaling, key[:, :, :keys].transpose(2, 3))
    return scores.masked_fill(~visible, torch.finfo(scores.dtype).min)


def _repeat_kv(key: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, keys, d) -> (batch, heads, keys, d): query head h reads KV head h // groups."""
    groups = heads // key.shape[1]
    return key if groups == 1 else key.repeat_interleave(groups, dim=1)


def check_rows(query_valid: torch.Tensor, t: int) -> tuple[int, torch.Tensor]:
    """(sentence, query positions) to check on: up to CHECK_ROWS real rows spread over the longest sentence.

    query_valid: (batch, t) bool. Returns the batch index and (rows,) long positions.
    """
    sentence = int(query_valid.sum(-1).argmax())
    positions = query_valid[sentence].nonzero().squeeze(-1).cpu()
    if len(positions) > CHECK_ROWS:
        positions = positions[torch.linspace(0, len(positions) - 1, CHECK_ROWS).round().long()]
    return sentence, positions


class Capture:
    """The state of one `measuring` context: its measures, the batch in flight, and what it has checked
    about each eager function (its own checks: a second model in the same process is checked again)."""

    def __init__(
        self,
        measures: Sequence[Measure],
        *,
        editors: Sequence[OutputEditor] = (),
        block_bytes: int = BLOCK_BYTES,
        first_layer: int = 0,
    ) -> None:
        """first_layer: the layer the first attention call of a batch belongs to (layers are numbered by
        counting calls; a pass that skips the layers before one, as exact ablation does, says where it starts)."""
        self.measures = list(measures)
        self.editors = list(editors)
        self.first_layer = first_layer
        self.block_bytes = block_bytes
        self.paths: dict[str, str] = {}  # attention class -> path its probabilities took, for run.json
        self._causal: dict[Callable, bool] = {}  # eager function -> no weight above the diagonal
        self._verified: dict[Callable, bool] = {}  # eager function -> our logits reproduce its weights
        lasts = [measure.last_layer() for measure in self.measures]
        # Editors need the whole forward (the loss comes at the end): no early stop with any of them.
        self._last_layer = None if None in lasts or not lasts or self.editors else max(lasts)
        self._batch: Batch | None = None
        self._query_valid: torch.Tensor | None = None
        self._seq_start: torch.Tensor | None = None
        self._placed: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> the two above there
        self._layer = -1

    def start(self, batch: Batch) -> None:
        self._batch = batch
        self._query_valid, self._seq_start = batch.attention_mask.bool(), batch.seq_start
        self._placed = {self._query_valid.device: (self._query_valid, self._seq_start)}
        self._layer = self.first_layer - 1
        for consumer in (*self.measures, *self.editors):
            consumer.start(batch)

    def attend(self, module, query, key, value, mask, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention function of every layer: its output, with its attention handed to the measures.

        query: (batch, heads, t, head_dim); key, value: (batch, kv_heads, t, head_dim); mask: what
        `boolean_mask` built, (batch or 1, 1, t, t) bool, or None for causal attention without padding.
        """
        if self._batch is None:
            raise RuntimeError("Capture.attend ran outside a batch (call start first)")
        self._layer += 1
        layer = self._layer
        if query.device != self._query_valid.device:  # a device map: this layer lives elsewhere; small copies
            if query.device not in self._placed:
                self._placed[query.device] = (self._query_valid.to(query.device), self._seq_start.to(query.device))
            self._query_valid, self._seq_start = self._placed[query.device]
        eager, standard = eager_function_of(type(module))
        readers = [measure for measure in self.measures if measure.wants(layer)]
        if not readers:
            output = self._unmeasured(eager, standard, module, query, key, value, mask, kwargs)
        else:
            output = self._measured(readers, layer, eager, standard, module, query, key, value, mask, kwargs)
        for editor in self.editors:
            output = editor.output(layer, output)
        if self._last_layer is not None and layer >= self._last_layer:
            raise _StopForward
        return output, None

    def _fits_one_block(self, query: torch.Tensor) -> bool:
        """Is the whole (batch, heads, t, t) matrix within the block budget? Then the eager weights are cheapest."""
        batch, heads, t, _ = query.shape
        return 4 * batch * heads * t * t <= self.block_bytes

    def _visibility(self, mask, rows, keys: int) -> torch.Tensor:
        return key_visibility(mask, self._query_valid, rows, keys)

    def _measured(self, readers, layer, eager, standard, module, query, key, value, mask, kwargs) -> torch.Tensor:
        name = type(module).__name__
        if standard and eager not in self._causal:
            self._inspect_standard(eager, name, module, query, key, value, mask, kwargs)
        if self._verified.get(eager) and not self._fits_one_block(query):
            output, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
            self._blocks(readers, layer, query, key, mask, kwargs.get("scaling"), causal=self._causal[eager])
            self.paths[name] = "blockwise (sdpa output, probabilities by blocks of query rows)"
            return output
        # The full (batch, heads, t, t) weights exist on this path anyway, so a full-size mask costs no more.
        visible = self._visibility(mask, slice(None), key.shape[-2])
        output, weights = eager(module, query, key, value, additive_mask(visible, query.dtype), **kwargs)
        if weights is None:
            raise ModelLoadError(f"{name}'s eager attention returned no weights")
        if eager not in self._causal:  # a model with its own attention maths: judged on the weights it computed
            rows = torch.arange(weights.shape[-2], device=weights.device)
            self._check_causal(eager, name, weights, rows, real=self._query_valid)
        block = RowBlock(0, visible, self._query_valid, self._seq_start, weights=weights)
        for measure in readers:
            measure.attention(layer, block)
        self.paths.setdefault(name, "eager (the model's own attention function)")
        return output

    def _unmeasured(self, eager, standard, module, query, key, value, mask, kwargs) -> torch.Tensor:
        """A layer no measure reads (--layers): the fastest correct output."""
        if standard:
            return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
        visible = self._visibility(mask, slice(None), key.shape[-2])
        return eager(module, query, key, value, additive_mask(visible, query.dtype), **kwargs)[0]

    def _blocks(self, readers, layer, query, key, mask, scaling, *, causal: bool) -> None:
        """Recompute the logits block of query rows by block and hand each block to the readers.

        With causal attention the rows of a block ending at position r see no key after r, so only
        keys < r are computed: about half the work of the full matrix.
        """
        batch, heads, t, _ = query.shape
        key = _repeat_kv(key, heads)
        rows_per_block = max(1, min(MAX_BLOCK_ROWS, self.block_bytes // (4 * batch * heads * key.shape[-2])))
        for first in range(0, t, rows_per_block):
            rows = slice(first, min(first + rows_per_block, t))
            keys = rows.stop if causal else key.shape[-2]
            visible = self._visibility(mask, rows, keys)  # (batch or 1, 1, rows, keys)
            logits = standard_logits(query, key, visible, scaling, rows, keys)
            block = RowBlock(first, visible, self._query_valid[:, rows], self._seq_start, logits=logits)
            for measure in readers:
                measure.attention(layer, block)

    def _inspect_standard(self, eager, name, module, query, key, value, mask, kwargs) -> None:
        """On the first call of a standard eager function: refuse bidirectional attention, and record
        whether our q k^T * scaling + mask softmax reproduces the model's own weights (which allows the
        block-wise path).

        Both are judged on a few query rows of one sentence (`check_rows`), so the check's memory does not
        grow with the square of the sequence: the model's eager function takes the rows as a shorter query.
        """
        sentence, positions = check_rows(self._query_valid, query.shape[-2])
        one = slice(sentence, sentence + 1)
        positions = positions.to(query.device)
        mask = mask[one] if mask is not None and mask.shape[0] > 1 else mask
        visible = key_visibility(mask, self._query_valid[one], positions, key.shape[-2])  # (1, 1, rows, keys)
        rows_query = query[one].index_select(-2, positions)
        _, weights = eager(module, rows_query, key[one], value[one], additive_mask(visible, query.dtype), **kwargs)
        self._check_causal(eager, name, weights, positions)
        logits = standard_logits(
            rows_query, _repeat_kv(key[one], query.shape[1]), visible, kwargs.get("scaling"), slice(None), key.shape[-2]
        )
        expected = torch.softmax(logits, dim=-1, dtype=torch.float32)
        tolerance = 1e-5 if weights.dtype == torch.float32 else 1e-2  # half types round probabilities to ~3 digits
        self._verified[eager] = bool((weights.float() - expected).abs().max() <= tolerance)

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


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The function registered with transformers: route the call to the capture of the module's model."""
    capture = getattr(module, CAPTURE_ATTRIBUTE, None)
    if capture is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention ran outside headscope.capture.measuring()")
    return capture.attend(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, boolean_mask)


@contextlib.contextmanager
def measuring(
    model: torch.nn.Module,
    measures: Sequence[Measure],
    *,
    editors: Sequence[OutputEditor] = (),
    block_bytes: int = BLOCK_BYTES,
    first_layer: int = 0,
) -> Iterator[Capture]:
    """Switch `model` to the measuring attention, with a capture of its own, for the duration of the block."""
    if not type(model)._can_set_attn_implementation():
        raise ModelLoadError(
            f"{type(model).__name__} does not route attention through transformers' attention interface; "
            "headscope cannot capture its attention"
        )
    capture = Capture(measures, editors=editors, block_bytes=block_bytes, first_layer=first_layer)
    modules = list(model.modules())
    if any(hasattr(module, CAPTURE_ATTRIBUTE) for module in modules):
        raise RuntimeError("this model is already being measured (measuring() does not nest)")
    previous = model.config._attn_implementation
    for module in modules:
        setattr(module, CAPTURE_ATTRIBUTE, capture)
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield capture
    finally:
        model.set_attn_implementation(previous)
        for module in modules:
            delattr(module, CAPTURE_ATTRIBUTE)


def forward_kwargs(model: torch.nn.Module, batch: Batch) -> dict:
    """Arguments for a forward pass: explicit positions (so left padding is harmless) when accepted."""
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = batch.position_ids
    return kwargs


def forward(model: torch.nn.Module, capture: Capture, batch: Batch, *, grad: bool = False):
    """One forward pass of `batch` under `capture` (inside `measuring`); the measures keep what they read.

    Returns the model's output (None when the pass stopped after the last layer any measure reads).
    grad: build the autograd graph (for a backward pass through the editors' outputs); default: inference mode.
    """
    capture.start(batch)
    try:
        with torch.enable_grad() if grad else torch.inference_mode():
            try:
                return model(**forward_kwargs(model, batch))
            except _StopForward:
                return None
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(batch) from err
    except RuntimeError as err:
        if "can't allocate memory" not in str(err):  # the CPU allocator's own wording
            raise
        raise _out_of_memory(batch) from err


def _out_of_memory(batch: Batch) -> ResourceError:
    sentences, tokens = batch.input_ids.shape
    return ResourceError(
        f"out of memory on a batch of {sentences} sentences x {tokens} tokens; "
        "lower --max-memory or --batch-size, or cut sentences with --max-length"
    )
