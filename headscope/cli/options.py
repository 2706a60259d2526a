"""Every option and argument of every command, declared once (tests/project/test_structure.py checks that no command
module declares its own). An option that is a setting (a RunConfig field) takes its help from the field's
documentation (config.setting), and every command that takes it takes the same declaration; its default is the
field's (`DEFAULTS`). Choices come from config's lists, as str Enums Typer shows and checks."""

from __future__ import annotations

import functools
import inspect
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from headscope import registry
from headscope.columns import PROBE_PATTERNS
from headscope.config import (
    CHART_FORMATS,
    CIRCUIT_SELECTIONS,
    DEFAULT_EDGE_STEPS,
    DEFAULT_REMOVAL,
    DEVICES,
    DTYPES,
    EDGE_METHODS,
    ENCODING_ERRORS,
    IMPORTANCE_MODES,
    LOSS_ON,
    PATCH_DIRECTIONS,
    PATCH_METRICS,
    PATCH_POSITIONS,
    PATCH_WHATS,
    PRUNE_PATIENCE,
    REMOVAL_MODES,
    RoleThresholds,
    RunConfig,
    Thresholds,
    setting_help,
)

DEFAULTS, THRESHOLDS, ROLE_THRESHOLDS = RunConfig(), Thresholds(), RoleThresholds()


def choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of the values config.py allows: Typer shows and checks them; they are written there once."""
    return Enum(name, {value: value for value in values}, type=str)


DeviceChoice = choices("DeviceChoice", DEVICES)
DTypeChoice = choices("DTypeChoice", DTYPES)
EncodingChoice = choices("EncodingChoice", ENCODING_ERRORS)
ChartFormat = choices("ChartFormat", CHART_FORMATS)
ImportanceChoice = choices("ImportanceChoice", IMPORTANCE_MODES)
ModeChoice = choices("ModeChoice", REMOVAL_MODES)
LossOnChoice = choices("LossOnChoice", LOSS_ON)
ProbeChoice = choices("ProbeChoice", PROBE_PATTERNS)
WhatChoice = choices("WhatChoice", PATCH_WHATS)
DirectionChoice = choices("DirectionChoice", PATCH_DIRECTIONS)
PositionsChoice = choices("PositionsChoice", PATCH_POSITIONS)
MetricChoice = choices("MetricChoice", PATCH_METRICS)
EdgeMethodChoice = choices("EdgeMethodChoice", EDGE_METHODS)
SelectChoice = choices("SelectChoice", CIRCUIT_SELECTIONS)

DEFAULT_DEVICE, DEFAULT_DTYPE = DeviceChoice(DEFAULTS.device), DTypeChoice(DEFAULTS.dtype)
DEFAULT_ENCODING = EncodingChoice(DEFAULTS.encoding_errors)
DEFAULT_IMPORTANCE = ImportanceChoice(DEFAULTS.importance)
DEFAULT_FORMAT = ChartFormat(CHART_FORMATS[0])
DEFAULT_PATIENCE = PRUNE_PATIENCE
DEFAULT_MODE, DEFAULT_LOSS_ON = ModeChoice(DEFAULT_REMOVAL), LossOnChoice(LOSS_ON[0])
DEFAULT_WHAT, DEFAULT_DIRECTION = WhatChoice(PATCH_WHATS[0]), DirectionChoice(PATCH_DIRECTIONS[0])
DEFAULT_POSITIONS, DEFAULT_METRIC = PositionsChoice(PATCH_POSITIONS[0]), MetricChoice(PATCH_METRICS[0])
DEFAULT_EDGE_METHOD, DEFAULT_STEPS = EdgeMethodChoice(EDGE_METHODS[0]), DEFAULT_EDGE_STEPS
DEFAULT_SELECT = SelectChoice(CIRCUIT_SELECTIONS[0])


def _setting(kind, name: str, **option):
    """The option of RunConfig's field `name`: its help is the field's documentation."""
    return Annotated[kind, typer.Option(help=setting_help(name), **option)]


# ---------------------------------------------------------------- settings (RunConfig fields)

Revision = _setting(str | None, "revision", metavar="<ref>")
TrustRemoteCode = _setting(bool, "trust_remote_code")
Device = _setting(DeviceChoice, "device")
DType = _setting(DTypeChoice, "dtype")
TextColumn = _setting(str | None, "text_column", metavar="<column>")
EncodingErrors = _setting(EncodingChoice, "encoding_errors")
DeviceMap = _setting(str | None, "device_map", metavar="<auto|balanced|sequential|map.json>")
OffloadFolder = _setting(Path | None, "offload_folder")
MaxLength = _setting(int | None, "max_length")
Window = _setting(int, "window")
StreamWindow = _setting(int, "stream_window")
StreamSink = _setting(int, "stream_sink")
BatchSize = _setting(str | None, "batch_size", metavar="<n|auto>")
MaxMemory = _setting(str | None, "max_memory", metavar="<size>")
Layers = _setting(str | None, "layers", metavar="<layers>")
SentenceHeads = _setting(bool, "sentence_heads")
ChunkSentences = _setting(int, "chunk_sentences")
SinkThreshold = _setting(float, "sink_threshold")
Probes = _setting(bool, "probes")
Copying = _setting(bool, "copying")
ProbeSeeds = _setting(int, "probe_seeds")
ProbeLength = _setting(int, "probe_length")
RetrievalLength = _setting(int, "retrieval_length")
Bootstrap = _setting(int, "bootstrap")
BootstrapSeed = _setting(int, "bootstrap_seed")
Importance = _setting(ImportanceChoice, "importance")
CheckDormant = _setting(bool, "check_dormant")
DormantTolerance = _setting(float, "dormant_tolerance")
Threads = _setting(int | None, "threads")
Examples = _setting(int, "examples")
Exemplars = _setting(int, "exemplars")
Detectors = Annotated[list[str] | None, typer.Option("--detector", help=setting_help("detectors"), metavar="NAME=SPEC")]

# ---------------------------------------------------------------- the label rules (config.Thresholds, RoleThresholds)

LocalMinLocality = Annotated[
    float, typer.Option(help="local if locality >= this (1 = all mass within the window, 0 = as uniform).")
]
CopyMaxNormEntropy = Annotated[
    float, typer.Option(help="copy if entropy / ln(visible keys) <= this (checked after local).")
]
BroadMinNormEntropy = Annotated[float, typer.Option(help="broad if entropy / ln(visible keys) >= this.")]
RoleProbeMin = Annotated[
    float, typer.Option(help="Role induction / duplicate-token / previous-token if that probe score >= this.")
]
RoleSinkRateMin = Annotated[float, typer.Option(help="Role sink if sink_rate >= this (after the probe roles).")]
RoleDormantMaxWriteRatio = Annotated[
    float,
    typer.Option(help="Role dormant if what the head writes / the residual stream < this (after the probe roles)."),
]
RoleOffsetShareMin = Annotated[
    float, typer.Option(help="Role positional if one fixed offset holds the largest weight in >= this share of rows.")
]
RoleRetrievalMin = Annotated[
    float, typer.Option(help="Role retrieval if probe_retrieval >= this (the first role checked).")
]
RoleStreamingMaxFarMass = Annotated[
    float, typer.Option(help="Role streaming if far_mass <= this (after positional; long texts only).")
]


def recorded(rule):
    """A rule option whose default is the report's own (None): classify keeps each threshold it is not given at the
    value the report was labelled with."""
    help_text = f"{rule.__metadata__[0].help} Default: the report's own."
    return Annotated[float | None, typer.Option(help=help_text, rich_help_panel=PANELS[-1])]


# ---------------------------------------------------------------- inputs

ModelArgument = Annotated[str, typer.Argument(help="Hub id (gpt2), local model folder, .gguf file, or alias smollm2.")]
ReportArgument = Annotated[Path, typer.Argument(help="A folder written by `headscope analyze`.")]
ReportA = Annotated[Path, typer.Argument(help="Report A, the baseline (a folder written by `headscope analyze`).")]
ReportB = Annotated[Path, typer.Argument(help="Report B; deltas are B - A.")]
Corpus = Annotated[
    Path | None,
    typer.Option(help="Sentences: .txt (one per line), .jsonl, .csv, .tsv or .parquet. Default: the shipped 100."),
]
Report = Annotated[
    Path | None,
    typer.Option(
        help="A report of this model: the heads' roles (ablate: for --role and --each-role; patch and circuit: shown)."
    ),
]
ExemplarsOf = Annotated[
    str | None,
    typer.Option(
        "--exemplars",
        metavar="<layer.head>",
        help="Inspect this head on the sentences of its exemplars in a report, given as MODEL (its model and "
        "corpus are the report's) or as --report.",
    ),
]
Why = Annotated[
    list[str] | None,
    typer.Option(
        "--why",
        metavar="<row[:key]|first-last,...|all|exemplars>",
        help="Split the chosen heads' attention logit at these rows into the senders of the query and of the key "
        "(qk.parquet; docs/why.md): ROW (its strongest key off the first token), FIRST-LAST (each row of the range), "
        "ROW:KEY, all, or exemplars (with --exemplars). With --report (or --role's probe roles), each head's "
        "k_composition_prev.",
    ),
]
HeadsToInspect = Annotated[
    list[str] | None, typer.Option("--heads", metavar="<layer.head,...>", help="Heads written LAYER.HEAD: 18.6,17.4.")
]
HeadGroups = Annotated[
    list[str] | None,
    typer.Option(
        "--heads",
        metavar="<layer.head,...>",
        help="A group of heads removed together, written LAYER.HEAD: 18.6,17.4 (repeat for more).",
    ),
]
HeadsToPatch = Annotated[
    list[str] | None,
    typer.Option(
        "--heads",
        metavar="<layer.head,...>",
        help="Heads to patch, one at a time, written LAYER.HEAD: 18.6,17.4 (default: every head).",
    ),
]
Pairs = Annotated[
    Path,
    typer.Option(
        help="Prompt pairs: .jsonl, .csv or .tsv with columns clean, corrupt (same token count), answer and "
        "distractor (one token each, e.g. ' Mary')."
    ),
]
AblatePairs = Annotated[
    Path | None,
    typer.Option(
        "--pairs",
        help="Measure a task instead of the loss: prompt pairs as patch takes them (clean, corrupt, answer, "
        "distractor); each group is removed on the clean prompts and the metric's change reported.",
    ),
]
Role = Annotated[
    list[str] | None,
    typer.Option(
        metavar="<role>",
        help="Heads of this role (repeat for more): from --report, or for inspect's probe roles (induction, "
        "duplicate-token, previous-token) from the probes, run first.",
    ),
]
EachRole = Annotated[bool, typer.Option(help="A group per role of --report (but other).")]
Text = Annotated[list[str] | None, typer.Option(help="A text to inspect (repeat for more).")]
Sentences = Annotated[str | None, typer.Option(help="Sentences of --corpus to inspect, by id: 0,5,10-12.")]
Probe = Annotated[
    list[ProbeChoice] | None,
    typer.Option(
        metavar="<induction|duplicate|previous>",
        help="Add the probe sequence (repeated random tokens) and score each head on this probe.",
    ),
]

# ---------------------------------------------------------------- what a command does

Mode = Annotated[
    ModeChoice,
    typer.Option(
        help="Remove a head by setting its output to 0, or to its mean over the corpus; or window its attention to "
        "the first --sink keys and the last --window ones, as a streaming KV cache keeps them."
    ),
]
# window mode's --window and --sink (analyze's --window is the diagonal's band, a setting: another parameter name)
KeptWindow = Annotated[
    int | None,
    typer.Option(
        "--window", help="--mode window: the recent keys a windowed head keeps, its own included [default: 64]"
    ),
]
KeptSink = Annotated[
    int | None, typer.Option("--sink", help="--mode window: the sentence's first keys it keeps too [default: 4].")
]
LossOn = Annotated[
    LossOnChoice,
    typer.Option(help="Score every predicted token, or repeats only (x[t-1] x[t] seen before: induction's)."),
]
What = Annotated[
    WhatChoice,
    typer.Option(
        help="Patch each head's output, its attention probabilities only (pattern), its values only, its "
        "query (q) or its key (k: its KV head's)."
    ),
]
Direction = Annotated[
    DirectionChoice,
    typer.Option(help="denoise: clean activation into the corrupt run (1 = restores); noise: corrupt into clean."),
]
Positions = Annotated[
    PositionsChoice,
    typer.Option(
        help="Patch every position at once, each position alone (values: key positions; needs one length), or each "
        "role marked in the pairs ([[IO:Mary]]) at its own position in each pair."
    ),
]
Metric = Annotated[
    MetricChoice, typer.Option(help="The metric patched: logit[answer] - logit[distractor], last token.")
]
Fast = Annotated[
    bool, typer.Option(help="Attribution patching: a first-order estimate from one backward pass (not exact).")
]
Parts = Annotated[
    bool,
    typer.Option(
        "--parts",
        help="With --what output: patch each head's pattern and values too, and say how far its output's effect "
        "goes beyond theirs (beyond_parts).",
    ),
]
EdgeMethod = Annotated[
    EdgeMethodChoice,
    typer.Option(
        "--method",
        help="eap-ig: each edge's gradient averaged over --steps inputs between the corrupt prompt and the clean one; "
        "eap: the gradient at the clean run (faster, blind where attention saturates).",
    ),
]
Steps = Annotated[int, typer.Option(help="EAP-IG's interpolation steps (at least 1).")]
Verify = Annotated[int, typer.Option(help="Patch the N strongest edges exactly, one at a time, beside their scores.")]
Target = Annotated[float, typer.Option(help="The faithfulness (0 to 1] the smallest circuit must reach.")]
Curve = Annotated[
    bool,
    typer.Option(help="Measure the faithfulness curve: circuits of 0.1% to 50% of the edges, each patched exactly."),
]
Select = Annotated[
    SelectChoice,
    typer.Option(
        help="How the curve's circuits take edges: the strongest first (top), or MIB's greedy growth from "
        "the logits (greedy: the strongest edge into a node already in the circuit)."
    ),
]
CopyingCount = Annotated[int, typer.Option("--count", help="Show the N most copying and the N most suppressing heads.")]
ByRole = Annotated[
    bool,
    typer.Option(
        "--by-role",
        help="Each edge's score at each role marked in the pairs ([[IO:Mary]]) too: edges_by_role.parquet.",
    ),
]
CircuitWhy = Annotated[
    int,
    typer.Option(
        "--why",
        metavar="N",
        help="For the heads the N strongest q and k edges feed: their attention at END to each role's token, split "
        "into the senders of the query and the key, clean against corrupt (why.parquet; docs/why.md). The pairs must "
        "mark roles ([[IO:Mary]]).",
    ),
]
Budget = Annotated[float, typer.Option(help="Nats of corpus loss the removed heads may cost together.")]
MaxRounds = Annotated[
    int | None,
    typer.Option(help="Stop the search after this many rounds (a gradient pass each, more where a step overshoots)."),
]
Patience = Annotated[
    int,
    typer.Option(
        help="Stop when this many rounds in a row each add under 4% of the heads, with a next round expected to add "
        "fewer too (0: never)."
    ),
]
Replicates = Annotated[
    int, typer.Option(help="Paired bootstrap replicates (same sentences in both reports), 2 to 100,000.")
]
Seed = Annotated[int, typer.Option(help="Bootstrap seed (0 to 2**64 - 1): the intervals are a pure function of it.")]

# ---------------------------------------------------------------- the program


def _show_version(shown: bool) -> None:
    if shown:
        from headscope import __version__

        typer.echo(f"headscope {__version__}")
        raise typer.Exit()


Version = Annotated[
    bool, typer.Option("--version", is_eager=True, callback=_show_version, help="Print the version and exit.")
]


# ---------------------------------------------------------------- outputs


OutRewrite = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Output folder. Default: REPORT itself, rewritten in place (atomically); a folder here is a new "
        "report instead.",
    ),
]
Overwrite = Annotated[bool, typer.Option(help="Replace a folder this command wrote before (and nothing else).")]
Resume = Annotated[
    bool, typer.Option(help="Checkpoint as it goes; after an interruption, the same command with --resume continues.")
]
SaveModel = Annotated[
    Path | None,
    typer.Option(help="Also write the pruned model here (a transformers checkpoint), checked by loading it back."),
]
Charts = Annotated[bool, typer.Option(help="Draw the charts (in --format).")]
Page = Annotated[
    bool,
    typer.Option(
        help="Write the self-contained page (report.html, compare.html, inspect.html, prune.html, circuit.html)."
    ),
]
Format = Annotated[ChartFormat, typer.Option("--format", help="Chart file format.")]

# ---------------------------------------------------------------- help panels

# Each command's help lists its own options first (what it does: "Options"), then these panels in this order.
PANELS = ("Model", "Corpus", "Measures", "Run", "Output", "Label rules")


def in_panel(panel: str, *declarations) -> None:
    """Show these options under `panel` in every command's help (Typer's rich_help_panel, which
    common.PanelledCommand reads in plain help too)."""
    assert panel in PANELS, panel
    for declared in declarations:
        declared.__metadata__[0].rich_help_panel = panel


in_panel("Model", Revision, TrustRemoteCode, Device, DType, DeviceMap, OffloadFolder, MaxMemory, Threads)
in_panel("Corpus", Corpus, TextColumn, EncodingErrors, MaxLength)
in_panel("Measures", Window, StreamWindow, StreamSink, Layers, SinkThreshold, Probes, ProbeSeeds, ProbeLength,
         RetrievalLength, Copying, Importance, CheckDormant, DormantTolerance, SentenceHeads, Examples, Exemplars,
         Detectors)  # fmt: skip
in_panel("Run", BatchSize, ChunkSentences, Bootstrap, BootstrapSeed, Replicates, Seed)
in_panel("Output", OutRewrite, Overwrite, Resume, SaveModel, Charts, Page, Format)
in_panel("Label rules", LocalMinLocality, CopyMaxNormEntropy, BroadMinNormEntropy, RoleProbeMin, RoleSinkRateMin,
         RoleDormantMaxWriteRatio, RoleOffsetShareMin, RoleStreamingMaxFarMass, RoleRetrievalMin)  # fmt: skip

# ---------------------------------------------------------------- bundles: options several commands take together

# (name, declaration, default) of the options every command that loads a model takes, of those that run text through
# it, and of those that read a corpus file: declared once, added to each command's signature by `takes`, read back
# from ctx.params into RunConfig by name (config.settings_from_command_line). A command's own code never names them.
MODEL_OPTIONS = (
    ("max_memory", MaxMemory, DEFAULTS.max_memory),
    ("device", Device, DEFAULT_DEVICE),
    ("device_map", DeviceMap, DEFAULTS.device_map),
    ("offload_folder", OffloadFolder, DEFAULTS.offload_folder),
    ("dtype", DType, DEFAULT_DTYPE),
    ("threads", Threads, DEFAULTS.threads),
    ("revision", Revision, DEFAULTS.revision),
    ("trust_remote_code", TrustRemoteCode, DEFAULTS.trust_remote_code),
)
# ... of those that run text through it (every one but copying, which reads the weights alone)
TEXT_OPTIONS = (("max_length", MaxLength, DEFAULTS.max_length),)
CORPUS_OPTIONS = (
    ("text_column", TextColumn, DEFAULTS.text_column),
    ("encoding_errors", EncodingErrors, DEFAULT_ENCODING),
)

# ... of the output: --out (its help naming the command's default folder, from registry.py) and --overwrite, or
# classify's and plot's --out, which rewrites the report in place when not given
REWRITE_OUTPUT = (("out", OutRewrite, None), ("overwrite", Overwrite, False))
RESUME_OPTIONS = (("resume", Resume, False),)
FORMAT_OPTIONS = (("chart_format", Format, DEFAULT_FORMAT),)
CHART_OPTIONS = (("charts", Charts, True), *FORMAT_OPTIONS)
PAGE_OPTIONS = (("page", Page, True),)
# ... of the bootstrap (settings) and the label rules: analyze labels with the defaults, classify with the report's own
BOOTSTRAP_OPTIONS = (
    ("bootstrap", Bootstrap, DEFAULTS.bootstrap),
    ("bootstrap_seed", BootstrapSeed, DEFAULTS.bootstrap_seed),
)
PROBE_ROLE_RULE = (("role_probe_min", RoleProbeMin, ROLE_THRESHOLDS.probe_min),)  # inspect's probe roles
LABEL_RULES = (
    ("local_min_locality", LocalMinLocality, THRESHOLDS.local_min_locality),
    ("copy_max_norm_entropy", CopyMaxNormEntropy, THRESHOLDS.copy_max_norm_entropy),
    ("broad_min_norm_entropy", BroadMinNormEntropy, THRESHOLDS.broad_min_norm_entropy),
    *PROBE_ROLE_RULE,
    ("role_sink_rate_min", RoleSinkRateMin, ROLE_THRESHOLDS.sink_rate_min),
    ("role_offset_share_min", RoleOffsetShareMin, ROLE_THRESHOLDS.offset_share_min),
    ("role_dormant_max_write_ratio", RoleDormantMaxWriteRatio, ROLE_THRESHOLDS.dormant_max_write_ratio),
    ("role_streaming_max_far_mass", RoleStreamingMaxFarMass, ROLE_THRESHOLDS.streaming_max_far_mass),
    ("role_retrieval_min", RoleRetrievalMin, ROLE_THRESHOLDS.retrieval_min),
)
RECORDED_LABEL_RULES = tuple((name, recorded(rule), None) for name, rule, _ in LABEL_RULES)


@functools.cache
def output(command: str) -> tuple:
    """The output bundle of `command`: --out, whose help names its default folder (registry.py), and --overwrite."""
    entry = registry.command(command)
    help_text = f"Output folder. Default: {entry.shown_out()}."
    out = Annotated[Path | None, typer.Option("--out", help=help_text, rich_help_panel="Output")]
    return (("out", out, None), ("overwrite", Overwrite, False))


def takes(*bundles):
    """A command that takes these bundles' options, after its own: its signature, which Typer reads, gains them
    (the function takes them as **options; the settings come from ctx.params)."""

    def add(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=declared)
                 for bundle in bundles for name, declared, default in bundle]  # fmt: skip
        command.__signature__ = signature.replace(parameters=[*own, *added])
        command.__annotations__ = {**{p.name: p.annotation for p in own}, **{p.name: p.annotation for p in added}}
        return command

    return add
