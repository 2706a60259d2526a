"""The attention's output projection, and what it makes of each head's output.

The output projection takes the concatenated head outputs (t, heads * head_dim) to the residual stream; head h owns
input features h * head_dim ... (h + 1) * head_dim, and writes W_h z_h (t) with W_h those columns.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from headscope.errors import ModelLoadError

OUTPUT_NAMES = ("o_proj", "c_proj", "out_proj", "dense", "wo")  # the output projection, by architecture


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """A projection's weight as torch.nn.Linear holds it, (out_features, in_features): a Linear's own, or a view of
    GPT-2's Conv1D weight, which is held (in, out). The one place headscope tells the two orientations apart; a view,
    so that what is written into it lands in the module's weight."""
    weight = module.weight
    return weight.T if type(module).__name__ == "Conv1D" else weight


def head_columns(projection: torch.nn.Module) -> torch.Tensor:
    """(hidden, inputs) float32 weight of a Linear or GPT-2 Conv1D."""
    return linear_weight(projection).detach().float()


def output_projection(layer: torch.nn.Module, inputs: int) -> tuple[str, torch.nn.Module]:
    """The attention's output projection in a decoder layer (or an attention module): a linear map named like one,
    inside a module named like attention (or directly in the attention module given), taking `inputs`
    (heads * head_dim) features. Returns (its name in `layer`, the module)."""
    for name, module in layer.named_modules():
        parent, _, own = name.rpartition(".")
        attention = "att" in parent.lower() or (not parent and "att" in type(layer).__name__.lower())
        if own in OUTPUT_NAMES and attention and _in_features(module) == inputs:
            return name, module
    raise ModelLoadError(
        f"{type(layer).__name__} has no output projection headscope recognises ({', '.join(OUTPUT_NAMES)})"
    )


def _in_features(module: torch.nn.Module) -> int | None:
    """A Linear's or a Conv1D's input features (None for anything else, which is no projection)."""
    if not isinstance(module, torch.nn.Linear) and type(module).__name__ != "Conv1D":
        return None
    return linear_weight(module).shape[1]


# projection module -> (its weight's version, its grams): the weights rarely change between runs on one model, and
# forming the grams costs a product over the whole projection.
_GRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_grams(attention: torch.nn.Module, heads: int, head_dim: int, gain: torch.Tensor | None = None) -> torch.Tensor:
    """(heads, head_dim, head_dim) float32: W_h^T W_h for each head's columns W_h of the output projection, so that
    ||W_h z||^2 = z^T (W_h^T W_h) z costs head_dim^2, not head_dim x hidden, per row. Formed in float64. With
    `gain` (hidden,), a post-attention norm's: W_h^T diag(g^2) W_h, so that the product is ||g * (W_h z)||^2.

    Weights a device map keeps off the device (on the disk, or on the CPU for a GPU layer) are brought in for the
    product, as accelerate brings them in for the forward pass."""
    _, projection = output_projection(attention, heads * head_dim)
    weight = projection.weight
    # Weights a device map brings in for each pass (disk offload: inference tensors, with no version counter, new
    # each time) may differ next time: formed afresh, never cached.
    cacheable = weight.device.type != "meta" and not weight.is_inference()
    version = (weight._version, weight.data_ptr(), weight.device, gain is not None) if cacheable else None
    cached = _GRAMS.get(projection)
    if cacheable and cached is not None and cached[0] == version:
        return cached[1]
    with _weights_present(projection):
        columns = linear_weight(projection).detach()  # (hidden, heads * head_dim)
        if gain is not None:
            columns = columns.double() * gain.to(columns.device, torch.float64)[:, None]
        per_head = columns.double().reshape(columns.shape[0], heads, head_dim)
        grams = torch.einsum("mhd,mhe->hde", per_head, per_head).float()
    if cacheable:
        _GRAMS[projection] = (version, grams)
    return grams


def projected(projection: torch.nn.Module, flat: torch.Tensor) -> torch.Tensor:
    """(batch, t, hidden) float32: the output projection of (batch, t, heads * head_dim) head outputs, its bias
    included, computed in float32 whatever the model's dtype."""
    with _weights_present(projection), torch.inference_mode():
        columns = linear_weight(projection).detach()  # (hidden, heads * head_dim)
        o = flat.float() @ columns.to(flat.device, torch.float32).T
        bias = getattr(projection, "bias", None)
        return o if bias is None else o + bias.detach().to(flat.device, torch.float32)


@contextlib.contextmanager
def _weights_present(module: torch.nn.Module):
    if module.weight.device.type != "meta":
        yield
        return
    from accelerate.utils import align_module_device  # only device-mapped models keep weights on the meta device

    with align_module_device(module):
        yield
