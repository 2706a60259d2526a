"""How each layer's attention output reaches the residual stream, learned from the model by one short pass.

In Llama, GPT-2 and most decoder models the attention's output o (its output projection's result) is added to the
residual stream as it is. Gemma 2 and 3, OLMo 2 and 3 and others first pass it through a norm (a *post-attention
norm*); Granite multiplies it by a constant (`residual_multiplier`), MiniCPM by scale_depth / sqrt(layers). What a
head adds to the residual stream is then

    added = scale * N(o)    with N(o) = g * o / rms(o) for an RMS norm (g its gain, per feature)

and head h's share of it, with the norm's 1/rms held at the row's value (the frozen-norm linearisation that
attribution work uses for layer norms), is scale * g * (W_h z_h) / rms(o): the shares add up over the layer's heads
to what the layer adds (less the output projection's bias, which belongs to no head).

The post-norm and the scale are the layer's description (model/layers.py, found once per model by a short pass):
the post-norm is the module that reads the output projection's output itself, the scale is read where the block adds
the write to the residual stream. A block that adds attention and MLP together (parallel attention: GPT-J, Pythia,
Phi, Falcon) has no such place; its write is added as it is (scale 1), and the path says it was not seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headscope.errors import ModelLoadError
from headscope.model.layers import LayerMap, post_norm
from headscope.model.projection import linear_weight, projected

GAIN_PROBE = 1e3  # N(c * 1) = g * c / sqrt(c^2 + eps) = g within float32 for any eps below ~1e-1


@dataclass(frozen=True)
class WritePath:
    """What a layer adds to the residual stream from its attention output o: scale * post_norm(o)."""

    post_norm: torch.nn.Module | None = None  # the norm o passes through first, or None
    projection: torch.nn.Module | None = None  # with a post-norm: the output projection that makes o
    gain: torch.Tensor | None = None  # (hidden,) float32: g of post_norm(o) = g * o / rms(o)
    scale: float = 1.0  # what multiplies it on its way into the residual stream
    seen: bool = False  # whether the learning pass saw the residual stream take exactly that

    def describe(self) -> str:
        """One line for run.json: "RMS post-norm Gemma2RMSNorm, x 1.0 (seen)"."""
        norm = f"post-norm {type(self.post_norm).__name__}" if self.post_norm is not None else "no post-norm"
        how = "seen in the residual stream" if self.seen else "not seen: attention and MLP added together"
        return f"{norm}, x {self.scale:g} ({how})"


def write_paths(layers: LayerMap, device: torch.device) -> list[WritePath]:
    """The WritePath of each layer the description holds (a post-norm's gain read on its weights' device, or on
    `device` where a device map keeps them elsewhere)."""
    paths = []
    for index, place in enumerate(layers.layers):
        norm, gain = post_norm(place), None
        if norm is not None:
            weights = next(norm.parameters(), None)
            at = weights.device if weights is not None and weights.device.type != "meta" else device
            gain = norm_gain(norm, linear_weight(place.output).shape[0], at, index)
        paths.append(WritePath(norm, place.output if norm is not None else None, gain, place.scale, place.seen))
    return paths


def norm_gain(norm: torch.nn.Module, hidden: int, device: torch.device, layer: int) -> torch.Tensor:
    """(hidden,) float32: the gain g of an RMS norm, N(o) = g * o / rms(o), read as N(c * 1) for a large c."""
    probe = torch.full((1, 1, hidden), GAIN_PROBE, device=device)
    with torch.inference_mode():
        gain = _apply(norm, probe)[0, 0]
    if not torch.isfinite(gain).all() or not gain.abs().gt(0).any():
        raise ModelLoadError(
            f"layer {layer}'s post-attention norm ({type(norm).__name__}) is not an RMS norm (g * o / rms(o)): "
            "headscope cannot split what it adds between the heads"
        )
    return gain


def _apply(norm: torch.nn.Module, o: torch.Tensor) -> torch.Tensor:
    """norm(o) in float32: most norms compute in float32 given it; one that insists on its weights' dtype is given
    that and its result widened."""
    try:
        return norm(o.float()).float()
    except RuntimeError:
        dtype = next(norm.parameters()).dtype
        return norm(o.to(dtype)).float()


def share_scale(path: WritePath, output: torch.Tensor, layer: int) -> torch.Tensor:
    """(batch, t) float32: what multiplies g * (W_h z_h) for head h's share of what row t adds, |scale| / rms(o(t))
    with o(t) the row's attention output; |scale| alone without a post-norm. output: (batch, t, heads, head_dim)."""
    batch, t = output.shape[:2]
    if path.post_norm is None:
        return output.new_full((batch, t), abs(path.scale), dtype=torch.float32)
    o = projected(path.projection, output.reshape(batch, t, -1))  # (batch, t, hidden) float32
    normalised = _apply(path.post_norm, o)
    gained = path.gain.to(o.device) * o
    # N(o) = (g * o) / rms(o): 1 / rms(o) by least squares over the features (exact for an RMS norm), checked
    inverse_rms = (normalised * gained).sum(-1) / gained.square().sum(-1).clamp(min=torch.finfo(torch.float32).tiny)
    left = (normalised - inverse_rms[..., None] * gained).norm(dim=-1)
    if bool((left > 1e-4 * normalised.norm(dim=-1) + 1e-30).any()):
        raise ModelLoadError(
            f"layer {layer}'s post-attention norm ({type(path.post_norm).__name__}) is not an RMS norm "
            "(g * o / rms(o)): headscope cannot split what it adds between the heads"
        )
    return inverse_rms * abs(path.scale)
