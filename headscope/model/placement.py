"""Where a model's weights go: the memory checks before loading, device maps (read, checked, recorded) and the
offload folder (checked, and left as it was found).

Everything here runs before the weights load, on an empty (meta) model built from the config: a device map that
names a device this machine lacks, a value that is no device, or a module the model does not have is refused
with one line, instead of a traceback halfway through loading or a map silently ignored.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from headscope.config import DEVICE_MAPS
from headscope.errors import ConfigError, ModelLoadError
from headscope.model.memory import free_memory


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def empty_model(config, *, lm_head: bool):
    """The model built from `config` on the meta device (no memory), or None for configs that cannot be."""
    from accelerate import init_empty_weights
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        with init_empty_weights():
            return (AutoModelForCausalLM if lm_head else AutoModel).from_config(config)
    except Exception:  # exotic or remote-code configs: no estimate, no check
        return None


def parameter_bytes(config, dtype: torch.dtype, *, lm_head: bool = False) -> int | None:
    """Memory the weights take in `dtype` (the base model, or with its LM head); None if unknown."""
    empty = empty_model(config, lm_head=lm_head)
    return None if empty is None else sum(p.numel() for p in empty.parameters()) * dtype.itemsize


def check_fits(config, display: str, dtype: torch.dtype, device: torch.device, *, lm_head: bool = False) -> None:
    """Refuse, before loading anything, a model whose weights alone exceed the free memory."""
    needed = parameter_bytes(config, dtype, lm_head=lm_head)
    free = free_memory(device)
    if needed is not None and needed > 0.9 * free:
        raise ModelLoadError(
            f"{display} needs about {needed / 2**30:.1f} GiB for its weights in {dtype_name(dtype)}, but only "
            f"{free / 2**30:.1f} GiB is free on {device}; try --dtype bfloat16 (half of float32), "
            "or --device-map auto to spread it over GPUs and CPU"
        )


def read_device_map(device_map: str | dict) -> str | dict:
    """A named strategy, or a {module: device} map given as a dict or a .json file."""
    if isinstance(device_map, dict) or device_map in DEVICE_MAPS:
        return device_map
    path = Path(device_map)
    if not path.is_file():
        raise ConfigError(
            f"--device-map must be one of {', '.join(DEVICE_MAPS)} or a .json file of module -> device; "
            f"got {device_map!r}"
        )
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"--device-map {path}: not a readable JSON file ({err})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
        raise ConfigError(f"--device-map {path}: expected a JSON object of module name -> device")
    return loaded


def device_problem(device) -> str | None:
    """Why `device` (a device map's value) is not a device of this machine; None when it is one."""
    gpus = torch.cuda.device_count()
    have = f"this machine has {gpus} CUDA GPU{'s' if gpus != 1 else ''}" if gpus else "this machine has no CUDA GPU"
    if isinstance(device, int) and not isinstance(device, bool):
        return None if 0 <= device < gpus else f"GPU {device}, but {have}"
    if not isinstance(device, str):
        return "not a device (cpu, disk, a GPU index such as 0, or cuda:0)"
    if device in ("cpu", "disk"):
        return None
    if device == "mps":
        return None if torch.backends.mps.is_available() else "MPS, which is not available here"
    gpu = re.fullmatch(r"cuda(?::(\d+))?", device)
    if gpu:
        index = int(gpu.group(1) or 0)
        return None if index < gpus else f"GPU {index}, but {have}"
    if device == "meta":
        return "the meta device, which holds no weights"
    return "not a device (cpu, disk, a GPU index such as 0, or cuda:0)"


def check_device_map(
    config, display: str, dtype: torch.dtype, device_map, offload_folder, *, lm_head: bool = False
) -> None:
    """Refuse, before loading, a device map that cannot work, and one whose devices cannot hold their share.

    An explicit map: every value must be a device of this machine, every key a module of the model ("" the whole
    model), and disk needs an offload folder; each device's share is checked against its free memory. A named
    strategy: the weights must fit on the GPUs and the CPU together, unless an offload folder takes the rest.
    """
    if isinstance(device_map, dict):
        if not device_map:
            raise ConfigError('--device-map is an empty map: name where each module goes, e.g. {"": "cpu"}')
        for module, device in device_map.items():
            problem = device_problem(device)
            if problem is not None:
                raise ConfigError(f"--device-map sends {module or 'the model'!r} to {device!r}: {problem}")
        if "disk" in device_map.values() and offload_folder is None:
            raise ConfigError("the device map sends modules to disk: give --offload-folder DIR to keep them there")
        empty = empty_model(config, lm_head=lm_head)
        if empty is None:
            return
        names = {name for name, _ in empty.named_modules()}
        unknown = [module for module in device_map if module not in names]
        if unknown:
            top = sorted(name for name in names if name and "." not in name)
            raise ConfigError(
                f"--device-map names modules {display} does not have: {', '.join(map(repr, unknown[:5]))} "
                f"(its top-level modules: {', '.join(top)})"
            )
        for device, nbytes in _bytes_by_device(empty, dtype, device_map).items():
            if device == "disk":
                continue
            where = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
            free = free_memory(where)
            if nbytes > 0.9 * free:
                raise ModelLoadError(
                    f"the device map puts {nbytes / 2**30:.1f} GiB of {display}'s weights on {where}, but only "
                    f"{free / 2**30:.1f} GiB is free there; move some modules elsewhere (or to disk)"
                )
        return
    needed = parameter_bytes(config, dtype, lm_head=lm_head)
    if needed is None or offload_folder is not None:  # the disk takes whatever does not fit
        return
    gpus = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    free = sum(free_memory(device) for device in gpus) + free_memory(torch.device("cpu"))
    if needed > 0.9 * free:
        raise ModelLoadError(
            f"{display} needs about {needed / 2**30:.1f} GiB for its weights in {dtype_name(dtype)}, more than the "
            f"{free / 2**30:.1f} GiB free on {len(gpus)} GPU(s) and the CPU together; add --offload-folder DIR "
            "to keep the rest on disk, or try --dtype bfloat16"
        )


def _bytes_by_device(empty, dtype: torch.dtype, device_map: dict) -> dict:
    """Bytes of weights each device of an explicit map would hold."""
    modules = sorted(device_map, key=len, reverse=True)  # the most specific module name first
    per_device: dict = {}
    for name, parameter in empty.named_parameters():
        owner = next((m for m in modules if m == "" or name == m or name.startswith(m + ".")), None)
        if owner is not None:
            device = device_map[owner]
            per_device[device] = per_device.get(device, 0) + parameter.numel() * dtype.itemsize
    return per_device


def applied_map(network, requested) -> dict | None:
    """The map the model was loaded with, as JSON holds it: accelerate's own record, or the explicit map given
    (transformers keeps none for a map that puts everything on one device)."""
    applied = getattr(network, "hf_device_map", None) or (requested if isinstance(requested, dict) else None)
    if applied is None:
        return None
    return {name: device if isinstance(device, int | str) else str(device) for name, device in applied.items()}


def check_offload_folder(
    folder: str | Path | None, *, within: Mapping[str, Path], equal: Mapping[str, Path] | None = None
) -> None:
    """Refuse an offload folder that is, or lies inside, a folder of `within` (the output, the model's folder),
    or that is a folder of `equal` (the corpus's): loading would write copies of the weights there."""
    if folder is None:
        return
    folder = Path(folder).expanduser().resolve()
    for what, path in [*within.items(), *(equal or {}).items()]:
        path = Path(path).expanduser().resolve()
        if folder == path or (what in within and path in folder.parents):
            raise ConfigError(f"--offload-folder {folder} is {what} or inside it ({path}); choose a folder of its own")


class OffloadScratch:
    """What loading writes into the offload folder, removed when the run ends: the folder itself when loading
    made it, else the entries that loading added (nothing that was there before, nothing made after)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.existed = self.folder is not None and self.folder.exists()
        self.before = self._entries()
        self.added: set[Path] | None = None

    def _entries(self) -> set[Path]:
        return set(self.folder.iterdir()) if self.folder is not None and self.folder.is_dir() else set()

    def loaded(self) -> None:
        """Loading is over: what it added is what will be removed."""
        self.added = self._entries() - self.before

    def remove(self) -> None:
        if self.folder is None or not self.folder.is_dir():
            return
        if not self.existed:
            shutil.rmtree(self.folder, ignore_errors=True)
            return
        for entry in self.added if self.added is not None else self._entries() - self.before:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
