"""Removed heads written into the weights: each removed head's columns of its layer's output projection zeroed,
and in mean mode its constant output folded into that projection's bias, so that a plain transformers forward pass
of the saved checkpoint computes exactly the pruned model.

The output projection takes the concatenated head outputs (t, heads * head_dim) to the residual stream; head h
owns input features h * head_dim ... (h + 1) * head_dim. With W_h those columns and m_h the head's mean output,
    W x + b  with x_h := m_h   ==   W' x + (b + W_h m_h),   W' = W with W_h zeroed.
A model whose projection has no bias gets one where its config can say so (`attention_bias`, as Llama's); there it
also gives the attention's other projections zero biases, which change nothing.

`check_savable` refuses, before any search, what `save` could only find out at the end: a model whose projections
cannot take a bias (mean mode), weights still packed in GGUF blocks, a disk that cannot hold the checkpoint.
A GGUF model de-quantized on loading is saved as its float weights (`model.gguf_cache.plain_checkpoint`).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from headscope.errors import ConfigError, ResourceError
from headscope.interventions.removal import Removal
from headscope.model.capture import decoder_layers
from headscope.model.memory import readable
from headscope.model.projection import output_projection


@contextlib.contextmanager
def pruned_weights(
    model: torch.nn.Module, heads: Sequence[tuple[int, int]], removal: Removal, *, head_count: int, head_dim: int
) -> Iterator[None]:
    """Within the block, `model` (a causal LM) computes the pruned model: `heads` removed as `removal` says, folded
    into the weights (Removal.fold). The weights (and config) are put back on leaving."""
    decoder = decoder_layers(model)
    saved, added = [], []
    attention_bias = getattr(model.config, "attention_bias", None)
    try:
        with torch.no_grad():
            projections = {i: output_projection(decoder[i], head_count * head_dim) for i in {h[0] for h in heads}}
            if removal.mode == "mean" and any(module.bias is None for _, module in projections.values()):
                added = _add_biases(model, decoder, head_count * head_dim)
            for layer_index, (_, projection) in sorted(projections.items()):
                saved.append((projection, projection.weight.detach().clone(), _bias_copy(projection)))
                removed = sorted(head for layer, head in heads if layer == layer_index)
                removal.fold(projection, layer_index, removed, head_dim)
        yield
    finally:
        with torch.no_grad():
            for projection, weight, bias in saved:
                projection.weight.copy_(weight)
                if bias is not None:
                    projection.bias.copy_(bias)
        for module in added:
            module.register_parameter("bias", None)
        if attention_bias is not None:
            model.config.attention_bias = attention_bias


def _bias_copy(module: torch.nn.Module) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach().clone()


def _add_biases(model: torch.nn.Module, decoder, inputs: int) -> list[torch.nn.Module]:
    """Give every layer's attention linear maps zero biases (the config's `attention_bias` gives them all one on
    loading), where the config can say so; returns the modules changed."""
    _check_bias(model)
    model.config.attention_bias = True
    changed = []
    for layer in decoder:
        name, _ = output_projection(layer, inputs)
        for module in layer.get_submodule(name.rpartition(".")[0]).modules():
            if isinstance(module, torch.nn.Linear) and module.bias is None:
                weight = module.weight
                module.bias = torch.nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
                changed.append(module)
    return changed


def _check_bias(model: torch.nn.Module) -> None:
    if getattr(model.config, "attention_bias", None) is None:
        raise ConfigError(
            f"mean removal folds each head's mean into its output projection's bias, and {type(model).__name__}'s "
            "output projections have none its config can add: save with --mode zero"
        )


# Headroom over the weights' own bytes for what else a checkpoint folder holds (config, tokenizer, index).
SAVE_HEADROOM = 64 * 2**20


def check_savable(model: torch.nn.Module, folder: Path, *, mean: bool, head_count: int, head_dim: int) -> None:
    """Refuse, before any search, a pruned checkpoint that could not be written into `folder`."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and getattr(quantizer, "packed_modules", None):
        raise ConfigError(
            f"--save-model: {type(model).__name__} keeps its GGUF weights packed (transformers' GGUF kernels), "
            "which cannot be edited or saved; load it de-quantized (without the `kernels` package) to save it"
        )
    if mean:
        decoder = decoder_layers(model)
        if any(output_projection(layer, head_count * head_dim)[1].bias is None for layer in decoder):
            _check_bias(model)
    needed = sum(p.numel() * p.element_size() for p in model.parameters()) + SAVE_HEADROOM
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise ResourceError(
            f"--save-model {folder}: the pruned checkpoint needs about {readable(needed)}, and {existing} has "
            f"{readable(free)} free"
        )
