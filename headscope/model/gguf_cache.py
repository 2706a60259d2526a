"""A GGUF file's model as transformers de-quantizes it, kept as a plain checkpoint folder: parsed and de-quantized once
per file, not on every load.

transformers reads a GGUF file whole on every load: it parses every metadata field (SmolLM2's 49,152-token
vocabulary: 8 s), converts them (6.6 s over its config, tokenizer and weights) and de-quantizes every tensor to float32
(4.5 s), 21 s of a 22 s load of a 94 MiB file on two cores. The first load of a file writes what transformers made of
it (config.json, the tokenizer's files, model.safetensors holding the de-quantized float32 weights) into the cache
folder (files.cache_folder() / "gguf"), and every later load reads that folder instead: under a second. The weights
are bit for bit the ones transformers de-quantized, so every number is the same; another --dtype is cast from them
as transformers casts the de-quantized tensors.

- Which files: those of at most HEADSCOPE_GGUF_CACHE_MB MiB (default 1024; the folder takes about 5.5 times the
  file of a 4-bit one); 0 turns the cache off.
- Which not: a model whose float32 weights would take more than half of the host's free memory (the load's own check
  then refuses it in one line, or it loads in a narrower dtype, as before), a model transformers keeps packed (its
  GGUF kernels compute on the quantized blocks, so there is no float checkpoint to keep), one without a causal-LM
  class, one whose file lacks weights its class needs (they would be initialised at random and then kept), and one
  with its own code (--trust-remote-code). A small note in the cache says so, and later loads read the file as before
  without trying again (but for memory, which a later load may have: it tries again).
- Keyed by the file's resolved path, size and modification time and the versions of transformers, gguf and torch:
  an edited file or another version reads the file again, and the key's older folders are removed. A folder is
  written under a temporary name and renamed, so concurrent runs never read half of one; one whose files are not
  the sizes its note records (a damaged cache) is written again. A cache that cannot be written (a read-only folder,
  a full disk, or one that would keep less than the checkpoint's size and 1 GiB free after it) costs only the time:
  the load reads the file as before, and a later load tries again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import torch

from headscope.errors import ModelLoadError
from headscope.files import cache_folder
from headscope.model import memory
from headscope.model.once import one_load
from headscope.model.placement import parameter_bytes

LIMIT_VARIABLE = "HEADSCOPE_GGUF_CACHE_MB"
DEFAULT_LIMIT_MB = 1024
NOTE = "headscope-gguf.json"  # in each cached folder: its key and its files' sizes, or why the file is not cached
FORMAT = 1  # bumped when what a folder holds changes: every file is read again


def cached_checkpoint(gguf_path: Path, *, trust_remote_code: bool = False) -> Path | None:
    """The folder holding `gguf_path`'s de-quantized checkpoint, written first if it is not there yet; None where the
    file is not cached (too large, the cache turned off, a model it cannot hold, a cache that cannot be written)."""
    limit = limit_bytes()
    path = Path(gguf_path).resolve()
    if trust_remote_code or limit == 0:
        return None
    identity = _identity(path)
    if identity["size"] > limit:
        return None
    folder = cache_folder() / "gguf" / f"{_digest(str(path))}-{_digest(identity)}"
    with one_load():
        state = _state(folder, identity)
        if state == "missing":
            state = _write(path, folder, identity)
    return folder if state == "checkpoint" else None


def limit_bytes() -> int:
    """The largest GGUF file cached, from HEADSCOPE_GGUF_CACHE_MB (0: none)."""
    value = os.environ.get(LIMIT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_LIMIT_MB * 2**20
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:  # also refuses nan
        raise ModelLoadError(f"{LIMIT_VARIABLE} takes a size in MiB (0 turns the GGUF cache off); got {value!r}")
    return int(megabytes * 2**20)


def _identity(path: Path) -> dict:
    stat = path.stat()
    versions = {name: _version(name) for name in ("transformers", "gguf", "torch")}
    return {"format": FORMAT, "file": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, **versions}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _state(folder: Path, identity: dict) -> str:
    """'checkpoint' (complete), 'refused' (a note that the file is not cached) or 'missing' (absent or damaged)."""
    try:
        note = json.loads((folder / NOTE).read_text(encoding="utf-8"))
        if note["identity"] != identity:
            return "missing"
        if note.get("refused"):
            return "refused"
        intact = all((folder / name).stat().st_size == size for name, size in note["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "missing"
    return "checkpoint" if intact else "missing"


def _write(path: Path, folder: Path, identity: dict) -> str:
    """Load the file as transformers does and keep what it made, or a note of why not; the state now cached."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    location, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(location, gguf_file=name)
    refused = None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        refused = f"no causal-LM class for {config.model_type}"
    elif not _fits(parameter_bytes(config, torch.float32, lm_head=True), folder):
        return "unwritable"  # not now: a later load, with the memory and the disk, writes it
    else:
        tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=name)
        model, info = AutoModelForCausalLM.from_pretrained(
            location, gguf_file=name, config=config, dtype=torch.float32, output_loading_info=True
        )
        if getattr(getattr(model, "hf_quantizer", None), "packed_modules", None):
            refused = "transformers keeps its weights packed (its GGUF kernels)"
        elif info["missing_keys"]:
            refused = f"its file lacks {len(info['missing_keys'])} of the weights its class needs"
    work = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    try:
        _remove(work)
        work.mkdir(parents=True)
        if refused is None:
            with plain_checkpoint(model):
                model.save_pretrained(work)
            tokenizer.save_pretrained(work)
        files = {item.name: item.stat().st_size for item in work.iterdir()}
        note = {"identity": identity, "files": files, "refused": refused}
        (work / NOTE).write_text(json.dumps(note, indent=1), encoding="utf-8")
        _publish(work, folder, identity)
    except OSError:  # the cache cannot be written: this load reads the file as before
        _remove(work)
        return "unwritable"
    return "refused" if refused else "checkpoint"


def _fits(needed: int | None, folder: Path) -> bool:
    """Whether the float32 model the checkpoint is written from (`needed` bytes; None: unknown) fits in half of the
    host's free memory (a larger one is left to the load, whose own check refuses it in one line or loads it in a
    narrower dtype), and its checkpoint leaves at least its own size, and 1 GiB, free on its disk (a cache that filled
    the disk would fail the run's own outputs). Checked before the file is loaded for it."""
    if needed is None or needed > memory.host_free_memory() // 2:
        return False
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return False
    return free - needed >= max(needed, 2**30)


def _publish(work: Path, folder: Path, identity: dict) -> None:
    """Rename the written folder into place (a concurrent run that got there first wins), and remove the folders this
    file's older versions left."""
    try:
        os.rename(work, folder)
    except OSError:  # another run published the same folder first (or left a damaged one: replace it)
        if _state(folder, identity) != "missing":
            _remove(work)
        else:
            _remove(folder)
            os.rename(work, folder)
    path_key = folder.name.split("-")[0]
    for older in folder.parent.glob(f"{path_key}-*"):
        if older != folder:
            _remove(older)


@contextlib.contextmanager
def plain_checkpoint(model: torch.nn.Module) -> Iterator[None]:
    """Within the block `model` saves as a plain checkpoint of its float weights. A GGUF file loaded de-quantized
    holds float weights, but transformers refuses to save a model its GGUF quantizer is still attached to ("not
    serializable"): the quantizer and its config entry are set aside for the block and put back after it."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        yield
        return
    config = model.config
    attributes = {name: getattr(model, name) for name in ("hf_quantizer", "is_quantized") if hasattr(model, name)}
    method = model.__dict__.get("quantization_method")
    quantization = config.__dict__.get("quantization_config")
    try:
        model.hf_quantizer = None
        model.is_quantized = False
        model.__dict__.pop("quantization_method", None)
        config.__dict__.pop("quantization_config", None)
        yield
    finally:
        for name, value in attributes.items():
            setattr(model, name, value)
        if method is not None:
            model.quantization_method = method
        if quantization is not None:
            config.quantization_config = quantization


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # cleanup never replaces the error being reported
