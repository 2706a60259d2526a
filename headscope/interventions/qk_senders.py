"""Each sender's part of a head's query and key, from one pass of a text (interventions.qk_terms has the maths).

The residual stream layer L reads is the sum of its senders' writes, named as `circuit` names them: `embed` (the
stream entering layer 0, learned positions included), each earlier head `l.h` (W_h z_h, through the layer's
post-attention norm where it has one, its scale frozen at the run), each earlier MLP `mlpl` (its output, after its
post-norm), and `bias` (the output projections' biases, through those post-norms). Layer L's input norm is linear
with its scale frozen at each position (model/norms.py: FrozenNorm); its bias joins `bias`. Each sender's
part of the query of head h is then W_Q^h N(x_a), through the q norm with its scale frozen where the model has one,
rotated by RoPE at its position where the model uses it; `bias` also takes W_Q^h's bias. The key side is the same
through the KV head h reads. Every step is linear once the scales are frozen, so the parts add up to the query and the
key the model computes (checked: their logits' softmax against the model's attention, qk_terms.RowTerms).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from headscope.errors import ConfigError
from headscope.interventions.edge_layers import circuit_places
from headscope.model.layers import LayerPlaces
from headscope.model.norms import NORM_CHECK, FrozenNorm
from headscope.model.projection import head_columns


@dataclass
class HeadSenders:
    """Head (layer, head) on one text: every sender's part of its query and of its key at every position."""

    layer: int
    head: int
    names: list[str]  # embed, l.h ..., mlpl ..., bias
    queries: torch.Tensor  # (senders, t, head_dim) float64
    keys: torch.Tensor  # (senders, t, head_dim) float64, through the KV head the head reads
    scaling: float
    softcap: float | None


@contextlib.contextmanager
def rotations(attentions: list[torch.nn.Module]) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """During a pass: layer -> the (cos, sin) its attention is handed (`position_embeddings`), where it is."""
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keeper(index: int):
        def keep(module, args, kwargs):
            given = kwargs.get("position_embeddings")
            if given is not None:
                found[index] = (given[0].detach(), given[1].detach())

        return keep

    handles = [a.register_forward_pre_hook(keeper(i), with_kwargs=True) for i, a in enumerate(attentions)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def head_senders(
    kept: dict,
    places: list[LayerPlaces],
    attentions: list[torch.nn.Module],
    rotation: dict[int, tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    head: int,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> HeadSenders:
    """Head (layer, head)'s senders on the one-text pass whose tensors `kept` holds (edges.Recorder's names). The
    writes are taken a layer at a time and projected at once: memory of (senders, t, head_dim), not (senders, t,
    hidden)."""
    place, attention = places[layer], attentions[layer]
    norm = _frozen(place.input_norm, kept["r"][layer], f"layer {layer}'s input norm")
    units = {"q": head, "k": head // (heads // kv_heads)}  # the query head, and the KV head it reads
    rows = {side: _rows(place, side, unit, head_dim, heads, kv_heads) for side, unit in units.items()}
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": []}
    names: list[str] = []
    stream = kept["r"][layer][0].detach().double()
    total = torch.zeros_like(stream)
    for block_names, block in residual_blocks(kept, places, layer, heads, head_dim):
        block = block.to(stream.device)  # a device map puts earlier layers elsewhere
        total += block.sum(0)
        normed = block if norm is None else norm(block)
        for side, (weight, _) in rows.items():
            parts[side].append(normed @ weight.T)
        names += block_names
    if (total - stream).abs().max() > NORM_CHECK * (stream.abs().max() + 1e-30):
        raise ConfigError(
            f"layer {layer}'s input is not the sum of the writes before it (attention beside the MLP, or a residual "
            "multiplier): headscope cannot split this model's attention logits yet"
        )
    sides = []
    for side, count in (("q", heads), ("k", kv_heads)):
        weight, projection_bias = rows[side]
        found = torch.cat(parts[side])  # (senders, t, head_dim); the last: `bias`
        found[-1] += projection_bias if norm is None else norm.bias @ weight.T + projection_bias
        found = _through_qk_norm(attention, side, found, kept, place, units[side], count, head_dim, layer)
        if layer in rotation:
            found = _rotated(found, *rotation[layer])
        sides.append(found)
    scaling = getattr(attention, "scaling", None)
    if scaling is None:
        raise ConfigError(f"{type(attention).__name__} names no `scaling`: headscope cannot split its logits")
    softcap = getattr(attention, "attn_logit_softcapping", None)
    # on the host: a few (senders, t, head_dim) tensors, read row by row against the attention kept there
    return HeadSenders(layer, head, names, sides[0].cpu(), sides[1].cpu(), float(scaling), softcap)


def residual_blocks(kept: dict, places: list[LayerPlaces], layer: int, heads: int, head_dim: int):
    """The writes of the senders before `layer`, a block at a time: (names, (n, t, hidden) float64). embed; per
    earlier layer its heads, then its MLP; last `bias`, the output projections' biases (through the post-attention
    norms) added up."""
    embed = kept["r"][0][0].detach().double()
    yield ["embed"], embed[None]
    bias = torch.zeros_like(embed)
    for earlier in range(layer):
        place = places[earlier]
        z = kept["z"][earlier][0].detach().double().view(-1, heads, head_dim)  # (t, heads, head_dim)
        columns = head_columns(place.output).double().to(z.device)  # (hidden, heads * head_dim)
        per_head = torch.einsum("thd,mhd->htm", z, columns.view(-1, heads, head_dim))
        output_bias = place.output.bias
        constant = torch.zeros(embed.shape, dtype=torch.float64, device=z.device)
        if output_bias is not None:
            constant = constant + output_bias.detach().double().to(z.device)
        if place.post_attention is not None:
            post = _frozen(place.post_attention, kept["attn"][earlier], f"layer {earlier}'s post-attention norm")
            per_head, constant = post(per_head), post(constant[None])[0] + post.bias
        bias = bias + constant.to(bias.device)
        yield [f"{earlier}.{h}" for h in range(heads)], per_head
        yield [f"mlp{earlier}"], kept["mlp"][earlier][0].detach().double()[None]
    yield ["bias"], bias[None]


def _frozen(norm: torch.nn.Module | None, at: torch.Tensor, what: str) -> FrozenNorm | None:
    """The norm as a linear map, its scale frozen at each position of `at` (1, t, width); calling it applies its
    linear part to (n, t, width) writes, its bias apart (`.bias`). None where there is no norm."""
    if norm is None:
        return None
    frozen = FrozenNorm.found(norm, at)
    if frozen is None:
        raise ConfigError(f"{what} ({type(norm).__name__}) is neither a LayerNorm nor an RMS norm: headscope cannot "
                          "freeze its scale to split the attention logits")  # fmt: skip
    return frozen


def _rows(place: LayerPlaces, side: str, unit: int, head_dim: int, heads: int, kv_heads: int):
    """(head_dim, hidden) float64 weight rows and (head_dim,) bias of query head (side q) or KV head (side k) `unit`."""
    if place.fused is not None:  # GPT-2's c_attn: q | k | v along its output features
        module, first = place.fused, (0 if side == "q" else heads * head_dim) + unit * head_dim
    else:
        module, first = (place.q if side == "q" else place.k), unit * head_dim
    weight = head_columns(module).double()[first : first + head_dim]
    if module.bias is None:
        return weight, torch.zeros(head_dim, dtype=torch.float64, device=weight.device)
    return weight, module.bias.detach().double()[first : first + head_dim].to(weight.device)


def _through_qk_norm(attention, side, parts, kept, place, unit, units, head_dim, layer) -> torch.Tensor:
    """The parts through the attention's q (or k) norm, its scale frozen at the run, where it has one (Gemma 3 and
    Qwen 3: per head; OLMo 2: over all heads); the norm's bias joins `bias` (the last part)."""
    norm = getattr(attention, f"{side}_norm", None)
    if norm is None or place.fused is not None:
        return parts
    projected = kept[side][layer].detach()  # (1, t, units * head_dim): what the norm reads
    width = getattr(norm, "weight", torch.empty(head_dim)).numel()
    features = slice(0, head_dim)
    if width == head_dim:  # per head: the norm reads this unit's slice alone
        projected = projected.view(1, projected.shape[1], units, head_dim)[:, :, unit]
    else:  # over every head: this unit's features of its gain and bias
        features = slice(unit * head_dim, (unit + 1) * head_dim)
    frozen = _frozen(norm, projected, f"layer {layer}'s {side} norm")
    if frozen.centre:
        raise ConfigError(f"layer {layer}'s {side} norm centres its input: headscope splits RMS q and k norms only")
    parts = parts * frozen.scale * frozen.gain[features]
    parts[-1] += frozen.bias[features]
    return parts


def _rotated(parts: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Llama applies it (rotate_half on the first cos.shape[-1] features; the rest pass unrotated)."""
    cos, sin = cos[0].double().to(parts.device), sin[0].double().to(parts.device)  # (t, rotary)
    rotary = cos.shape[-1]
    turned, kept = parts[..., :rotary], parts[..., rotary:]
    half = rotary // 2
    swapped = torch.cat([-turned[..., half:], turned[..., :half]], -1)
    return torch.cat([turned * cos + swapped * sin, kept], -1)


class SenderPass:
    """A model attached for splitting logits: where each layer's pieces sit (the model's description), and
    `run`: one pass of a text keeping the chosen heads' attention and what their senders need."""

    def __init__(self, capture, loaded, plan) -> None:
        from headscope.interventions.edges import Recorder  # its module loads circuit's passes: when asked

        architecture = plan.architecture
        self.heads, self.kv_heads, self.head_dim = (architecture[key] for key in ("heads", "kv_heads", "head_dim"))
        self.capture = capture
        model = loaded.lm or loaded.model
        self.places, final_norm = circuit_places(capture, loaded.device)
        self.attentions = [place.attention for place in self.places]
        self.recorder = Recorder(model, capture.decoder, self.places, final_norm)

    def run(self, batch, measures) -> tuple[dict, dict]:
        """One pass of a one-text `batch` with `measures` (HeadAttention): (kept tensors, RoPE per layer)."""
        with self.recorder.hooks() as kept, rotations(self.attentions) as rotation, torch.no_grad():
            self.capture.run(batch, measures=measures)
        return kept, rotation

    def senders(self, kept: dict, rotation: dict, layer: int, head: int) -> HeadSenders:
        return head_senders(kept, self.places, self.attentions, rotation, layer, head, heads=self.heads,
                            kv_heads=self.kv_heads, head_dim=self.head_dim)  # fmt: skip
