"""A GPT-2 attention whose own eager maths overflows: row 0 of head 0 comes out NaN, as float16 can.

headscope reads each model's eager function from the module of its attention class, so a class defined here,
next to its own `eager_attention_forward`, is a model with its own attention maths (like Gemma 2's softcapping).
"""

from __future__ import annotations

import torch
from transformers.models.gpt2 import modeling_gpt2


def eager_attention_forward(module, query, key, value, attention_mask, **kwargs):
    output, weights = modeling_gpt2.eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    weights = weights.clone()
    weights[:, 0, 0, :] = float("nan")  # row 0: NaN also lands above the diagonal
    return output, weights


class OverflowingGPT2Attention(modeling_gpt2.GPT2Attention):
    pass


def make_overflowing(model: torch.nn.Module) -> None:
    """Give every attention layer of a GPT-2 model the overflowing maths."""
    for module in model.modules():
        if type(module) is modeling_gpt2.GPT2Attention:
            module.__class__ = OverflowingGPT2Attention
