"""Run batches through a model and reduce each layer's attention as soon as it exists.

How: we register an attention function named ``headscope`` with transformers' attention interface.
For every layer it reduces the attention probabilities to per-(sentence, head) sums and returns no
weights, so nothing holds more than one layer's attention (or one block of it) at a time.

Where the probabilities come from:
- ``eager``: the model's *own* module-level ``eager_attention_forward`` (so grouped KV heads,
  scaling, softcapping, sinks and sliding windows are the model's), which materialises the full
  (batch, heads, t, t) matrix.
- ``blockwise``: the layer's output comes from ``sdpa`` (fast, no t x t matrix) and the probabilities
  are recomputed block of query rows by block, bounding memory by (batch x heads x block x keys).
  Used only when the model's eager function is, to the letter, one of the standard ones (Llama's or
  GPT-2's: softmax(q k^T * scaling + mask)) *and* the recomputed probabilities matched the eager
  ones on the first real call. Anything else stays on the model's own eager function.

Two pitfalls this module exists to avoid (see FINDINGS.md):
- a custom attention name needs a *mask* function too, or transformers builds no causal or padding
  mask at all: we register the eager one;
- the attention function never sees the 2-D padding mask, so the reducer is told which query rows
  are real before every forward.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from headscope.batching import Batch
from headscope.errors import ModelLoadError, ResourceError
from headscope.metrics import causal_visible_keys, head_row_sums, head_row_sums_from_logits, visible_keys

ATTENTION_NAME = "headscope"
BLOCK_BYTES = 32 * 2**20  # float32 logits per block of query rows; temporaries take a few times this
# Rows per block, at most: small blocks let causal attention skip most keys after each block's last row.
MAX_BLOCK_ROWS = 128


def _normalised_source(function: Callable) -> str:
    source = inspect.getsource(function)
    source = re.sub(r"#[^\n]*", "", source)  # comments
    return re.sub(r"\s+", "", source)


# Eager functions whose maths is exactly softmax(q k^T * scaling + mask) with repeated KV heads.
_STANDARD_EAGER = {
    _normalised_source(modeling_llama.eager_attention_forward),
    _normalised_source(modeling_gpt2.eager_attention_forward),
}
_eager_by_class: dict[type, Callable] = {}
_standard_source: dict[Callable, bool] = {}
_verified: dict[Callable, bool] = {}  # eager function -> recomputed probabilities matched it
_causal: dict[Callable, bool] = {}  # eager function -> its weights above the diagonal were exactly 0


class _StopForward(Exception):
    """Raised after the last wanted layer: later layers cannot change what we measure."""


def standard_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    rows: slice,
    keys: int,
) -> torch.Tensor:
    """q k^T * scaling + mask for query rows `rows` and the first `keys` keys, as the standard eager functions.

    query: (batch, heads, t, head_dim); key: (batch, heads, t, head_dim) with KV heads already repeated;
    attention_mask: (batch, 1, t, t) additive, or None. Returns (batch, heads, rows, keys); softmax over
    the last axis (in float32) gives the eager attention probabilities.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Scaling the (rows, head_dim) queries instead of the (rows, keys) scores: the same numbers up to
    # float rounding (verified against the eager weights), at a fraction of the memory traffic.
    scores = torch.matmul(query[:, :, rows] * scaling, key[:, :, :keys].transpose(2, 3))
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, rows, :keys]
    return scores


def _repeat_kv(key: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, keys, d) -> (batch, heads, keys, d): query head h reads KV head h // groups."""
    groups = heads // key.shape[1]
    return key if groups == 1 else key.repeat_interleave(groups, dim=1)


class LayerReducer:
    """Receives one layer's attention at a time and keeps only per-(sentence, head) sums."""

    def __init__(
        self,
        *,
        window: int,
        accum_dtype: torch.dtype,
        layers: Sequence[int] | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.window = window
        self.accum_dtype = accum_dtype
        self.layers = sorted(set(layers)) if layers is not None else None
        self.block_bytes = block_bytes
        self.paths: dict[str, str] = {}  # attention class -> path used, for run.json
        self._batch: Batch | None = None
        self._query_valid: torch.Tensor | None = None
        self._layer = -1
        self._layer_sums: list[torch.Tensor] = []

    @property
    def query_valid(self) -> torch.Tensor | None:
        """(batch, t) bool, True on real tokens of the current batch."""
        return self._query_valid

    def start(self, batch: Batch) -> None:
        self._batch = batch
        self._query_valid = batch.attention_mask.bool()
        self._layer = -1
        self._layer_sums = []

    def next_layer(self) -> int:
        self._layer += 1
        return self._layer

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def is_last_wanted(self, layer: int) -> bool:
        return self.layers is not None and layer >= self.layers[-1]

    def _key_visible(self, attention_mask: torch.Tensor | None, keys: int) -> torch.Tensor:
        if attention_mask is None:
            return causal_visible_keys(self._query_valid)
        return visible_keys(attention_mask[..., :keys])

    def fits_one_block(self, query: torch.Tensor) -> bool:
        """Is the whole (batch, heads, t, t) matrix within the block budget? Then the eager weights are cheapest."""
        batch, heads, t, _ = query.shape
        return 4 * batch * heads * t * t <= self.block_bytes

    def consume(self, attn: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """attn: (batch, heads, t, t) probabilities; attention_mask: (batch, 1, t, t) additive, or None."""
        self._layer_sums.append(
            head_row_sums(
                attn,
                key_visible=self._key_visible(attention_mask, attn.shape[-1]),
                query_valid=self._query_valid,
                seq_start=self._batch.seq_start,
                window=self.window,
                accum_dtype=self.accum_dtype,
                # float32 rows sum to 1 within ~1e-6; half-precision probabilities are rounded to ~3 digits.
                mass_tolerance=1e-3 if attn.dtype == torch.float32 else 2e-2,
            )
        )

    def consume_blocks(self, query, key, attention_mask, scaling, *, causal: bool) -> None:
        """Recompute the logits block of query rows by block and reduce each block.

        With causal attention the rows of a block ending at position r see no key after r, so only
        keys < r are computed: about half the work of the full matrix.
        """
        batch, heads, t, _ = query.shape
        key = _repeat_kv(key, heads)
        visible = self._key_visible(attention_mask, key.shape[-2])
        rows_per_block = max(1, min(MAX_BLOCK_ROWS, self.block_bytes // (4 * batch * heads * key.shape[-2])))
        total = None
        for first in range(0, t, rows_per_block):
            rows = slice(first, min(first + rows_per_block, t))
            keys = rows.stop if causal else key.shape[-2]
            sums = head_row_sums_from_logits(
                standard_logits(query, key, attention_mask, scaling, rows, keys),
                key_visible=visible[:, :, rows, :keys],
                query_valid=self._query_valid[:, rows],
                seq_start=self._batch.seq_start,
                window=self.window,
                row_offset=first,
                accum_dtype=self.accum_dtype,
            )
            total = sums if total is None else total + sums
        self._layer_sums.append(total)

    def finish(self) -> torch.Tensor:
        """Sums of the batch, (wanted layers, batch, heads, stats), moved to the CPU in one transfer."""
        if not self._layer_sums:
            raise ModelLoadError(
                "the model never called an attention function headscope can read (no attention layers?)"
            )
        sums = torch.stack(self._layer_sums).cpu()
        self._batch = None
        self._layer_sums = []
        return sums


class AttentionKeeper:
    """Keeps every layer's attention of a one-sentence batch, for the example charts (small by design)."""

    def __init__(self) -> None:
        self.layers: list[torch.Tensor] = []
        self.paths: dict[str, str] = {}

    def fits_one_block(self, query: torch.Tensor) -> bool:
        return True  # always keep the model's own weights

    def next_layer(self) -> int:
        return len(self.layers)

    def wants(self, layer: int) -> bool:
        return True

    def is_last_wanted(self, layer: int) -> bool:
        return False

    def consume(self, attn: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        self.layers.append(attn[0].float().cpu())  # (heads, t, t)


_active: LayerReducer | AttentionKeeper | None = None


def _eager_forward_for(module: torch.nn.Module) -> Callable:
    """The `eager_attention_forward` defined next to the attention module's class."""
    cls = type(module)
    if cls not in _eager_by_class:
        function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if function is None:
            raise ModelLoadError(
                f"{cls.__name__} has no eager attention function in {cls.__module__}; "
                "headscope cannot read its attention weights"
            )
        _eager_by_class[cls] = function
        _standard_source[function] = _normalised_source(function) in _STANDARD_EAGER
    return _eager_by_class[cls]


def _inspect_first_call(eager: Callable, name: str, weights: torch.Tensor, query_valid, query, key, mask, scaling):
    """On the first call of an eager function: refuse bidirectional attention, and record whether the
    standard maths reproduces the model's own weights (which allows the block-wise path)."""
    rows = torch.ones(weights.shape[0], weights.shape[-2], dtype=torch.bool, device=weights.device)
    rows = rows if query_valid is None else query_valid  # padding rows may attend anywhere: ignore them
    above_diagonal = torch.triu(weights, diagonal=1) * rows[:, None, :, None]
    # `> 0`, not `max() == 0`: a NaN row (float16 overflow) is not attention to later tokens.
    _causal[eager] = not bool((above_diagonal > 0).any())
    if not _causal[eager]:
        raise ModelLoadError(
            f"{name} lets tokens attend to later tokens (bidirectional attention, an encoder?); "
            "headscope measures causal language models"
        )
    _verified[eager] = False
    if _standard_source[eager]:
        logits = standard_logits(query, _repeat_kv(key, query.shape[1]), mask, scaling, slice(None), key.shape[-2])
        expected = torch.softmax(logits, dim=-1, dtype=torch.float32)
        tolerance = 1e-5 if weights.dtype == torch.float32 else 1e-2  # half types round probabilities to ~3 digits
        _verified[eager] = bool((weights.float() - expected).abs().max() <= tolerance)


def _measuring_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention-interface entry: compute the layer's output, reduce its probabilities, return no weights."""
    consumer = _active
    if consumer is None:
        raise RuntimeError("headscope attention ran outside headscope.capture.measuring()")
    eager = _eager_forward_for(module)
    layer = consumer.next_layer()
    name = type(module).__name__
    if not consumer.wants(layer):
        forward = sdpa_attention_forward if _standard_source[eager] else eager
        output, _ = forward(module, query, key, value, attention_mask, **kwargs)
    elif _verified.get(eager) and not consumer.fits_one_block(query):
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        consumer.consume_blocks(query, key, attention_mask, kwargs.get("scaling"), causal=_causal[eager])
        consumer.paths[name] = "blockwise (sdpa output, probabilities by blocks of query rows)"
    else:
        output, weights = eager(module, query, key, value, attention_mask, **kwargs)
        if weights is None:
            raise ModelLoadError(f"{name}'s eager attention returned no weights")
        if eager not in _verified:
            valid = getattr(consumer, "query_valid", None)
            _inspect_first_call(eager, name, weights, valid, query, key, attention_mask, kwargs.get("scaling"))
        consumer.consume(weights, attention_mask)
        consumer.paths.setdefault(name, "eager (the model's own attention function)")
    if consumer.is_last_wanted(layer):
        raise _StopForward
    return output, None


AttentionInterface.register(ATTENTION_NAME, _measuring_attention)
AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


@contextlib.contextmanager
def measuring(model: torch.nn.Module, consumer: LayerReducer | AttentionKeeper) -> Iterator[None]:
    """Switch `model` to the measuring attention for the duration of the block, then restore it."""
    global _active
    if not type(model)._can_set_attn_implementation():
        raise ModelLoadError(
            f"{type(model).__name__} does not route attention through transformers' attention interface; "
            "headscope cannot capture its attention"
        )
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    _active = consumer
    try:
        yield
    finally:
        _active = None
        model.set_attn_implementation(previous)


def forward_kwargs(model: torch.nn.Module, batch: Batch) -> dict:
    """Arguments for a forward pass: explicit positions (so left padding is harmless) when accepted."""
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = batch.position_ids
    return kwargs


def _forward(model: torch.nn.Module, batch: Batch) -> None:
    with torch.inference_mode(), contextlib.suppress(_StopForward):
        model(**forward_kwargs(model, batch))


def measure_batch(model: torch.nn.Module, reducer: LayerReducer, batch: Batch) -> torch.Tensor:
    """One forward pass under `measuring`; returns (wanted layers, batch, heads, stats) sums on the CPU."""
    reducer.start(batch)
    try:
        _forward(model, batch)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(batch) from err
    except RuntimeError as err:
        if "can't allocate memory" not in str(err):  # the CPU allocator's own wording
            raise
        raise _out_of_memory(batch) from err
    return reducer.finish()


def _out_of_memory(batch: Batch) -> ResourceError:
    sentences, tokens = batch.input_ids.shape
    return ResourceError(
        f"out of memory on a batch of {sentences} sentences x {tokens} tokens; "
        "lower --max-memory or --batch-size, or cut sentences with --max-length"
    )


def sentence_attention(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """All layers' attention of a one-sentence batch: (layers, heads, t, t) on the CPU."""
    if len(batch.sentence_ids) != 1:
        raise ValueError("sentence_attention takes a batch of exactly one sentence")
    keeper = AttentionKeeper()
    with measuring(model, keeper):
        _forward(model, batch)
    return torch.stack(keeper.layers)
