"""How each layer's attention output reaches the residual stream, learned from the model by one short pass.

In Llama, GPT-2 and most decoder models the attention's output o (its output projection's result) is added to the
residual stream as it is. Gemma 2 and 3, OLMo 2 and 3 and others first pass it through a norm (a *post-attention
norm*); Granite multiplies it by a constant (`residual_multiplier`), MiniCPM by scale_depth / sqrt(layers). What a
head adds to the residual stream is then

    added = scale * N(o)    with N(o) = g * o / rms(o) for an RMS norm (g its gain, per feature)

and head h's share of it, with the norm's 1/rms held at the row's value (the frozen-norm linearisation that
attribution work uses for layer norms), is scale * g * (W_h z_h) / rms(o): the shares add up over the layer's heads
to what the layer adds (less the output projection's bias, which belongs to no head).

Nothing is read off the class names (Llama's `post_attention_layernorm` is the norm *before the MLP*): a pass over a
few fixed tokens keeps every module's input and output, and
- a post-attention norm is a module whose input is the attention module's output tensor itself;
- the scale is read where the block adds the write to the residual stream: the next module whose input u is
  x + scale * write (x the residual stream entering the layer), scale fitted by least squares and checked. A block
  that adds attention and MLP together (parallel attention: GPT-J, Pythia, Phi, Falcon) has no such module; its
  write is added as it is (scale 1), and the path says it was not seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from headscope.errors import ModelLoadError
from headscope.model.projection import output_projection, projected

DRY_TOKENS = 8  # tokens of the pass that learns the paths: spread over the vocabulary, the same every run
PASS_THROUGH = (torch.nn.Dropout, torch.nn.Identity)  # hand the attention output on unchanged at inference
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


PLAIN = WritePath()


def learn_write_paths(
    model: torch.nn.Module, decoder: torch.nn.ModuleList, run, *, through: int, inputs: int
) -> list[WritePath]:
    """The WritePath of decoder layers 0 .. through - 1 (inputs: heads x head_dim, the output projection's inputs).

    run(input_ids): one forward pass of the model on (1, DRY_TOKENS) ids (the caller's, attached); it may stop once
    layer through - 1 has run (StopAfter is raised from its hook)."""
    ids = dry_ids(model.get_input_embeddings().num_embeddings)[None]
    seen: list[dict] = [{"inputs": [], "outputs": {}} for _ in range(through)]
    hooks = []
    for index in range(through):
        layer, kept = decoder[index], seen[index]
        attention, kept["projection"] = _attention_module(layer, inputs)
        kept["attention"] = attention
        inside = {id(m) for m in attention.modules()} if attention is not None else set()
        hooks.append(layer.register_forward_pre_hook(_keep_residual(kept), with_kwargs=True))
        for module in layer.modules():
            if module is layer or (id(module) in inside and module is not attention):
                continue
            hooks.append(module.register_forward_pre_hook(_keep_input(kept, module), with_kwargs=True))
            hooks.append(module.register_forward_hook(_keep_output(kept, module)))
        if index == through - 1:
            hooks.append(layer.register_forward_hook(_stop))
    try:
        run(ids)
    except StopAfter:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return [_path_of(index, kept) for index, kept in enumerate(seen)]


def dry_ids(vocab: int) -> torch.Tensor:
    """DRY_TOKENS token ids spread over a vocabulary of `vocab`: a short pass that learns where things sit."""
    return torch.linspace(1, vocab - 1, DRY_TOKENS).long().unique()


class StopAfter(Exception):
    """Raised after the last layer whose path is wanted."""


def _stop(module, args, output):
    raise StopAfter


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def _keep_residual(kept: dict):
    def keep(module, args, kwargs):
        kept["residual"] = _first_tensor(args, kwargs)

    return keep


def _keep_input(kept: dict, module: torch.nn.Module):
    def keep(_, args, kwargs):
        tensor = _first_tensor(args, kwargs)
        if tensor is not None:
            kept["inputs"].append((module, tensor))

    return keep


def _keep_output(kept: dict, module: torch.nn.Module):
    def keep(_, args, output):
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            output = output[0]
        if isinstance(output, torch.Tensor):
            kept["outputs"][id(module)] = output

    return keep


def _attention_module(layer: torch.nn.Module, inputs: int) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The layer's attention module and its output projection (headscope.model.projection finds it), or Nones for a
    layer it finds none in (its path is then the plain one)."""
    try:
        name, projection = output_projection(layer, inputs)
    except ModelLoadError:
        return None, None
    return layer.get_submodule(name.rpartition(".")[0]), projection


def _path_of(index: int, kept: dict) -> WritePath:
    attention = kept["attention"]
    residual = kept.get("residual")
    written = kept["outputs"].get(id(attention)) if attention is not None else None
    if written is None or residual is None:  # a layer the pass did not reach, or no attention module found
        return PLAIN
    post_norm, written = _post_norm(kept, attention, written)
    gain = projection = None
    if post_norm is not None:
        gain = norm_gain(post_norm, written.shape[-1], written.device, index)
        projection = kept["projection"]
    scale, found = _residual_scale(kept["inputs"], residual, written, exclude=(attention, post_norm))
    return WritePath(post_norm, projection, gain, scale, found)


def _post_norm(kept: dict, attention: torch.nn.Module, written: torch.Tensor):
    """(the norm the attention output goes through next, or None; what the layer then adds): followed through
    modules that hand it on unchanged (dropout at inference, identities)."""
    passed = [attention]
    while True:
        taker = next((m for m, tensor in kept["inputs"] if tensor is written and all(m is not p for p in passed)), None)
        if taker is None:
            return None, written
        passed.append(taker)
        given = kept["outputs"].get(id(taker))
        if isinstance(taker, PASS_THROUGH) or given is written:
            if given is None:
                return None, written
            written = given
            continue
        if "norm" in type(taker).__name__.lower() and given is not None:
            return taker, given
        return None, written  # something else reads it first (not a norm): it is added as the attention wrote it


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


def _residual_scale(inputs, residual: torch.Tensor, written: torch.Tensor, exclude) -> tuple[float, bool]:
    """(scale, seen): the first module input u = residual + scale * written, in the order the modules ran."""
    x, w = residual.double(), written.double()
    w_norm = float(w.square().sum())
    if w_norm == 0:
        return 1.0, False
    # What rounding in the model's dtype may leave of u - x - scale * w: a few steps of its epsilon, relative to u.
    eps = torch.finfo(residual.dtype).eps if residual.dtype.is_floating_point else 0.0
    for module, tensor in inputs:
        if any(module is other for other in exclude) or tensor is residual or tensor.shape != residual.shape:
            continue
        added = tensor.double() - x
        added_norm = float(added.norm())
        if added_norm == 0:
            continue
        scale = float((added * w).sum()) / w_norm
        left = float((added - scale * w).norm())
        if left <= 1e-4 * added_norm + 8 * eps * float(tensor.double().norm()):
            return _snapped(scale), True
    return 1.0, False


def _snapped(scale: float) -> float:
    """1.0 for a scale within float32 rounding of it (the plain add, whatever batch or dtype measured it)."""
    return 1.0 if math.isclose(scale, 1.0, rel_tol=1e-5) else scale


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
