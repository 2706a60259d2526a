"""An independent windowed-attention reference: one sentence at a time, float64 attention, plain transformers, no
headscope.

An attention function of our own, registered with transformers under its own name with transformers' *eager*
(additive) mask, so that causal masking and a model's sliding windows are transformers' own: per module it computes
softcap(q k^T * scaling) + mask in float64, and for the windowed heads of its layer also hides every key s of row t
with s >= sink and t - s >= window, then softmax over what is left, times the values. The loss is the mean
next-token cross-entropy over the sentences' predicted tokens (token-weighted), in float64.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import eager_mask

NAME = "window_reference"
_STATE: dict = {}


def _windowed_eager(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    layer = _STATE["layer_of"][module]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query.double(), key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t, keys = scores.shape[-2:]
    hidden = attention_mask[..., :keys] < torch.finfo(attention_mask.dtype).min / 2  # transformers' own mask
    windowed = [head for at, head in _STATE["heads"] if at == layer]
    if windowed:
        rows, columns = torch.arange(t)[:, None], torch.arange(keys)[None, :]
        dropped = (columns >= _STATE["sink"]) & (rows - columns >= _STATE["window"])
        head_hidden = torch.zeros(query.shape[1], t, keys, dtype=torch.bool)
        head_hidden[windowed] = dropped
        hidden = hidden | head_hidden[None]
    weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous().to(query.dtype), weights


AttentionInterface.register(NAME, _windowed_eager)
AttentionMaskInterface.register(NAME, eager_mask)


def windowed_loss(lm, sentences: list[list[int]], heads, *, sink: int, window: int) -> float:
    """The mean next-token loss (nats per predicted token) of `lm` with `heads` ((layer, head) pairs) windowed."""
    base = lm.base_model
    layers = base.layers if hasattr(base, "layers") else base.h
    _STATE.update(heads=list(heads), sink=sink, window=window, layer_of={
        module: index for index, layer in enumerate(layers) for module in layer.modules()})  # fmt: skip
    previous = lm.config._attn_implementation
    lm.set_attn_implementation(NAME)
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for ids in sentences:
                logp = torch.log_softmax(lm(torch.tensor([ids])).logits[0].double(), -1)
                total -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
                tokens += len(ids) - 1
    finally:
        lm.set_attn_implementation(previous)
    return total / tokens
