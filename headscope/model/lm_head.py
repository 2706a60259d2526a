"""The LM head a command wants: is it in the checkpoint, and does a device map place it?

A causal LM whose checkpoint holds no LM-head weights gets a random head from transformers: a loss through it would
be noise, different on every run. Head importance refuses such a checkpoint; the dormant label's check does without
(headscope.model.loading's "if-present").
"""

from __future__ import annotations

from headscope.errors import ConfigError, ModelLoadError
from headscope.model.placement import check_device_map


def maps_lm(config, display: str, dtype, device_map, offload_folder) -> bool:
    """Does `device_map` place the causal LM's modules (rather than the base model's)?"""
    try:
        check_device_map(config, display, dtype, device_map, offload_folder, lm_head=True)
    except ConfigError:
        return False
    return True


def _missing_head_weights(network, loading_info: dict) -> list[str]:
    """The LM head's weight names that the checkpoint did not hold (transformers filled them in at random)."""
    head = network.get_output_embeddings()
    names = [f"{name}.weight" for name, module in network.named_modules() if module is head]
    return [name for name in names if name in loading_info.get("missing_keys", ())]


def lm_head_missing(network, loading_info: dict) -> bool:
    return bool(_missing_head_weights(network, loading_info))


def check_lm_head(network, loading_info: dict, display: str) -> None:
    """Refuse a causal LM whose checkpoint holds no weights for its LM head: transformers initialises a random one,
    and a loss (head importance) through it would be noise, different on every run."""
    missing = _missing_head_weights(network, loading_info)
    if missing:
        raise ModelLoadError(
            f"{display} holds no weights for its LM head ({missing[0]}: a base-model checkpoint?); head importance "
            "needs the model's own next-token predictions: use the causal LM's checkpoint, or drop --importance"
        )
