"""Every head's OV circuit on tokens, read from the weights with the norms' gains folded in, and its copying score
(measures/ov_copying.py): what `copying` reports and analyze's ov_copying column holds.

    the map    K_h = W_V^h G_in (W_E^T W_U G_f) G_post W_O^h, (head_dim, head_dim): W_E the token embeddings, G_in
               the gain of the norm the attention reads, G_post a post-attention norm's (Gemma 2 and 3, OLMo 2),
               G_f the final norm's, W_U the LM head (the embeddings where they are tied); W_V^h the value rows of
               the head's KV head, W_O^h its output columns
    the score  sum(lambda) / sum(|lambda|) over K_h's eigenvalues (M = W_U ... W_E's non-zero ones)

Left out, as Elhage et al. leave them: each norm's 1/rms (a positive scale per token), LayerNorm's centring,
biases and position embeddings. A positive scale of the whole circuit (Gemma's sqrt(hidden) on the embeddings)
changes no score: the ratio is the same for M and s M. Where the pieces sit is the model's one description of its
layers (model/layers.py), as `circuit` reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from headscope.errors import ConfigError
from headscope.measures.ov_copying import copying_scores, token_map
from headscope.model.norms import FrozenNorm
from headscope.model.projection import head_columns, linear_weight


def unembedding(loaded) -> tuple[torch.Tensor, str]:
    """W_U and where it comes from: the LM head, or the token embeddings where they are tied."""
    network = loaded.lm or loaded.model
    head = loaded.lm.get_output_embeddings() if loaded.lm is not None else None
    if head is not None:
        return head.weight.detach(), "the LM head"
    if getattr(network.config, "tie_word_embeddings", False):
        return network.get_input_embeddings().weight.detach(), "the token embeddings (tied)"
    raise ConfigError(f"{loaded.source.display} has no LM head loaded and untied embeddings: the OV circuit needs "
                      "the unembedding")  # fmt: skip


def ov_copying(loaded, capture, architecture: dict, tokens: Sequence[int] | None = None) -> tuple[np.ndarray, str]:
    """(layers, heads) float64 copying scores of every layer's heads, on `tokens` (default: the whole vocabulary),
    and where W_U came from. capture: the model's attention capture (model.capture.attached)."""
    heads, kv_heads, head_dim = (architecture[key] for key in ("heads", "kv_heads", "head_dim"))
    with torch.no_grad():
        places, final_norm = capture.layer_map(loaded.device).placed()
        embed, unembed, where = _token_matrices(loaded, tokens)
        hidden = embed.shape[1]
        tokens_map = token_map(embed, unembed.to(embed.device)) * _gain(final_norm, hidden, embed.device)[None, :]
        on_device = {}  # a model spread over devices (--device-map): each layer's circuit where its weights are
        scores = []
        for place in places:
            values = _value_rows(place, heads, kv_heads, head_dim)  # (heads, head_dim, hidden)
            device = values.device
            outputs = head_columns(place.output).double().to(device).view(hidden, heads, head_dim).permute(1, 0, 2)
            gain_in, gain_post = (_gain(norm, hidden, device) for norm in (place.input_norm, place.post_attention))
            tokens_here = on_device.setdefault(device, tokens_map.to(device))
            scores.append(copying_scores(values * gain_in, tokens_here, gain_post[:, None] * outputs))
    return np.stack(scores), where


def _token_matrices(loaded, tokens) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(W_E, W_U, where W_U came from), restricted to `tokens`."""
    embed = (loaded.lm or loaded.model).get_input_embeddings().weight.detach()
    unembed, where = unembedding(loaded)
    if tokens is not None:
        chosen = torch.as_tensor(list(tokens), dtype=torch.long, device=embed.device)
        if len(chosen) == 0 or int(chosen.min()) < 0 or int(chosen.max()) >= len(embed):
            raise ConfigError(f"tokens must be ids in [0, {len(embed)}); got {len(chosen)} ids")
        embed, unembed = embed[chosen], unembed[chosen]
    return embed, unembed, where


def _gain(norm, hidden: int, device: torch.device) -> torch.Tensor:
    """(hidden,) float64 on `device`: a norm's gain g (LayerNorm's or an RMS norm's, g or 1 + w), read by fitting it
    on a probe where the norm's weights are; ones where there is no norm."""
    if norm is None:
        return torch.ones(hidden, dtype=torch.float64, device=device)
    # off 0 on average, so that a LayerNorm (which centres) and an RMS norm (which does not) differ by far more than
    # a half-precision module rounds its output
    probe = 2 + torch.randn(1, 1, hidden, generator=torch.Generator().manual_seed(0))
    parameter = next(norm.parameters(), None)
    probe = probe.to(parameter.device, parameter.dtype) if parameter is not None else probe
    return FrozenNorm(norm, probe, norm(probe)).gain.double().to(device)


def _value_rows(place, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """(heads, head_dim, hidden) float64: each query head's KV head's rows of the value projection."""
    if place.fused is not None:  # GPT-2's c_attn: q | k | v in one projection
        weight = linear_weight(place.fused).detach()[2 * heads * head_dim :]
    else:
        weight = linear_weight(place.v).detach()
    per_kv = weight.double().view(kv_heads, head_dim, -1)
    return per_kv[torch.arange(heads, device=per_kv.device) // (heads // kv_heads)]
