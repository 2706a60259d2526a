"""Run settings and head-type thresholds: frozen dataclasses, every field documented, every default and
every list of choices written here once (the CLI derives its defaults and choices from them)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

from headscope.arguments import as_number, parse_batch_size, parse_bytes, parse_layers, whole_number
from headscope.detector_specs import as_detectors
from headscope.errors import ConfigError

Device = Literal["auto", "cuda", "cpu", "mps"]
DType = Literal["auto", "float32", "bfloat16", "float16"]

DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu", "mps")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
ENCODING_ERRORS: tuple[str, ...] = ("strict", "replace", "skip")
PADDING_SIDES: tuple[str, ...] = ("right", "left")
CHART_FORMATS: tuple[str, ...] = ("png", "svg", "pdf")
IMPORTANCE_MODES: tuple[str, ...] = ("none", "fast", "exact")
# how a head is removed (interventions.removal): its output replaced by a constant, or (window) its attention kept to
# the first keys and a recent window, as a streaming KV cache would keep them
OUTPUT_REMOVALS: tuple[str, ...] = ("zero", "mean")
REMOVAL_MODES: tuple[str, ...] = (*OUTPUT_REMOVALS, "window")
DEFAULT_WINDOW, DEFAULT_SINK = 64, 4  # window mode: the recent keys and the first keys a windowed head keeps
DEFAULT_REMOVAL = "mean"  # the removal ablate and prune use unless told
PRUNE_PATIENCE = 2  # prune stops after this many rounds in a row each add under 2% of the heads
LOSS_ON: tuple[str, ...] = ("all", "repeats")  # which predicted tokens ablate scores (interventions.group_losses)
PATCH_WHATS: tuple[str, ...] = (
    "output",
    "pattern",
    "values",
    "q",
    "k",
)  # what of a head `patch` puts in (commands.patch)
PATCH_DIRECTIONS: tuple[str, ...] = ("denoise", "noise")  # into the corrupt prompt, or into the clean one
# every position at once, one position at a time, or one role (marked in the pairs) at a time
PATCH_POSITIONS: tuple[str, ...] = ("all", "each", "roles")
PATCH_METRICS: tuple[str, ...] = ("logit_diff",)  # interventions.patching.METRICS
# how `circuit` grows its circuits from the scores: the strongest edges, or MIB's greedy growth from the logits
CIRCUIT_SELECTIONS: tuple[str, ...] = ("top", "greedy")
EDGE_METHODS: tuple[str, ...] = ("eap-ig", "eap")  # how `circuit` scores an edge (interventions.edges)
DEFAULT_EDGE_STEPS = 5  # EAP-IG's interpolation steps, as Hanna et al. 2024 take for EAP-IG-inputs
COMPARE_REPLICATES = 500  # paired bootstrap replicates of `compare`
SINK_THRESHOLD = 0.3  # a row is a sink row when its mass on the first token exceeds this (Gu et al. 2024)
# float32 logits of one block of query rows; a layer's attention larger than this is reduced block by block
# (temporaries take a few times this).
BLOCK_BYTES = 32 * 2**20
# Counts above these are refused outright (before anything loads): more gains nothing a user could see, and the
# memory they would take is checked against the budget besides.
MAX_REPLICATES = 100_000  # --bootstrap, compare --replicates
MAX_PROBE_SEEDS = 10_000  # --probe-seeds: 10,000 sequences of 2 x 32 tokens already take minutes on a GPU
MAX_EXAMPLES = 50  # --examples: each keeps every head's attention on up to 32 tokens
MAX_EXEMPLARS = 1000  # --exemplars: rows kept per head and kind
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers (the bootstrap's counter-based hash)


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's named strategies


def setting(default, help: str):
    """A RunConfig field with its documentation: the CLI's option takes its help from here (cli/options.py)."""
    return dataclasses.field(default=default, metadata={"help": help})


def setting_help(name: str) -> str:
    """The documentation of RunConfig's field `name`."""
    return next(field.metadata["help"] for field in dataclasses.fields(RunConfig) if field.name == name)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run besides the model, the corpus and the output: each field's help is its documentation
    (and the CLI option's help)."""

    revision: str | None = setting(None, "Hub branch, tag or commit (default: the repository's default branch).")
    trust_remote_code: bool = setting(False, "Allow the model repository's own modelling code to run.")
    device: Device = setting("auto", "auto picks CUDA when present, then MPS, else the CPU.")
    dtype: DType = setting("auto", "auto: bfloat16 on CUDA (float16 without bf16), float16 on MPS, float32 on CPU.")
    text_column: str | None = setting(None, "Column with the sentence in .jsonl/.csv/.tsv/.parquet (default: text).")
    encoding_errors: str = setting("strict", "Invalid UTF-8 in the corpus: strict (stop), replace, or skip the line.")
    # Where batches are padded: changes no number (tested), kept to prove it; not an option of the CLI.
    padding_side: str = setting("right", "Where batches are padded (right or left); changes no number.")
    device_map: str | dict | None = setting(
        None,
        "Spread a model larger than one device over the GPUs, then the CPU, then the disk (accelerate): auto, "
        "balanced, sequential, or a .json file of module -> device.",
    )  # from Python also a dict {module name: device}; "disk" needs offload_folder
    offload_folder: str | None = setting(None, "With --device-map: where the layers that fit nowhere else are kept.")
    max_length: int | None = setting(
        None, "Cut each sentence or text to this many tokens (default: the model's limit)."
    )
    window: int = setting(2, "Diagonal metric: mass within +-WINDOW positions of the query.")
    # 64: the usual streaming window. Read from the S + W keys a row keeps, far_mass costs a fixed amount per row
    # (within noise of nothing on one 8,192-token text, benchmarks/README.md); on sentences of at most S + W tokens
    # it is NaN and costs nothing.
    stream_window: int = setting(
        64,
        "far_mass: the recent keys a streaming KV cache keeps, the row's own included (0: no far_mass).",
    )
    stream_sink: int = setting(DEFAULT_SINK, "far_mass: the sentence's first keys a streaming KV cache keeps too.")
    batch_size: int | None = setting(
        None, "Sentences per forward pass, or auto (default): as many as --max-memory allows (<= 256)."
    )
    max_memory: int | None = setting(
        None, "Memory for activations, attention and replicas, e.g. 8GiB. Default: half the free device memory."
    )
    block_bytes: int = setting(BLOCK_BYTES, "A layer's attention larger than this is reduced in blocks of query rows.")
    layers: tuple[int, ...] | None = setting(
        None,
        "Only these layers, e.g. 0-5,10: analyze and inspect read only them (later layers are not even run); "
        "prune removes heads of these layers only.",
    )
    sentence_heads: bool = setting(True, "Also write per-(sentence, layer, head) metrics (large for big corpora).")
    chunk_sentences: int = setting(
        4096,
        "Sentences tokenized and sorted together: the unit of host memory, checkpoints and data-parallel work "
        "(chunk i goes to rank i % ranks).",
    )
    sink_threshold: float = setting(SINK_THRESHOLD, "sink_rate counts rows whose first-token mass exceeds this.")
    probes: bool = setting(True, "Run the probe battery (repeated random tokens: induction, duplicate, previous).")
    copying: bool = setting(True, "Score each head's OV circuit from the weights (ov_copying; cached per model).")
    probe_seeds: int = setting(8, "Probe sequences, one per seed 0..N-1.")
    probe_length: int = setting(32, "Random tokens per copy; each probe sequence holds two copies (and the BOS).")
    retrieval_length: int = setting(
        0,
        "The retrieval probe: sequences of this many tokens, a span of --probe-length random tokens planted early "
        "and repeated at the end; probe_retrieval is how often a head's strongest key is the token after the first "
        "copy (Wu et al. 2024). 0: not run.",
    )
    bootstrap: int = setting(200, "Bootstrap replicates for the 95% intervals (0 skips them).")
    bootstrap_seed: int = setting(0, "Seed of the bootstrap: the intervals are a pure function of it and the corpus.")
    importance: str = setting(
        "none", "Head importance on the model's loss: fast (attribution) or exact (also ablation)."
    )
    check_dormant: bool = setting(
        True,
        "Check the dormant label by removal: its heads zeroed together on the corpus (needs the LM head: loaded "
        "where the checkpoint has one); heads are demoted while they cost more than --dormant-tolerance.",
    )
    dormant_tolerance: float = setting(
        0.02, "Nats per predicted token the dormant heads may cost, removed together, and keep the label."
    )
    threads: int | None = setting(
        None, "CPU threads torch may use during the run (changes no number). Default: torch's."
    )
    exemplars: int = setting(
        10,
        "Corpus rows kept per head and kind (sharp, write, each probe's and detector's pattern): exemplars.parquet "
        "and the page. 0 keeps none.",
    )
    detectors: tuple = setting(
        (),
        "Detectors to score every head by, NAME=SPEC each (SPEC: offset:K, same-token, after-same-token, token:REGEX, "
        "first, far:S,W): a column detect_NAME with its interval and chance level. From Python also "
        "{name: spec or callable}.",
    )
    examples: int = setting(
        3,
        "Corpus sentences (spread over lengths, up to 32 tokens) whose attention the report keeps whole, 0 to 50; "
        "with the probes, the probe sequence too.",
    )

    def __post_init__(self) -> None:
        self._check_types()
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.encoding_errors not in ENCODING_ERRORS:
            raise ConfigError(
                f"--encoding-errors must be one of {', '.join(ENCODING_ERRORS)}; got {self.encoding_errors!r}"
            )
        if self.importance not in IMPORTANCE_MODES:
            raise ConfigError(f"--importance must be one of {', '.join(IMPORTANCE_MODES)}; got {self.importance!r}")
        if self.padding_side not in PADDING_SIDES:
            raise ConfigError(f"padding_side must be one of {', '.join(PADDING_SIDES)}; got {self.padding_side!r}")
        named = self.device_map in DEVICE_MAPS
        if isinstance(self.device_map, str) and not named and not Path(self.device_map).is_file():
            raise ConfigError(
                f"--device-map must be one of {', '.join(DEVICE_MAPS)} or a .json file of module -> device; "
                f"got {self.device_map!r}"
            )
        if not 0.0 < self.dormant_tolerance < float("inf"):
            raise ConfigError(f"--dormant-tolerance must be a positive number of nats; got {self.dormant_tolerance}")
        if self.window < 0:
            raise ConfigError(f"--window must be 0 or more; got {self.window}")
        for name in ("stream_window", "stream_sink"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more; got {getattr(self, name)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be 1 or more (or auto); got {self.batch_size}")
        if self.max_memory is not None and self.max_memory < 2**20:
            raise ConfigError(f"--max-memory must be at least 1 MiB; got {self.max_memory} bytes")
        if self.block_bytes < 1024:
            raise ConfigError(f"block_bytes must be at least 1024; got {self.block_bytes}")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ConfigError(f"--layers must name layers 0 or above; got {self.layers}")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"--max-length must be 1 or more; got {self.max_length}")
        if self.chunk_sentences < 1:
            raise ConfigError(f"chunk_sentences must be 1 or more; got {self.chunk_sentences}")
        if not 0.0 < self.sink_threshold < 1.0:
            raise ConfigError(f"--sink-threshold must be between 0 and 1; got {self.sink_threshold}")
        if self.probes and (self.probe_seeds < 2 or self.probe_length < 2):
            raise ConfigError(
                f"--probe-seeds and --probe-length must be 2 or more; got {self.probe_seeds} and {self.probe_length}"
            )
        if self.retrieval_length < 0:
            raise ConfigError(f"--retrieval-length must be 0 (no retrieval probe) or more; got {self.retrieval_length}")
        if self.probe_seeds > MAX_PROBE_SEEDS:
            raise ConfigError(f"--probe-seeds takes at most {MAX_PROBE_SEEDS:,} sequences; got {self.probe_seeds:,}")
        if self.bootstrap != 0:
            check_replicates("--bootstrap", self.bootstrap, zero="0 (no intervals) or ")
        check_seed("--bootstrap-seed", self.bootstrap_seed)
        if not 0 <= self.exemplars <= MAX_EXEMPLARS:
            raise ConfigError(f"--exemplars takes 0 to {MAX_EXEMPLARS} rows per head and kind; got {self.exemplars}")
        if not 0 <= self.examples <= MAX_EXAMPLES:
            raise ConfigError(f"--examples takes 0 to {MAX_EXAMPLES} sentences; got {self.examples}")
        cpus = os.cpu_count() or 1
        if self.threads is not None and not 1 <= self.threads <= cpus:
            raise ConfigError(f"--threads takes 1 to {cpus} (the CPUs of this machine); got {self.threads}")
        if self.offload_folder is not None and self.device_map is None:
            raise ConfigError("--offload-folder keeps what a --device-map sends to disk: give --device-map too")

    def _check_types(self) -> None:
        """Values from Python (not the CLI, which parses text) are checked for their kind before any range, so that
        `layers="0"` or `bootstrap=True` is refused in one line naming the option, not a TypeError three calls
        later. Text the CLI would parse (layers "0-5", max_memory "8GiB", batch_size "auto") is parsed the same
        way; a path where a folder is named becomes its string."""
        parsed = {"layers": parse_layers, "max_memory": parse_bytes, "batch_size": parse_batch_size}
        object.__setattr__(self, "detectors", as_detectors(self.detectors))
        for field in dataclasses.fields(self):
            name, value, annotation = field.name, getattr(self, field.name), str(field.type)
            option = f"--{name.replace('_', '-')}"
            if name in parsed and isinstance(value, str):
                value = parsed[name](value)
            elif isinstance(value, Path) and "str" in annotation:
                value = str(value)
            elif name == "layers" and isinstance(value, list | tuple | range):
                if not all(whole_number(layer) for layer in value):
                    raise ConfigError(f"{option} takes whole numbers (layer indices); got {value!r}")
                value = tuple(int(layer) for layer in value)
            elif value is not None and re.search(r"\b(int|float)\b", annotation) and not annotation.startswith("bool"):
                # numbers as numbers: numpy's, Decimal, text that writes one (as the CLI reads it)
                value = as_number(value, option, whole=not re.search(r"\bfloat\b", annotation))
            if not _of_kind(value, annotation):
                raise ConfigError(f"{option} takes {_described(annotation)}; got {value!r}")
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict:
        """The settings as run.json records them: paths as text, detectors as NAME=SPEC (a callable's SPEC names it)."""
        out = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(self).items()}
        return out | {"detectors": [f"{detector.name}={detector.spec}" for detector in self.detectors]}


_KIND_WORDS = {
    "bool": "True or False", "int": "a whole number", "float": "a number", "str": "text", "Device": "text",
    "DType": "text", "dict": "a dict", "tuple": "layer numbers", "None": "None",
}  # fmt: skip


def _described(annotation: str) -> str:
    """'int | None' -> 'a whole number or None'."""
    words = [word for kind, word in _KIND_WORDS.items() if re.search(rf"\b{kind}\b", annotation)]
    return " or ".join(dict.fromkeys(words))


def _of_kind(value, annotation: str) -> bool:
    """Is `value` of the kind a RunConfig field's annotation (a string: postponed annotations) names?"""
    if value is None:
        return "None" in annotation
    if isinstance(value, bool):
        return annotation.startswith("bool")
    kinds = {"int": whole_number(value), "float": isinstance(value, int | float) and not isinstance(value, bool),
             "str": isinstance(value, str), "Device": isinstance(value, str), "DType": isinstance(value, str),
             "dict": isinstance(value, dict), "tuple": isinstance(value, tuple)}  # fmt: skip
    return any(ok for kind, ok in kinds.items() if re.search(rf"\b{kind}\b", annotation))


SETTINGS: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(RunConfig))


def _numbers(rules, option: Callable[[str], str]) -> None:
    """Every field of a frozen rule table (all numbers) as a plain float, whatever number type it was given as."""
    for field in dataclasses.fields(rules):
        object.__setattr__(rules, field.name, float(as_number(getattr(rules, field.name), option(field.name))))


def check_replicates(option: str, value: int, *, zero: str = "") -> None:
    """Bootstrap replicates: 2 to MAX_REPLICATES (`zero` says what 0 means where it is allowed)."""
    if not 2 <= value <= MAX_REPLICATES:
        raise ConfigError(f"{option} takes {zero}2 to {MAX_REPLICATES:,} replicates; got {value:,}")


def check_seed(option: str, value: int) -> None:
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{option} takes a whole number from 0 to 2**64 - 1; got {value}")


def check_rules(thresholds, roles) -> None:
    """The Python API's labelling rules must be the rule types (the CLI builds them from options)."""
    if not isinstance(thresholds, Thresholds):
        raise ConfigError(f"thresholds takes a headscope.Thresholds; got {thresholds!r}")
    if not isinstance(roles, RoleThresholds):
        raise ConfigError(f"roles takes a headscope.config.RoleThresholds; got {roles!r}")


def run_settings(base: RunConfig | None = None, **options) -> RunConfig:
    """`base` (default: RunConfig()) with `options`, RunConfig fields by name; an unknown name is refused."""
    if base is not None and not isinstance(base, RunConfig):
        raise ConfigError(f"config takes a headscope.RunConfig; got {base!r}")
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; the options are RunConfig's fields: {', '.join(SETTINGS)}")
    return dataclasses.replace(base or RunConfig(), **options)


def settings_from_command_line(values: dict) -> RunConfig:
    """RunConfig from a command's option values, by field name: choices become their values, paths strings,
    and the options typed as text (batch size, memory, layers) are parsed. Names that are not fields are left."""
    settings = {}
    for name, value in values.items():
        if name not in SETTINGS or value is None:
            continue
        if isinstance(value, Enum):
            value = value.value
        elif isinstance(value, Path):
            value = str(value)
        elif name in _PARSERS and isinstance(value, str):
            value = _PARSERS[name](value)
        settings[name] = value
    return RunConfig(**settings)


_PARSERS = {"batch_size": parse_batch_size, "max_memory": parse_bytes, "layers": parse_layers}


def label_rules_from_command_line(values: dict, base: tuple | None = None) -> tuple[Thresholds, RoleThresholds]:
    """The head-type and role rules from a command's option values, by name (a role rule's option is its field
    with `role_` before it): each one given (not None) replaces `base`'s (default: the defaults). Other names are
    left."""
    thresholds, roles = base or (Thresholds(), RoleThresholds())
    given = {name: value for name, value in values.items() if value is not None}
    type_rules = {item.name for item in dataclasses.fields(Thresholds)} & set(given)
    role_rules = {item.name for item in dataclasses.fields(RoleThresholds)}
    role_rules &= {name.removeprefix("role_") for name in given if name.startswith("role_")}
    return (
        dataclasses.replace(thresholds, **{name: given[name] for name in type_rules}),
        dataclasses.replace(roles, **{name: given[f"role_{name}"] for name in role_rules}),
    )


@dataclass(frozen=True)
class Thresholds:
    """Head-type rule, checked in this order: local, copy, broad, else mixed.

    locality = (diagonal - diagonal_uniform) / (1 - diagonal_uniform): the share of the mass that uniform
    attention would put outside the +-window band which the head keeps inside it (1 = all of it, 0 = no
    more than uniform). Judging against the uniform baseline matters: on a 6-token sentence uniform
    attention already has most of its mass within +-2 positions. norm_entropy is entropy / ln(visible keys),
    so neither test drifts with sentence length.
    """

    # local: at least this locality. A previous-token head scores ~1, a uniform head 0.
    local_min_locality: float = 0.5
    # copy: norm_entropy at most this; rows whose entropy is under 30% of uniform's hold most of their
    # mass on one or two keys.
    copy_max_norm_entropy: float = 0.3
    # broad: norm_entropy at least this; rows within 30% of uniform spread their mass widely.
    broad_min_norm_entropy: float = 0.7

    def __post_init__(self) -> None:
        _numbers(self, lambda name: f"--{name.replace('_', '-')}")
        if not -1.0 <= self.local_min_locality <= 1.0:
            raise ConfigError(f"--local-min-locality must be between -1 and 1; got {self.local_min_locality}")
        for name in ("copy_max_norm_entropy", "broad_min_norm_entropy"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be between 0 and 1; got {value}")
        if self.copy_max_norm_entropy >= self.broad_min_norm_entropy:
            raise ConfigError(
                f"--copy-max-norm-entropy ({self.copy_max_norm_entropy}) must be below "
                f"--broad-min-norm-entropy ({self.broad_min_norm_entropy})"
            )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RoleThresholds:
    """The role rule's cut-offs. Roles are checked in this order, the first that matches wins:

    retrieval        probe_retrieval >= retrieval_min (with --retrieval-length)
    induction        probe_induction >= probe_min
    duplicate-token  probe_duplicate >= probe_min
    previous-token   probe_previous >= probe_min (prev_token on the corpus when the probes were skipped)
    dormant          write_ratio < dormant_max_write_ratio
    sink             sink_rate >= sink_rate_min
    positional       top_offset is a fixed offset (not "first", not "other") holding >= offset_share_min of rows
    streaming        far_mass <= streaming_max_far_mass (long texts only: far_mass needs rows past the window)
    broad            norm_entropy >= Thresholds.broad_min_norm_entropy
    other            anything else
    """

    probe_min: float = 0.3
    sink_rate_min: float = 0.5
    offset_share_min: float = 0.5
    # dormant: what the head writes is under 2.5% of the residual stream it is added to, on average over rows. On
    # SmolLM2 the heads under it, removed together, lower the loss (docs/labels.md).
    dormant_max_write_ratio: float = 0.025
    # streaming: at most 5% of the head's attention lies outside what a streaming cache keeps (docs/streaming.md)
    streaming_max_far_mass: float = 0.05
    # retrieval: the head's strongest key is the planted copy's next token on at least 10% of the repeat's rows (Wu et
    # al. 2024's threshold on their retrieval score)
    retrieval_min: float = 0.1

    def __post_init__(self) -> None:
        _numbers(self, lambda name: f"--role-{name.replace('_', '-')}")
        for name in ("probe_min", "sink_rate_min", "offset_share_min", "dormant_max_write_ratio",
                     "streaming_max_far_mass", "retrieval_min"):  # fmt: skip
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"--role-{name.replace('_', '-')} must be between 0 and 1; got {value}")

    def to_dict(self) -> dict:
        return asdict(self)
