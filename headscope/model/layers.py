"""One description of a model's decoder layers, found once per model from the data flow of one short pass.

A layer reads the residual stream r and adds its attention's and its MLP's outputs to it:

    h      = r + scale * P_attn(o)          o: the output projection's result (every head's W_h z_h, and its bias)
    r_next = h + P_mlp(mlp(N_mlp(h)))

with N_in (the norm q, k and v read: N_in(r)) and N_mlp the input norms, P_attn and P_mlp post-norms where the model
has them (Gemma 2 and 3, OLMo 2), the identity where not (GPT-2, Llama), and `scale` a residual multiplier (Granite's
residual_multiplier, MiniCPM's scale_depth / sqrt(layers); 1 elsewhere). A model without input norms (OLMo 2) reads r
and h themselves. A block that adds attention and MLP together (parallel attention: GPT-J, Pythia, Phi, Falcon) has
no h: no module reads r + scale * P_attn(o), and the description says so (`seen` False).

Nothing is read off module names but the projections' and the MLP's (Llama's `post_attention_layernorm` is its
N_mlp): a norm is the module whose output a projection reads, a post-norm the layer's module that reads the output
projection's (or the MLP's) output tensor itself, the scale what fits the first module input u = r + scale *
P_attn(o). Every measure and intervention reads this description: the writes measure (model/write_path.py),
circuit's edges, inspect --why's senders and the OV circuits (interventions/edge_layers.py's `circuit_places`),
patching's projections (`layer_modules`). The weights' orientation is model/projection.py's `linear_weight`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from headscope.errors import ModelLoadError
from headscope.model.projection import output_projection

PASS_THROUGH = (torch.nn.Dropout, torch.nn.Identity)  # hand a tensor on unchanged at inference
DRY_TOKENS = 8  # tokens of the pass that finds the description: spread over the vocabulary, the same every run


@dataclass(frozen=True)
class LayerPlaces:
    """A decoder layer's pieces: its attention module, its q, k, v projections (or one fused q|k|v projection),
    output projection and MLP; the norms q, k and v and the MLP read through (None: the stream itself); its
    post-norms; and how its attention's write reaches the residual stream (`scale`, `seen`). `unplaced`: why circuit
    cannot place the layer (None: it can)."""

    q: torch.nn.Module | None
    k: torch.nn.Module | None
    v: torch.nn.Module | None
    fused: torch.nn.Module | None
    output: torch.nn.Module | None
    mlp: torch.nn.Module | None
    input_norm: torch.nn.Module | None = None
    mlp_norm: torch.nn.Module | None = None
    post_attention: torch.nn.Module | None = None
    post_mlp: torch.nn.Module | None = None
    attention: torch.nn.Module | None = None
    scale: float = 1.0  # what multiplies P_attn(o) on its way into the residual stream
    seen: bool = False  # whether the pass saw the residual stream take r + scale * P_attn(o) (False: parallel)
    unplaced: str | None = None

    @property
    def reads(self) -> torch.nn.Module | None:
        """The projection whose input is what the attention reads."""
        return self.fused if self.fused is not None else self.q


@dataclass(frozen=True)
class LayerMap:
    """Layers 0 .. len(layers) - 1 described, and the final norm (what the LM head reads; None when the pass stopped
    before the end or none was found)."""

    layers: list[LayerPlaces]
    final_norm: torch.nn.Module | None = None
    whole: bool = False  # the pass ran to the model's output (the final norm was looked for)

    def placed(self) -> tuple[list[LayerPlaces], torch.nn.Module]:
        """(every layer's places, the final norm) for what reads every piece (circuit, the OV circuits, inspect
        --why's senders), or one line saying what cannot be placed."""
        unplaced = next((place.unplaced for place in self.layers if place.unplaced is not None), None)
        if unplaced is not None:
            raise ModelLoadError(unplaced)
        if self.final_norm is None:
            raise ModelLoadError(
                "the LM head (or the model's output) is no final norm's output; headscope cannot place the logits' "
                "input"
            )
        return self.layers, self.final_norm


def _attention_and_output(layer: torch.nn.Module, inputs: int) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """A decoder layer's attention module (the one holding its output projection) and that projection, which
    model/projection.py finds taking `inputs` = heads x head_dim features; Nones where it finds none."""
    try:
        name, out = output_projection(layer, inputs)
    except ModelLoadError:
        return None, None
    return (layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer), out


def layer_modules(layer: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> LayerPlaces:
    """A decoder layer's attention, projections and MLP, from the modules alone (the norms, post-norms and scale come
    from the pass: `describe_layers`). A layer whose pieces circuit cannot read says why in `unplaced`."""
    attention, out = _attention_and_output(layer, heads * head_dim)
    mlp = getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        reason = f"{type(layer).__name__}: headscope finds no attention or no mlp module in a decoder layer"
        return LayerPlaces(None, None, None, None, out, mlp, attention=attention, unplaced=reason)
    own = dict(attention.named_children())
    if all(name in own for name in ("q_proj", "k_proj", "v_proj")):
        return LayerPlaces(own["q_proj"], own["k_proj"], own["v_proj"], None, out, mlp, attention=attention)
    if "c_attn" in own and kv_heads == heads:  # GPT-2: one Conv1D computing q | k | v
        return LayerPlaces(None, None, None, own["c_attn"], out, mlp, attention=attention)
    reason = (f"{type(attention).__name__}: headscope reads q_proj, k_proj and v_proj (or GPT-2's c_attn); this "
              "attention has neither")  # fmt: skip
    return LayerPlaces(None, None, None, None, out, mlp, attention=attention, unplaced=reason)


def dry_ids(vocab: int) -> torch.Tensor:
    """DRY_TOKENS token ids spread over a vocabulary of `vocab`: a short pass that finds where things sit."""
    return torch.linspace(1, vocab - 1, DRY_TOKENS).long().unique()


class StopAfter(Exception):
    """Raised after the last layer to describe, when the pass need not reach the model's output."""


def _storage(tensor) -> int | None:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None


def _first(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    value = args[0] if args else kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else None


def describe_layers(
    model: torch.nn.Module,
    decoder: torch.nn.ModuleList,
    run: Callable[[torch.Tensor], object],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    through: int | None = None,
) -> LayerMap:
    """The LayerMap of decoder layers 0 .. through - 1 (default: all, and the final norm), found by one pass.

    run(input_ids): one forward pass of `model` (a causal LM, or a base model without its LM head) on (1,
    DRY_TOKENS) ids, through the caller's attachment; it stops after layer through - 1 (StopAfter) when `through`
    leaves layers out."""
    through = len(decoder) if through is None else through
    whole = through == len(decoder)
    statics = [layer_modules(decoder[index], heads, kv_heads, head_dim) for index in range(through)]
    made, taken, seen, handles = {}, [], {}, []
    flows = [{"inputs": [], "outputs": {}} for _ in range(through)]

    def remember(module, args, output):
        # By storage: the LM head may read a view of the final norm's output (logits_to_keep slices it); the first
        # module to produce a storage made it (dropout and identity modules pass it on). Kept alive with the map,
        # so that no later tensor takes its storage.
        if isinstance(output, torch.Tensor):
            made.setdefault(_storage(output), (module, output))

    def reads(module, args, kwargs):
        value = _first(args, kwargs)
        if isinstance(value, torch.Tensor) and not isinstance(module, PASS_THROUGH):
            taken.append((module, _storage(value), value))

    def keep(key, *, output: bool):
        def hook(module, args, third):  # third: a pre-hook's kwargs, or a hook's output
            value = (third[0] if isinstance(third, tuple) else third) if output else _first(args, third)
            seen[key] = (_storage(value), value)

        return hook

    def flow_input(flow: dict, module: torch.nn.Module):
        def hook(_, args, kwargs):
            tensor = _first_tensor(args, kwargs)
            if tensor is not None:
                flow["inputs"].append((module, tensor))

        return hook

    def flow_output(flow: dict, module: torch.nn.Module):
        def hook(_, args, output):
            if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                output = output[0]
            if isinstance(output, torch.Tensor):
                flow["outputs"][id(module)] = output

        return hook

    def stop(module, args, output):
        raise StopAfter

    for index in range(through):
        layer, place, flow = decoder[index], statics[index], flows[index]
        handles.append(layer.register_forward_pre_hook(keep(("r", index), output=False), with_kwargs=True))
        for child in layer.children():
            handles.append(child.register_forward_hook(remember))
            handles.append(child.register_forward_pre_hook(reads, with_kwargs=True))
        inside = {id(m) for m in place.attention.modules()} if place.attention is not None else set()
        for module in layer.modules():  # what the write path follows: all but the attention's insides
            if module is layer or (id(module) in inside and module is not place.attention):
                continue
            handles.append(module.register_forward_pre_hook(flow_input(flow, module), with_kwargs=True))
            handles.append(module.register_forward_hook(flow_output(flow, module)))
        if place.mlp is not None:
            handles.append(place.mlp.register_forward_pre_hook(keep(("mlp in", index), output=False), with_kwargs=True))
            handles.append(place.mlp.register_forward_hook(keep(("mlp out", index), output=True)))
        if place.reads is not None:
            handles.append(place.reads.register_forward_pre_hook(keep(("attn in", index), output=False),
                                                                 with_kwargs=True))  # fmt: skip
        if place.output is not None:
            handles.append(place.output.register_forward_hook(keep(("attn out", index), output=True)))
    if whole:
        head = model.get_output_embeddings()
        for module in model.modules():
            if module is not head and not any(module is layer for layer in decoder) and not list(module.children()):
                handles.append(module.register_forward_hook(remember))
        if head is not None:  # the final norm makes what the LM head reads
            handles.append(head.register_forward_pre_hook(keep(("head", 0), output=False), with_kwargs=True))
        else:  # a base model (no LM head loaded): the final norm makes its output

            def ends(module, args, output):
                value = getattr(output, "last_hidden_state", None)
                value = output[0] if value is None and isinstance(output, tuple) else value
                seen[("head", 0)] = (_storage(value), value)

            handles.append(model.register_forward_hook(ends))
    else:
        handles.append(decoder[through - 1].register_forward_hook(stop))
    try:
        run(dry_ids(model.get_input_embeddings().num_embeddings)[None])
    except StopAfter:
        pass
    finally:
        for handle in handles:
            handle.remove()

    def producer(key):
        found = made.get(seen[key][0]) if key in seen else None
        return None if found is None else found[0]

    def taker(key, layer, place):
        """The layer's own module (not the attention, not the MLP) that reads the tensor seen at `key`."""
        storage = seen.get(key, (None,))[0]
        children = [m for m in layer.children() if m is not place.mlp and place.output not in set(m.modules())]
        return next((m for m, s, _ in taken if s == storage and any(m is c for c in children)), None)

    described = []
    for index in range(through):
        layer, place = decoder[index], statics[index]
        unplaced = place.unplaced
        if seen.get(("attn in", index), (None,))[0] == seen.get(("r", index), (0,))[0]:
            input_norm = None  # the projections read the stream itself (OLMo 2)
        else:
            input_norm = producer(("attn in", index))
            if input_norm is None and unplaced is None:
                unplaced = f"layer {index}'s attention reads no norm of the residual stream; headscope cannot place it"
        mlp_norm = producer(("mlp in", index))
        if mlp_norm is not None and mlp_norm is place.mlp and unplaced is None:
            unplaced = f"layer {index}'s MLP reads its own output; headscope cannot place it"
        post_attention = taker(("attn out", index), layer, place) if place.output is not None else None
        post_mlp = taker(("mlp out", index), layer, place) if place.mlp is not None else None
        place = dataclasses.replace(place, input_norm=input_norm, mlp_norm=mlp_norm, post_attention=post_attention,
                                    post_mlp=post_mlp, unplaced=unplaced)  # fmt: skip
        scale, residual_seen = _write_scale(flows[index], seen.get(("r", index), (None, None))[1], place)
        described.append(dataclasses.replace(place, scale=scale, seen=residual_seen))
    return LayerMap(described, producer(("head", 0)) if whole else None, whole)


def _write_scale(flow: dict, residual: torch.Tensor | None, place: LayerPlaces) -> tuple[float, bool]:
    """(scale, seen) of what the layer adds from its attention (its post-norm's output, where it has one; the
    attention module's output where not): the first module input u = residual + scale * that write, in the order the
    modules ran (1.0, False: none, as under parallel attention, or a layer the pass did not reach)."""
    attention = place.attention
    written = flow["outputs"].get(id(attention)) if attention is not None else None
    norm = post_norm(place)
    if norm is not None:
        written = flow["outputs"].get(id(norm))
    if written is None or residual is None:
        return 1.0, False
    return _residual_scale(flow["inputs"], residual, written, exclude=(attention, norm))


def post_norm(place: LayerPlaces) -> torch.nn.Module | None:
    """The layer's post-attention module when it is a norm (by its class name); a module of another kind there (a
    per-feature scale) is not one whose gain splits the write between heads."""
    module = place.post_attention
    return module if module is not None and "norm" in type(module).__name__.lower() else None


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
