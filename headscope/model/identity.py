"""Which model a report was measured on, and whether a loaded model is that one.

A report's roles name heads by (layer, head); read into another model they name that model's heads, which do
something else. A model is identified by its architecture (depth, heads, KV heads, head size), its weights (a
fingerprint: a hash of evenly spaced values of every parameter, in the dtype it was loaded in, so that a fine-tune
of any layer differs) and, where the weights cannot be compared (loaded in another dtype, some of them offloaded to
disk, a report from before fingerprints), where it came from (its source and revision). The same weights loaded
from a copy in another folder are the same model.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import torch

from headscope.errors import ConfigError
from headscope.model.placement import dtype_name

FINGERPRINT_SAMPLES = 16  # values per parameter, evenly spaced over it (SmolLM2: 272 parameters, a few ms)


# model -> (what its parameters are now, their fingerprint): hashing costs 20 ms for SmolLM2, a twentieth of analyzing
# one short text, and a notebook analyzes one loaded model again and again. A parameter changed in place bumps its
# version counter (every in-place torch operation does: copy_, load_state_dict, an optimizer step); one replaced
# (`.data = `, a new Parameter) is another tensor at another address. Inference tensors have no version counter:
# a model holding any is hashed every time.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """sha256 of the names, shapes and FINGERPRINT_SAMPLES evenly spaced values of every parameter (None when some
    are not in memory: offloaded to disk by a device map, their values are not here to compare)."""
    parameters = list(model.named_parameters())
    if any(p.is_inference() for _, p in parameters):  # no version counter (loaded under inference mode): hash anew
        return _hashed(model)
    now = tuple((name, id(p), p.data_ptr(), p._version) for name, p in parameters)
    known = _FINGERPRINTS.get(model)
    if known is not None and known[0] == now:
        return known[1]
    fingerprint = _hashed(model)
    _FINGERPRINTS[model] = (now, fingerprint)
    return fingerprint


def _hashed(model: torch.nn.Module) -> str | None:
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        if parameter.device.type == "meta":
            return None
        if parameter.numel() == 0:
            continue
        flat = parameter.detach().reshape(-1)
        count = min(FINGERPRINT_SAMPLES, flat.numel())
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)  # exact integers
        values = flat[index].float().cpu()  # exact for float32, bfloat16 and float16 weights
        digest.update(f"{name}{tuple(parameter.shape)}".encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def model_identity(loaded) -> dict:
    """What run.json records to identify the model (loaded: headscope.model.loading.LoadedModel)."""
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
    comparable = fingerprint is not None and recorded.get("weights_dtype") == dtype_name(loaded.dtype)
    here = weights_fingerprint(loaded.model) if comparable else None  # hashed only when it can decide
    if here is not None:
        if fingerprint != here:
            raise ConfigError(
                f"{option} {report} was measured on {name}, whose weights differ from those of "
                f"{loaded.source.display} (another checkpoint of the same architecture): analyze this model first"
            )
        return
    source = loaded.source
    this = [source.kind, source.location, source.gguf_file, loaded.revision]
    there = [recorded.get(key) for key in ("kind", "location", "gguf_file", "revision")]
    if this != there:
        raise ConfigError(
            f"{option} {report} was measured on {name} ({there[1]}), and this model is {source.display} "
            f"({source.location}); their weights cannot be compared here (another dtype, or offloaded): analyze "
            "this model first, or load it as the report did"
        )


def _shape(architecture) -> str:
    if not isinstance(architecture, dict):
        return "no recorded architecture"
    return f"{architecture.get('model_type')}, {architecture.get('layers')} layers x {architecture.get('heads')} heads"
