"""Which model a report was measured on, and whether a loaded model is that one.

A report's roles name heads by (layer, head); read into another model they name that model's heads, which do
something else. A model is identified by its architecture (depth, heads, KV heads, head size), its weights (a
fingerprint: sha256 over every byte of every parameter, in the dtype it was loaded in, so that any edit of any head
differs) and, where the weights cannot be compared (loaded in another dtype, some of them offloaded to disk, a
report from before whole-weight fingerprints), where it came from (its source and revision). The same weights loaded
from a copy in another folder are the same model.

Cost (measured, `python -c` on SmolLM2 in float32, 538 MB): 0.21 s on two cores, the parameters hashed on threads
(hashlib lets go of the GIL); a 7B model in bfloat16 (14 GB) some 5 s on two cores, once per loaded model.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from headscope.errors import ConfigError
from headscope.model.placement import dtype_name

FINGERPRINT = "sha256 of every parameter's bytes"  # run.json's weights_fingerprint: what weights_sha256 hashes
CHUNK_BYTES = 64 * 2**20  # a parameter is hashed (and, from an accelerator, copied to the host) this much at a time


# model -> (what its parameters are now, their fingerprint): hashing costs 0.2 s for SmolLM2, and a notebook analyzes
# one loaded model again and again. A parameter changed in place bumps its
# version counter (every in-place torch operation does: copy_, load_state_dict, an optimizer step); one replaced
# (`.data = `, a new Parameter) is another tensor at another address. Inference tensors have no version counter:
# a model holding any is hashed every time.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_fingerprint(model: torch.nn.Module) -> str | None:
    """sha256 of the names, shapes, dtypes and every byte of every parameter (None when some are not in memory:
    offloaded to disk by a device map, their values are not here to compare)."""
    parameters = list(model.named_parameters())
    if any(p.is_inference() for _, p in parameters):  # no version counter (loaded under inference mode): hash anew
        return _hashed(parameters)
    now = tuple((name, id(p), p.data_ptr(), p._version) for name, p in parameters)
    known = _FINGERPRINTS.get(model)
    if known is not None and known[0] == now:
        return known[1]
    fingerprint = _hashed(parameters)
    _FINGERPRINTS[model] = (now, fingerprint)
    return fingerprint


def _hashed(parameters: list[tuple[str, torch.Tensor]]) -> str | None:
    if any(parameter.device.type == "meta" for _, parameter in parameters):
        return None
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        digests = pool.map(parameter_digest, [parameter for _, parameter in parameters])
        digest = hashlib.sha256()
        for (name, parameter), one in zip(parameters, digests, strict=True):
            digest.update(f"{name}{tuple(parameter.shape)}{parameter.dtype}".encode())
            digest.update(one)
    return digest.hexdigest()


def parameter_digest(parameter: torch.Tensor) -> bytes:
    """sha256 of one parameter's bytes, CHUNK_BYTES at a time (copied to the host chunk by chunk)."""
    digest = hashlib.sha256()
    flat = parameter.detach().reshape(-1)
    step = max(1, CHUNK_BYTES // max(flat.element_size(), 1))
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].contiguous().view(torch.uint8).cpu()
        digest.update(memoryview(chunk.numpy()))
    return digest.digest()


def model_identity(loaded) -> dict:
    """What run.json records to identify the model (loaded: headscope.model.loading.LoadedModel)."""
    return {
        "weights_sha256": weights_fingerprint(loaded.model),
        "weights_fingerprint": FINGERPRINT,
        "weights_dtype": dtype_name(loaded.dtype),
    }


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
    why = _incomparable(recorded, loaded)
    here = weights_fingerprint(loaded.model) if why is None else None  # hashed only when it can decide
    if why is None and here is None:
        why = "some of this model's weights are offloaded to disk"
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
            f"({source.location}); their weights cannot be compared here ({why}): analyze this model first, or "
            "load it as the report did"
        )


def _incomparable(recorded: dict, loaded) -> str | None:
    """Why the report's fingerprint cannot decide (None: it can)."""
    if recorded.get("weights_sha256") is None:
        return "the report holds no fingerprint of its weights: offloaded there, or written by an older headscope"
    if recorded.get("weights_fingerprint") != FINGERPRINT:
        return "the report's fingerprint samples the weights (an older headscope's), where this one hashes them all"
    there, here = recorded.get("weights_dtype"), dtype_name(loaded.dtype)
    if there != here:
        return f"they were loaded in {there} there and {here} here"
    return None


def _shape(architecture) -> str:
    if not isinstance(architecture, dict):
        return "no recorded architecture"
    return f"{architecture.get('model_type')}, {architecture.get('layers')} layers x {architecture.get('heads')} heads"
