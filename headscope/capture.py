"""Run batches through a model and reduce each layer's attention as soon as it exists.

How: we register an attention function named ``headscope`` with transformers'
attention interface. It calls the model's *own* module-level
``eager_attention_forward`` (so grouped KV heads, scaling, softcapping, sinks
and sliding windows are the model's), hands the probabilities to the
``LayerReducer`` and returns no weights, so they are freed before the next
layer runs. Nothing holds more than one layer's attention at a time.

Two pitfalls this module exists to avoid (see FINDINGS.md):
- a custom attention name needs a *mask* function too, or transformers builds
  no causal or padding mask at all: we register the eager one;
- the attention function never sees the 2-D padding mask, so the reducer is
  told which query rows are real before every forward.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from headscope.batching import Batch
from headscope.errors import ModelLoadError
from headscope.metrics import causal_visible_keys, head_row_sums, visible_keys

ATTENTION_NAME = "headscope"

_eager_by_class: dict[type, Callable] = {}


class LayerReducer:
    """Receives one layer's attention at a time and keeps only per-(sentence, head) sums."""

    def __init__(self, *, window: int, accum_dtype: torch.dtype) -> None:
        self.window = window
        self.accum_dtype = accum_dtype
        self._batch: Batch | None = None
        self._query_valid: torch.Tensor | None = None
        self._layer_sums: list[torch.Tensor] = []

    def start(self, batch: Batch) -> None:
        self._batch = batch
        self._query_valid = batch.attention_mask.bool()
        self._layer_sums = []

    def consume(self, attn: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """attn: (batch, heads, t, t) probabilities; attention_mask: (batch, 1, t, t) additive, or None."""
        if self._batch is None:
            raise RuntimeError("LayerReducer.consume called outside a batch")
        if attention_mask is None:
            key_visible = causal_visible_keys(self._query_valid)
        else:
            key_visible = visible_keys(attention_mask[..., : attn.shape[-1]])
        self._layer_sums.append(
            head_row_sums(
                attn,
                key_visible=key_visible,
                query_valid=self._query_valid,
                seq_start=self._batch.seq_start,
                window=self.window,
                accum_dtype=self.accum_dtype,
            )
        )

    def finish(self) -> torch.Tensor:
        """Sums of the batch, (layers, batch, heads, stats), moved to the CPU in one transfer."""
        if not self._layer_sums:
            raise ModelLoadError("the model never called its attention function; is it a transformer?")
        sums = torch.stack(self._layer_sums).cpu()
        self._batch = None
        self._layer_sums = []
        return sums


class AttentionKeeper:
    """Keeps every layer's attention of a one-sentence batch, for the example charts (small by design)."""

    def __init__(self) -> None:
        self.layers: list[torch.Tensor] = []

    def consume(self, attn: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        self.layers.append(attn[0].float().cpu())  # (heads, t, t)


_active_reducer: LayerReducer | AttentionKeeper | None = None


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
    return _eager_by_class[cls]


def _measuring_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention-interface entry: the model's eager maths, then reduce and drop the weights."""
    output, weights = _eager_forward_for(module)(module, query, key, value, attention_mask, **kwargs)
    if _active_reducer is None:
        raise RuntimeError("headscope attention ran outside headscope.capture.measuring()")
    if weights is None:
        raise ModelLoadError(f"{type(module).__name__}'s eager attention returned no weights")
    _active_reducer.consume(weights, attention_mask)
    return output, None


AttentionInterface.register(ATTENTION_NAME, _measuring_attention)
AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


@contextlib.contextmanager
def measuring(model: torch.nn.Module, reducer: LayerReducer | AttentionKeeper) -> Iterator[None]:
    """Switch `model` to the measuring attention for the duration of the block, then restore it."""
    global _active_reducer
    if not type(model)._can_set_attn_implementation():
        raise ModelLoadError(
            f"{type(model).__name__} does not route attention through transformers' attention interface; "
            "headscope cannot capture its attention"
        )
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    _active_reducer = reducer
    try:
        yield
    finally:
        _active_reducer = None
        model.set_attn_implementation(previous)


def forward_kwargs(model: torch.nn.Module, batch: Batch) -> dict:
    """Arguments for a forward pass: explicit positions (so left padding is harmless) when accepted."""
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = batch.position_ids
    return kwargs


def measure_batch(model: torch.nn.Module, reducer: LayerReducer, batch: Batch) -> torch.Tensor:
    """One forward pass under `measuring`; returns (layers, batch, heads, stats) sums on the CPU."""
    reducer.start(batch)
    with torch.inference_mode():
        model(**forward_kwargs(model, batch))
    return reducer.finish()


def sentence_attention(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """All layers' attention of a one-sentence batch: (layers, heads, t, t) on the CPU."""
    if len(batch.sentence_ids) != 1:
        raise ValueError("sentence_attention takes a batch of exactly one sentence")
    keeper = AttentionKeeper()
    with measuring(model, keeper), torch.inference_mode():
        model(**forward_kwargs(model, batch))
    return torch.stack(keeper.layers)
