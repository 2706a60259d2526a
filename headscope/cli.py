"""The `headscope` command: parse options, call the library, print a summary.

Library errors (HeadscopeError) become one line `Error: ...` on stderr and exit code 1.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from headscope.config import (
    CHART_FORMATS,
    COMPARE_REPLICATES,
    DEVICES,
    DTYPES,
    ENCODING_ERRORS,
    IMPORTANCE_MODES,
    RoleThresholds,
    RunConfig,
    Thresholds,
)
from headscope.errors import ConfigError, HeadscopeError


class OneLineErrors(TyperGroup):
    """Typer's own usage errors (a bad option value, an unknown option) as one line, like every other error.

    Exit codes: 0 done, 1 an error (`Error: ...`), 2 a usage error (`Error: ...`, naming the option),
    130 interrupted, 143 terminated.
    """

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except TyperException as err:
            context = getattr(err, "ctx", None)
            # `headscope` alone raises this to show the help; Typer does not export its class.
            if type(err).__name__ == "NoArgsIsHelpError":
                err.show()
            else:
                where = f" (see {context.command_path} --help)" if context is not None else ""
                typer.echo(f"Error: {' '.join(err.format_message().split())}{where}", err=True)
            code = err.exit_code
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code or 0)


app = typer.Typer(
    cls=OneLineErrors,
    help="Measure, classify and chart every attention head of a Hugging Face causal language model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum of the values config.py allows: Typer shows and checks them; they are written there once."""
    return Enum(name, {value: value for value in values}, type=str)


DeviceChoice = _choices("DeviceChoice", DEVICES)
DTypeChoice = _choices("DTypeChoice", DTYPES)
EncodingErrors = _choices("EncodingErrors", ENCODING_ERRORS)
ChartFormat = _choices("ChartFormat", CHART_FORMATS)
ImportanceMode = _choices("ImportanceMode", IMPORTANCE_MODES)
DEFAULTS, THRESHOLDS, ROLE_THRESHOLDS = RunConfig(), Thresholds(), RoleThresholds()
DEFAULT_DEVICE, DEFAULT_DTYPE = DeviceChoice(DEFAULTS.device), DTypeChoice(DEFAULTS.dtype)
DEFAULT_ENCODING_ERRORS = EncodingErrors(DEFAULTS.encoding_errors)
DEFAULT_IMPORTANCE = ImportanceMode(DEFAULTS.importance)


# Options shared by several commands, declared once.
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
RoleOffsetShareMin = Annotated[
    float, typer.Option(help="Role positional if one fixed offset holds the largest weight in >= this share of rows.")
]
Format = Annotated[ChartFormat, typer.Option("--format", help="Chart file format.")]
DEFAULT_FORMAT = ChartFormat(CHART_FORMATS[0])


@app.callback()
def _commands() -> None:
    """Measure, classify and chart every attention head of a Hugging Face causal language model."""


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that every cleanup (staging folders, temp files) runs."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def user_errors():
    """Turn the library's own errors into a one-line message and exit code 1; signals into 130 / 143."""
    # Under torchrun only rank 0 speaks: every rank's failure reaches it (headscope.distributed.meet).
    say = typer.echo if os.environ.get("RANK", "0") == "0" else (lambda *args, **kwargs: None)
    try:
        yield
    except HeadscopeError as err:
        say(f"Error: {err}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        say("Interrupted; existing outputs were left as they were (--resume continues a checkpointed run).", err=True)
        raise typer.Exit(130) from None
    except Terminated:
        say("Terminated; existing outputs were left as they were (--resume continues a checkpointed run).", err=True)
        raise typer.Exit(143) from None


@app.command()
def analyze(
    model: Annotated[str, typer.Argument(help="Hub id (gpt2), local model folder, .gguf file, or alias smollm2.")],
    corpus: Annotated[
        Path | None,
        typer.Option(help="Sentences: .txt (one per line), .jsonl, .csv, .tsv or .parquet. Default: the shipped 100."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder. Default: reports/<model-name>.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing, non-empty output folder.")] = False,
    resume: Annotated[
        bool,
        typer.Option(help="Checkpoint as it goes; after an interruption, the same command with --resume continues."),
    ] = False,
    text_column: Annotated[
        str | None, typer.Option(help="Column with the sentence in .jsonl/.csv/.tsv/.parquet (default: text).")
    ] = None,
    encoding_errors: Annotated[
        EncodingErrors, typer.Option(help="Invalid UTF-8 in the corpus: strict (stop), replace, or skip the line.")
    ] = DEFAULT_ENCODING_ERRORS,
    revision: Annotated[str | None, typer.Option(help="Hub branch, tag or commit.")] = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the hub repo's own model code to run.")] = False,
    device_map: Annotated[
        str | None,
        typer.Option(
            help="Spread a model larger than one device over the GPUs, then the CPU, then the disk (accelerate): "
            "auto, balanced, sequential, or a .json file of module -> device."
        ),
    ] = None,
    offload_folder: Annotated[
        Path | None, typer.Option(help="With --device-map: where the layers that fit nowhere else are kept.")
    ] = None,
    device: Annotated[DeviceChoice, typer.Option(help="auto picks CUDA when present.")] = DEFAULT_DEVICE,
    dtype: Annotated[
        DTypeChoice, typer.Option(help="auto: bfloat16 on CUDA, float16 on MPS, float32 on CPU.")
    ] = DEFAULT_DTYPE,
    max_length: Annotated[
        int | None, typer.Option(help="Truncate sentences to this many tokens (counted in run.json).")
    ] = DEFAULTS.max_length,
    window: Annotated[int, typer.Option(help="Diagonal metric: mass within +-WINDOW of the query.")] = DEFAULTS.window,
    batch_size: Annotated[
        str, typer.Option(help="Sentences per forward pass, or auto: as many as --max-memory allows (up to 256).")
    ] = "auto",
    max_memory: Annotated[
        str | None,
        typer.Option(help="Memory for activations and attention, e.g. 8GiB. Default: half the free device memory."),
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="Measure only these layers, e.g. 0-5,10. Later layers are not even run.")
    ] = None,
    sentence_heads: Annotated[
        bool, typer.Option(help="Also write per-(sentence, layer, head) metrics (large for big corpora).")
    ] = DEFAULTS.sentence_heads,
    charts: Annotated[bool, typer.Option(help="Draw the charts after measuring.")] = True,
    page: Annotated[bool, typer.Option(help="Write report.html, the self-contained page to explore the heads.")] = True,
    chart_format: Format = DEFAULT_FORMAT,
    probes: Annotated[
        bool, typer.Option(help="Run the probe battery (repeated random tokens: induction, duplicate, previous).")
    ] = DEFAULTS.probes,
    probe_seeds: Annotated[int, typer.Option(help="Probe sequences (one per seed).")] = DEFAULTS.probe_seeds,
    probe_length: Annotated[
        int, typer.Option(help="Random tokens per copy; each probe holds two copies.")
    ] = DEFAULTS.probe_length,
    importance: Annotated[
        ImportanceMode,
        typer.Option(help="Head importance on the model's loss: fast (attribution) or exact (also ablation)."),
    ] = DEFAULT_IMPORTANCE,
    bootstrap: Annotated[
        int, typer.Option(help="Bootstrap replicates for the 95% intervals (0 skips them).")
    ] = DEFAULTS.bootstrap,
    sink_threshold: Annotated[
        float, typer.Option(help="sink_rate counts rows whose first-token mass exceeds this.")
    ] = DEFAULTS.sink_threshold,
    chunk_sentences: Annotated[
        int,
        typer.Option(
            help="Sentences tokenized and sorted together: the unit of host memory, checkpoints and data-parallel "
            "work (chunk i goes to rank i % ranks)."
        ),
    ] = DEFAULTS.chunk_sentences,
    local_min_locality: LocalMinLocality = THRESHOLDS.local_min_locality,
    copy_max_norm_entropy: CopyMaxNormEntropy = THRESHOLDS.copy_max_norm_entropy,
    broad_min_norm_entropy: BroadMinNormEntropy = THRESHOLDS.broad_min_norm_entropy,
    role_probe_min: RoleProbeMin = ROLE_THRESHOLDS.probe_min,
    role_sink_rate_min: RoleSinkRateMin = ROLE_THRESHOLDS.sink_rate_min,
    role_offset_share_min: RoleOffsetShareMin = ROLE_THRESHOLDS.offset_share_min,
) -> None:
    """Measure every attention head of MODEL on a corpus, classify the heads, write tables and charts."""
    from headscope.config import parse_batch_size, parse_bytes, parse_layers
    from headscope.loading import quiet_transformers, resolve_source
    from headscope.pipeline import analyze as run_analysis
    from headscope.reporting import RichReporter

    reporter = RichReporter()
    quiet_transformers(show_progress=reporter.console.is_terminal)
    with user_errors():
        config = RunConfig(
            revision=revision,
            trust_remote_code=trust_remote_code,
            device=device.value,
            dtype=dtype.value,
            text_column=text_column,
            encoding_errors=encoding_errors.value,
            device_map=device_map,
            offload_folder=str(offload_folder) if offload_folder else None,
            max_length=max_length,
            window=window,
            batch_size=parse_batch_size(batch_size),
            max_memory=parse_bytes(max_memory) if max_memory else None,
            layers=parse_layers(layers) if layers else None,
            sentence_heads=sentence_heads,
            probes=probes,
            probe_seeds=probe_seeds,
            probe_length=probe_length,
            bootstrap=bootstrap,
            sink_threshold=sink_threshold,
            importance=importance.value,
            chunk_sentences=chunk_sentences,
        )
        thresholds = Thresholds(local_min_locality, copy_max_norm_entropy, broad_min_norm_entropy)
        roles = RoleThresholds(role_probe_min, role_sink_rate_min, role_offset_share_min)
        out = out or Path("reports") / resolve_source(model).slug
        result = run_analysis(
            model,
            corpus,
            out=out,
            overwrite=overwrite,
            resume=resume,
            config=config,
            thresholds=thresholds,
            roles=roles,
            charts=chart_format.value if charts else None,
            page=page,
            reporter=reporter,
        )
    if result is None:  # a data-parallel rank other than 0: rank 0 reports
        return
    _print_summary(result)
    _print_label_counts(result.heads, result.run["model"]["input"])
    _print_most_important(result)


@app.command()
def classify(
    report: Annotated[Path, typer.Argument(help="A folder written by `headscope analyze`.")],
    out: Annotated[
        Path | None, typer.Option(help="Write the re-labelled heads.parquet and run.json here instead of in place.")
    ] = None,
    local_min_locality: LocalMinLocality = THRESHOLDS.local_min_locality,
    copy_max_norm_entropy: CopyMaxNormEntropy = THRESHOLDS.copy_max_norm_entropy,
    broad_min_norm_entropy: BroadMinNormEntropy = THRESHOLDS.broad_min_norm_entropy,
    role_probe_min: RoleProbeMin = ROLE_THRESHOLDS.probe_min,
    role_sink_rate_min: RoleSinkRateMin = ROLE_THRESHOLDS.sink_rate_min,
    role_offset_share_min: RoleOffsetShareMin = ROLE_THRESHOLDS.offset_share_min,
) -> None:
    """Re-label the heads of REPORT (types and roles) with other thresholds (no model needed)."""
    from headscope.report.folder import reclassify

    with user_errors():
        thresholds = Thresholds(local_min_locality, copy_max_norm_entropy, broad_min_norm_entropy)
        roles = RoleThresholds(role_probe_min, role_sink_rate_min, role_offset_share_min)
        classified = reclassify(report, thresholds, roles, out=out)
    _print_label_counts(classified, str(report))
    typer.echo(f"wrote {(out or report) / 'heads.parquet'}")


@app.command()
def plot(
    report: Annotated[Path, typer.Argument(help="A folder written by `headscope analyze`.")],
    out: Annotated[Path | None, typer.Option(help="Folder for the charts (default: REPORT).")] = None,
    chart_format: Format = DEFAULT_FORMAT,
    page: Annotated[bool, typer.Option(help="Also rewrite report.html.")] = True,
) -> None:
    """Draw the charts and report.html of REPORT from its tables (no model needed)."""
    from headscope.report.folder import plot_report

    with user_errors():
        written = plot_report(report, fmt=chart_format.value, out=out, page=page)
    for path in written:
        typer.echo(f"wrote {path}")


@app.command()
def compare(
    a: Annotated[Path, typer.Argument(help="Report A, the baseline (a folder written by `headscope analyze`).")],
    b: Annotated[Path, typer.Argument(help="Report B; deltas are B - A.")],
    out: Annotated[
        Path | None, typer.Option(help="Folder for the comparison. Default: reports/compare-<A>-vs-<B>.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing comparison folder.")] = False,
    charts: Annotated[bool, typer.Option(help="Draw the comparison charts.")] = True,
    page: Annotated[bool, typer.Option(help="Write compare.html, the self-contained page of the comparison.")] = True,
    chart_format: Format = DEFAULT_FORMAT,
    replicates: Annotated[
        int, typer.Option(help="Paired bootstrap replicates (same corpus in both reports).")
    ] = COMPARE_REPLICATES,
    seed: Annotated[int, typer.Option(help="Bootstrap seed: the intervals are a pure function of it.")] = 0,
) -> None:
    """Compare two reports head by head (B - A), with 95% intervals and a false-discovery-rate flag."""
    from headscope.report.compare import compare_reports, write_comparison

    with user_errors():
        if replicates < 2:
            raise ConfigError(f"--replicates must be 2 or more; got {replicates}")
        comparison = compare_reports(a, b, replicates=replicates, seed=seed)
        out = out or Path("reports") / f"compare-{a.resolve().name}-vs-{b.resolve().name}"
        target = write_comparison(
            comparison, out, a=a, b=b, overwrite=overwrite, fmt=chart_format.value if charts else None, page=page
        )
    _print_comparison(comparison)
    typer.echo(f"wrote {target}/")


def _print_comparison(comparison) -> None:
    """The method, the heads that changed most and the layers where the mean entropy moved."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    record = comparison.record
    for side in ("a", "b"):
        console.print(f"{side.upper()}: {record[side]['model']} on {record[side]['corpus']}")
    console.print(f"method: {record['method']}")
    if not comparison.same_grid:
        shares = comparison.bands[comparison.bands["kind"] == "role"].pivot_table(
            index="label", columns=["band", "report"], values="share"
        )
        console.print(shares.round(3).to_string())
        return
    heads = comparison.heads
    counts = ", ".join(f"{metric} {n}" for metric, n in record["significant_heads"].items())
    console.print(f"heads whose change is significant (FDR 5%): {counts} of {len(heads)}")
    table = Table(title="the heads whose entropy changed most", box=box.SIMPLE_HEAD)
    for name in ("head", "A", "B", "B - A", "95% interval", "sig.", "role A -> B"):
        table.add_column(name, justify="left" if name in ("head", "role A -> B") else "right")
    for row in heads.reindex(heads["entropy_delta"].abs().sort_values(ascending=False).index).head(10).itertuples():
        table.add_row(
            f"L{row.layer}H{row.head}",
            f"{row.entropy_a:.3f}",
            f"{row.entropy_b:.3f}",
            f"{row.entropy_delta:+.3g}",  # significant figures: a consistent 1e-5 shift must not read 0.000
            f"[{row.entropy_delta_ci_low:+.3g}, {row.entropy_delta_ci_high:+.3g}]",
            "yes" if row.entropy_significant else "",
            f"{row.role_a} -> {row.role_b}",
        )
    console.print(table)
    layers = comparison.layers
    moved = layers[layers["entropy_significant"]]
    if len(moved):
        console.print(
            "layers whose mean entropy moved (FDR 5%): "
            + ", ".join(f"{row.layer} ({row.entropy_delta:+.3g})" for row in moved.itertuples())
        )
    else:
        console.print("no layer's mean entropy moved significantly (FDR 5%)")


def _print_summary(result) -> None:
    from rich.console import Console
    from rich.table import Table

    from headscope.summary import early_late_entropy, layer_entropy

    console = Console(soft_wrap=True)  # long lines stay whole, at any terminal width
    run = result.run
    arch = run["model"]["architecture"]
    table = Table(title=f"{run['model']['input']}: mean attention entropy per layer (nats)")
    table.add_column("layer", justify="right")
    table.add_column("mean", justify="right")
    table.add_column("min head", justify="right")
    table.add_column("max head", justify="right")
    for layer, row in layer_entropy(result.heads).iterrows():
        table.add_row(str(layer), f"{row['mean']:.3f}", f"{row['min']:.3f}", f"{row['max']:.3f}")
    console.print(table)
    bands = early_late_entropy(result.heads)
    timings = run["timings"]
    if bands is not None:
        console.print(
            f"early layers {bands['early_layers']}: {bands['early']:.3f} nats, "
            f"late layers {bands['late_layers']}: {bands['late']:.3f} nats, gradient {bands['gradient']:+.3f}"
        )
    console.print(
        f"{run['corpus']['sentences']} sentences, {run['corpus']['tokens']} tokens "
        f"({run['corpus']['truncated_sentences']} truncated); {arch['layers']} layers x {arch['heads']} heads "
        f"on {run['device']} ({run['dtype']}); {timings['tokens_per_second']:,.0f} tokens/s"
    )
    numerics = run["numerics"]
    if numerics["nonfinite_rows"]:
        console.print(
            f"[yellow]warning:[/yellow] {numerics['nonfinite_rows']} attention rows held NaN or inf "
            f"({numerics['heads_with_nonfinite_rows']} heads; left out of the metrics, counted in "
            "nonfinite_rows). float16 overflow? Try --dtype bfloat16 or float32."
        )
    if numerics["unnormalised_rows"]:
        console.print(
            f"[yellow]warning:[/yellow] {numerics['unnormalised_rows']} attention rows do not sum to 1 "
            f"({numerics['heads_with_unnormalised_rows']} heads; counted in unnormalised_rows)."
        )
    console.print(f"wrote {result.out_dir}/")


def _print_most_important(result) -> None:
    """The 10 heads whose removal hurts the loss most, with their role and entropy."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from headscope.summary import importance_column, most_important

    column = importance_column(result.heads)
    if column is None:
        return
    importance = result.run["importance"]
    table = Table(
        title=f"the 10 heads the loss needs most, by {column} (clean loss {importance['clean_loss']:.4f} nats)",
        box=box.SIMPLE_HEAD,
    )
    for name in ("head", "ablate 0", "ablate mean", "attrib 0", "attrib mean", "role", "entropy"):
        table.add_column(name, justify="left" if name in ("head", "role") else "right")
    for row in most_important(result.heads).itertuples():
        values = [row.ablation_zero, row.ablation_mean, row.attribution_zero, row.attribution_mean]
        cells = [f"{v:+.4f}" if v == v else "-" for v in values]  # NaN: not computed
        table.add_row(f"L{row.layer}H{row.head}", *cells, row.role, f"{row.entropy:.3f}")
    Console().print(table)


def _print_label_counts(labelled, title: str) -> None:
    """Head types and roles, counted per layer band."""
    from rich.console import Console
    from rich.table import Table

    from headscope.labels import HEAD_TYPES, ROLES, label_counts
    from headscope.summary import layer_bands

    bands = layer_bands(int(labelled["layer"].max()) + 1)
    console = Console()
    for column, names, what in (("head_type", HEAD_TYPES, "head type"), ("role", ROLES, "role")):
        counts = label_counts(labelled, column, names, bands)  # rows: bands; columns: labels
        table = Table(title=f"{title}: heads per {what}")
        table.add_column(what)
        for band in counts.index:
            table.add_column(band, justify="right")
        for name in names:
            table.add_row(name, *(str(int(counts.at[band, name])) for band in counts.index))
        console.print(table)


def main() -> None:
    signal.signal(signal.SIGTERM, _raise_terminated)
    app()
