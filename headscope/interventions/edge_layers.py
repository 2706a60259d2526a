"""Where each decoder layer's pieces sit for `circuit`, found from the data flow of one pass, and the norms' maps.

A layer reads the residual stream r and adds its attention's and its MLP's outputs to it:

    h      = r + P_attn(o)           o: the output projection's result (every head's W_h z_h, and its bias)
    r_next = h + P_mlp(mlp(N_mlp(h)))

with N_in (the norm q, k and v read: N_in(r)) and N_mlp the input norms, and P_attn, P_mlp post-norms where the
model has them (Gemma 2 and 3, OLMo 2), the identity where not (GPT-2, Llama). A model without input norms (OLMo 2)
reads r and h themselves. Nothing is read off module names (Llama's `post_attention_layernorm` is its N_mlp): a
norm is the module whose output a projection reads, a post-norm the layer's module that reads the output
projection's (or the MLP's) output tensor itself. EdgeModel checks h and r_next on every clean pass, and refuses
what differs (attention beside the MLP, as in GPT-J; a residual multiplier, as in Granite).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headscope.errors import ModelLoadError
from headscope.model.batch import collate
from headscope.model.projection import linear_weight, output_projection

# Relative error up to which a linearised norm must reproduce the model's own (float32 rounding of a norm).
NORM_CHECK = 1e-4
PASS_THROUGH = (torch.nn.Dropout, torch.nn.Identity)  # hand a tensor on unchanged at inference


@dataclass(frozen=True)
class LayerPlaces:
    """A decoder layer's pieces: its attention's q, k, v projections (or one fused q|k|v projection), output
    projection and MLP; the norms q, k and v and the MLP read through (None: the stream itself); its post-norms."""

    q: torch.nn.Module | None
    k: torch.nn.Module | None
    v: torch.nn.Module | None
    fused: torch.nn.Module | None
    output: torch.nn.Module
    mlp: torch.nn.Module
    input_norm: torch.nn.Module | None = None
    mlp_norm: torch.nn.Module | None = None
    post_attention: torch.nn.Module | None = None
    post_mlp: torch.nn.Module | None = None

    @property
    def reads(self) -> torch.nn.Module:
        """The projection whose input is what the attention reads."""
        return self.fused if self.fused is not None else self.q


def attention_module(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's attention module, by its name (`self_attn`, `attn` or `attention`), or None."""
    names = dict(layer.named_modules())
    return next((m for n, m in names.items() if n.rpartition(".")[2] in ("self_attn", "attn", "attention")), None)


def layer_modules(layer: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> LayerPlaces:
    """A decoder layer's projections and MLP (its norms unknown: find_places finds them from a pass)."""
    attention = attention_module(layer)
    mlp = getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        raise ModelLoadError(f"{type(layer).__name__}: circuit finds no attention or no mlp module in a decoder layer")
    _, out = output_projection(layer, heads * head_dim)
    own = dict(attention.named_children())
    if all(name in own for name in ("q_proj", "k_proj", "v_proj")):
        return LayerPlaces(own["q_proj"], own["k_proj"], own["v_proj"], None, out, mlp)
    if "c_attn" in own and kv_heads == heads:  # GPT-2: one Conv1D computing q | k | v
        return LayerPlaces(None, None, None, own["c_attn"], out, mlp)
    raise ModelLoadError(
        f"{type(attention).__name__}: circuit reads q_proj, k_proj and v_proj (or GPT-2's c_attn); this attention "
        "has neither"
    )


def _storage(tensor) -> int | None:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None


def _first(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))


def find_places(capture, model, decoder, heads: int, kv_heads: int, head_dim: int, ids: list[int], device):
    """([LayerPlaces] per decoder layer, the final norm), found by one pass on `ids`; `model` a causal LM, or a base
    model without its LM head."""
    places = [layer_modules(layer, heads, kv_heads, head_dim) for layer in decoder]
    made, taken, seen, handles = {}, [], {}, []

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

    for index, (layer, place) in enumerate(zip(decoder, places, strict=True)):
        handles.append(layer.register_forward_pre_hook(keep(("r", index), output=False), with_kwargs=True))
        for child in layer.children():
            handles.append(child.register_forward_hook(remember))
            handles.append(child.register_forward_pre_hook(reads, with_kwargs=True))
        handles.append(place.mlp.register_forward_pre_hook(keep(("mlp in", index), output=False), with_kwargs=True))
        handles.append(place.mlp.register_forward_hook(keep(("mlp out", index), output=True)))
        handles.append(place.reads.register_forward_pre_hook(keep(("attn in", index), output=False), with_kwargs=True))
        handles.append(place.output.register_forward_hook(keep(("attn out", index), output=True)))
    head = model.get_output_embeddings()
    for module in model.modules():
        if module is not head and not any(module is layer for layer in decoder) and len(list(module.children())) == 0:
            handles.append(module.register_forward_hook(remember))
    if head is not None:  # the final norm makes what the LM head reads
        handles.append(head.register_forward_pre_hook(keep(("head", 0), output=False), with_kwargs=True))
    else:  # a base model (no LM head loaded): the final norm makes its output

        def ends(module, args, output):
            value = getattr(output, "last_hidden_state", None)
            value = output[0] if value is None and isinstance(output, tuple) else value
            seen[("head", 0)] = (_storage(value), value)

        handles.append(model.register_forward_hook(ends))
    try:
        capture.run(collate([0], [ids]).to(device))
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

    found = []
    for index, (layer, place) in enumerate(zip(decoder, places, strict=True)):
        if seen.get(("attn in", index), (None,))[0] == seen.get(("r", index), (0,))[0]:
            input_norm = None  # the projections read the stream itself (OLMo 2)
        else:
            input_norm = producer(("attn in", index))
            if input_norm is None:
                raise ModelLoadError(
                    f"layer {index}'s attention reads no norm of the residual stream; circuit cannot place its inputs"
                )
        mlp_norm = producer(("mlp in", index))
        if mlp_norm is place.mlp:
            raise ModelLoadError(f"layer {index}'s MLP reads its own output; circuit cannot place it")
        found.append(LayerPlaces(place.q, place.k, place.v, place.fused, place.output, place.mlp, input_norm,
                                 mlp_norm, taker(("attn out", index), layer, place),
                                 taker(("mlp out", index), layer, place)))  # fmt: skip
    final = producer(("head", 0))
    if final is None:
        raise ModelLoadError(
            "the LM head (or the model's output) is no final norm's output; headscope cannot place the logits' input"
        )
    return found, final


def head_columns(projection: torch.nn.Module) -> torch.Tensor:
    """(hidden, inputs) float32 weight of a Linear or GPT-2 Conv1D."""
    return linear_weight(projection).detach().float()


def head_writes(z: torch.Tensor, columns: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """(heads, rows, t, hidden) float32: each head's output z (rows, t, heads * head_dim) through its columns of the
    output projection (hidden, heads * head_dim), no bias."""
    rows, t = z.shape[:2]
    per_head = z.detach().float().view(rows, t, heads, head_dim)
    return torch.einsum("rthd,mhd->hrtm", per_head, columns.view(-1, heads, head_dim))


def project(module: torch.nn.Module, x: torch.Tensor, features: list[slice]) -> torch.Tensor:
    """(n, ..., width) each x[i] (n, ..., hidden) through the output features features[i] (each `width` wide) of a
    q, k or v projection, by hand (calling the module would run its hooks again): a Linear, or GPT-2's Conv1D."""
    weight, bias = linear_weight(module), module.bias
    rows = torch.stack([weight[chosen] for chosen in features])  # (n, width, hidden)
    out = torch.einsum("n...h,nwh->n...w", x, rows)
    if bias is not None:
        out = out + torch.stack([bias[chosen] for chosen in features]).view(len(features), *[1] * (x.dim() - 2), -1)
    return out


def through(norm: torch.nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    """norm(x), or x where there is no norm."""
    return x if norm is None else norm(x)


class FrozenNorm:
    """A norm as a linear map, its scale frozen at the rows it was given: LayerNorm's g (x - mean x) / sigma or an
    RMS norm's g x / rms (g or 1 + w, whichever reproduces the module), its bias kept apart; and its full Jacobian
    there, transposed (`back`)."""

    @classmethod
    def found(cls, norm: torch.nn.Module, residual: torch.Tensor) -> FrozenNorm | None:
        """The norm at every row of `residual` (its form told by the first row, its scale kept in float32 for
        `back`), or None for a norm of neither form."""
        first = residual.detach()[:1]
        with torch.no_grad():
            try:
                frozen = cls(norm, first, norm(first))
            except ModelLoadError:
                return None
        frozen.x = residual.detach().float()
        if frozen.centre:
            frozen.x = frozen.x - frozen.x.mean(-1, keepdim=True)
        frozen.scale = frozen.x.square().mean(-1, keepdim=True).add(frozen.eps).rsqrt()
        return frozen

    def __init__(self, norm: torch.nn.Module, residual: torch.Tensor, output: torch.Tensor) -> None:
        x = residual.detach().double()
        want = output.detach().double()
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        self.eps = eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        w = torch.ones(x.shape[-1], dtype=torch.float64) if weight is None else weight.detach().double().cpu()
        w = w.to(x.device)
        b = torch.zeros_like(w) if bias is None else bias.detach().double().to(x.device)
        centred = x - x.mean(-1, keepdim=True)
        candidates = {
            "layer": (True, w, centred.square().mean(-1, keepdim=True).add(eps).rsqrt()),
            "rms": (False, w, x.square().mean(-1, keepdim=True).add(eps).rsqrt()),
            "rms 1 + w": (False, 1 + w, x.square().mean(-1, keepdim=True).add(eps).rsqrt()),
        }
        # a module computing in bfloat16 or float16 rounds what it gives to its dtype: the check allows that much
        tolerance = max(NORM_CHECK, 8 * torch.finfo(output.dtype).eps) if output.is_floating_point() else NORM_CHECK
        for centre, gain, scale in candidates.values():
            got = (centred if centre else x) * scale * gain + b
            if (got - want).abs().max() <= tolerance * want.abs().max() + 1e-30:
                self.centre, self.gain, self.scale, self.bias = centre, gain, scale, b
                self.x = centred if centre else x  # the input less its mean, for a LayerNorm
                return
        raise ModelLoadError(
            f"circuit cannot linearise a norm ({type(norm).__name__}): neither a LayerNorm nor an RMS norm"
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, n, hidden), writes at the one position per row the scale was frozen at; or, for a norm found at
        one row of t positions, (n, t, hidden) writes at each of them."""
        x = x.double()
        if self.centre:
            x = x - x.mean(-1, keepdim=True)
        return x * self.scale * self.gain

    def back(self, grads: torch.Tensor) -> torch.Tensor:
        """(rows, t, n, hidden): each of `grads` (rows, t, n, hidden), gradients at the norm's output (x: rows, t,
        hidden), carried back to its input through the full Jacobian: with u = g * grad (less its mean, for a
        LayerNorm), c = x (less its mean) and s the scale, s u - s^3 c mean(u c). In the dtype of the rows it was
        found at."""
        c, s = self.x[..., None, :], self.scale[..., None, :]
        u = grads.to(c.dtype) * self.gain.to(c.dtype)
        if self.centre:
            u -= u.mean(-1, keepdim=True)
        along = torch.linalg.vecdot(u, c)[..., None] / c.shape[-1]  # mean(u c)
        return u.mul_(s).sub_(along * (s**3 * c))


def norm_jvp(norm: torch.nn.Module, at: torch.Tensor, changes: torch.Tensor) -> torch.Tensor:
    """(n, *at.shape) float32: the norm's Jacobian at `at` (rows, t, hidden) times each of `changes` (n, rows, t,
    hidden): what each change, alone, would change the norm's output by, to first order."""
    point = at.detach().float().expand_as(changes).contiguous()
    with torch.enable_grad():
        _, moved = torch.func.jvp(lambda x: norm(x).float(), (point,), (changes.float(),))
    return moved.detach()


def norm_back(norm: torch.nn.Module | None, x: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """(rows, t, n, hidden) float32: each of `grads` (rows, t, n, hidden), gradients at norm(x) (x: rows, t, hidden),
    carried back to x: by the Jacobian of a LayerNorm or an RMS norm, any other norm run again on n copies of x (one
    backward); as they are where there is no norm."""
    if norm is None:
        return grads.float()
    known = FrozenNorm.found(norm, x)
    if known is not None:
        return known.back(grads)
    with torch.enable_grad():
        copies = x.detach()[:, :, None].expand(grads.shape).contiguous().requires_grad_()
        normed = norm(copies)
        (back,) = torch.autograd.grad(normed, copies, grad_outputs=grads.to(normed.dtype))
    return back.float()
