"""Which model a report was measured on, and whether a loaded model is that one.

A report's roles name heads by (layer, head); read into another model they name that model's heads, which do
something else. A model is identified by its architecture (depth, heads, KV heads, head size), its weights (a
fingerprint: a hash of evenly spaced values of its first parameters, in the dtype it was loaded in) and, where the
weights cannot be compared (loaded in another dtype, a report from before fingerprints), where it came from (its
source and revision). The same weights loaded from a copy in another folder are the same model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from headscope.errors import ConfigError
from headscope.placement import dtype_name

FINGERPRINT_PARAMETERS = 4  # the first parameters (embeddings, the first layer's): on the first device of a map
FINGERPRINT_SAMPLES = 256  # values per parameter, evenly spaced over it


def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """sha256 of the names, shapes and FINGERPRINT_SAMPLES evenly spaced values of the model's first
    FINGERPRINT_PARAMETERS parameters that hold values (None when none do: every weight offloaded)."""
    digest, hashed = hashlib.sha256(), 0
    for name, parameter in model.named_parameters():
        if parameter.device.type == "meta" or parameter.numel() == 0:
            continue  # offloaded to disk by a device map: its values are not here
        flat = parameter.detach().reshape(-1)
        count = min(FINGERPRINT_SAMPLES, flat.numel())
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)  # exact integers
        values = flat[index].float().cpu()  # exact for float32, bfloat16 and float16 weights
        digest.update(f"{name}{tuple(parameter.shape)}".encode())
        digest.update(values.numpy().tobytes())
        hashed += 1
        if hashed == FINGERPRINT_PARAMETERS:
            break
    return digest.hexdigest() if hashed else None


def model_identity(loaded) -> dict:
    """What run.json records to identify the model (loaded: headscope.loading.LoadedModel)."""
    return {"weights_sha256": weights_fingerprint(loaded.model), "weights_dtype": dtype_name(loaded.dtype)}


def check_report_model(run: dict, loaded, report: Path | str, option: str = "--report") -> None:
    """Refuse a report (its run.json, `run`) that was measured on another model than `loaded`."""
    recorded = run.get("model") if isinstance(run.get("model"), dict) else {}
    name = recorded.get("input", "?")
    architecture = recorded.get("architecture")
    if architecture != loaded.architecture:
        raise ConfigError(
            f"{option} {report} was measured on {name} ({_shape(architecture)}), and this model is "
            f"{loaded.source.display} ({_shape(loaded.architecture)}): its roles name another model's heads"
        )
    fingerprint = recorded.get("weights_sha256")
    if fingerprint is not None and recorded.get("weights_dtype") == dtype_name(loaded.dtype):
        if fingerprint != weights_fingerprint(loaded.model):
            raise ConfigError(
                f"{option} {report} was measured on {name}, whose weights differ from those of "
                f"{loaded.source.display} (another checkpoint of the same architecture): analyze this model first"
            )
        return
    source = loaded.source
    here = [source.kind, source.location, source.gguf_file, loaded.revision]
    there = [recorded.get(key) for key in ("kind", "location", "gguf_file", "revision")]
    if here != there:
        raise ConfigError(
            f"{option} {report} was measured on {name} ({there[1]}), and this model is {source.display} "
            f"({source.location}); their weights cannot be compared here (loaded in another dtype): analyze this "
            "model first, or load it as the report did"
        )


def _shape(architecture) -> str:
    if not isinstance(architecture, dict):
        return "no recorded architecture"
    return f"{architecture.get('model_type')}, {architecture.get('layers')} layers x {architecture.get('heads')} heads"
