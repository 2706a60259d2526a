"""Each decoder layer's pieces as `circuit` reads them: its places, each head's writes, a projection's features.

Where the pieces sit is the model's one description (model/layers.py: q, k, v, output projection and MLP, the input
norms N_in and N_mlp, the post-norms P_attn and P_mlp, the residual scale), found once per model; `circuit_places`
takes it, refusing a layer it cannot place. EdgeModel checks h = r + P_attn(o) and r_next = h + P_mlp(mlp(N_mlp(h)))
on every clean pass, and refuses what differs (attention beside the MLP, as in GPT-J; a residual multiplier, as in
Granite).
"""

from __future__ import annotations

import torch

from headscope.errors import ConfigError
from headscope.model.layers import LayerPlaces
from headscope.model.projection import linear_weight


def circuit_places(capture, device, *, plain_residual: bool = False) -> tuple[list[LayerPlaces], torch.nn.Module]:
    """Every decoder layer's places and the final norm, from the model's one description (capture.layer_map), or one
    line saying what circuit cannot place. plain_residual: refuse, before any pass, a layer whose attention is not
    added to the stream as it is (a residual multiplier, or attention beside the MLP): the graph's reading of h."""
    layers, final_norm = capture.layer_map(device).placed()
    for index, place in enumerate(layers if plain_residual else ()):
        if not place.seen:
            raise ConfigError(f"layer {index} adds its attention in parallel with the MLP (no module reads r + "
                              "attention): circuit does not take this architecture yet")  # fmt: skip
        if place.scale != 1.0:
            raise ConfigError(f"layer {index} adds its attention x {place.scale:g} (a residual multiplier): circuit "
                              "does not take this architecture yet")  # fmt: skip
    return layers, final_norm


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
