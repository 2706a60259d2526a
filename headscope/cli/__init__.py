"""The `headscope` command: parse options, call the library, print a summary.

Library errors (HeadscopeError) become one line `Error: ...` on stderr and exit code 1.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from headscope.cli.common import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_ENCODING_ERRORS,
    DEFAULT_FORMAT,
    DEFAULT_IMPORTANCE,
    DEFAULTS,
    INTERRUPTED,
    ROLE_THRESHOLDS,
    THRESHOLDS,
    BroadMinNormEntropy,
    CopyMaxNormEntropy,
    Device,
    DType,
    EncodingErrors,
    Format,
    ImportanceMode,
    LocalMinLocality,
    ModelArgument,
    OneLineErrors,
    Revision,
    RoleOffsetShareMin,
    RoleProbeMin,
    RoleSinkRateMin,
    Terminated,
    TextColumn,
    TrustRemoteCode,
    raise_terminated,
    say,
    usage_errors,
    user_errors,
)
from headscope.cli.inspect import inspect
from headscope.cli.interventions import ablate, prune
from headscope.config import COMPARE_REPLICATES, RoleThresholds, Thresholds
from headscope.errors import HeadscopeError

app = typer.Typer(
    cls=OneLineErrors,
    help="Measure, classify and chart every attention head of a Hugging Face causal language model.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: whole option names at 80 columns (rich's table cut them)
)


@app.callback()
def _commands() -> None:
    """Measure, classify and chart every attention head of a Hugging Face causal language model."""


@app.command()
def analyze(
    ctx: typer.Context,
    model: ModelArgument,
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
    # From here to the thresholds, every option is the RunConfig field of the same name (its default there).
    text_column: TextColumn = DEFAULTS.text_column,
    encoding_errors: Annotated[
        EncodingErrors, typer.Option(help="Invalid UTF-8 in the corpus: strict (stop), replace, or skip the line.")
    ] = DEFAULT_ENCODING_ERRORS,
    revision: Revision = DEFAULTS.revision,
    trust_remote_code: TrustRemoteCode = DEFAULTS.trust_remote_code,
    device_map: Annotated[
        str | None,
        typer.Option(
            help="Spread a model larger than one device over the GPUs, then the CPU, then the disk (accelerate): "
            "auto, balanced, sequential, or a .json file of module -> device."
        ),
    ] = DEFAULTS.device_map,
    offload_folder: Annotated[
        Path | None, typer.Option(help="With --device-map: where the layers that fit nowhere else are kept.")
    ] = DEFAULTS.offload_folder,
    device: Device = DEFAULT_DEVICE,
    dtype: DType = DEFAULT_DTYPE,
    max_length: Annotated[
        int | None, typer.Option(help="Truncate sentences to this many tokens (counted in run.json).")
    ] = DEFAULTS.max_length,
    window: Annotated[int, typer.Option(help="Diagonal metric: mass within +-WINDOW of the query.")] = DEFAULTS.window,
    batch_size: Annotated[
        str | None,
        typer.Option(help="Sentences per forward pass, or auto (default): as many as --max-memory allows (<= 256)."),
    ] = DEFAULTS.batch_size,
    max_memory: Annotated[
        str | None,
        typer.Option(help="Memory for activations and attention, e.g. 8GiB. Default: half the free device memory."),
    ] = DEFAULTS.max_memory,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads the run may use (changes no number). Default: torch's.")
    ] = DEFAULTS.threads,
    layers: Annotated[
        str | None, typer.Option(help="Measure only these layers, e.g. 0-5,10. Later layers are not even run.")
    ] = DEFAULTS.layers,
    sentence_heads: Annotated[
        bool, typer.Option(help="Also write per-(sentence, layer, head) metrics (large for big corpora).")
    ] = DEFAULTS.sentence_heads,
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
    bootstrap_seed: Annotated[
        int, typer.Option(help="Seed of the bootstrap: the intervals are a pure function of it and the corpus.")
    ] = DEFAULTS.bootstrap_seed,
    sink_threshold: Annotated[
        float, typer.Option(help="sink_rate counts rows whose first-token mass exceeds this.")
    ] = DEFAULTS.sink_threshold,
    examples: Annotated[
        int,
        typer.Option(
            help="Corpus sentences (spread over lengths, up to 32 tokens) whose attention the report keeps whole, "
            "0 to 50; with the probes, the probe sequence too."
        ),
    ] = DEFAULTS.examples,
    chunk_sentences: Annotated[
        int,
        typer.Option(
            help="Sentences tokenized and sorted together: the unit of host memory, checkpoints and data-parallel "
            "work (chunk i goes to rank i % ranks)."
        ),
    ] = DEFAULTS.chunk_sentences,
    charts: Annotated[bool, typer.Option(help="Draw the charts after measuring.")] = True,
    page: Annotated[bool, typer.Option(help="Write report.html, the self-contained page to explore the heads.")] = True,
    chart_format: Format = DEFAULT_FORMAT,
    local_min_locality: LocalMinLocality = THRESHOLDS.local_min_locality,
    copy_max_norm_entropy: CopyMaxNormEntropy = THRESHOLDS.copy_max_norm_entropy,
    broad_min_norm_entropy: BroadMinNormEntropy = THRESHOLDS.broad_min_norm_entropy,
    role_probe_min: RoleProbeMin = ROLE_THRESHOLDS.probe_min,
    role_sink_rate_min: RoleSinkRateMin = ROLE_THRESHOLDS.sink_rate_min,
    role_offset_share_min: RoleOffsetShareMin = ROLE_THRESHOLDS.offset_share_min,
) -> None:
    """Measure every attention head of MODEL on a corpus, classify the heads, write tables and charts."""
    from headscope.config import settings_from_command_line
    from headscope.model.loading import quiet_transformers, resolve_source
    from headscope.run.analyze import analyze as run_analysis
    from headscope.run.progress import RichReporter

    seams = ctx.obj if isinstance(ctx.obj, dict) else {}  # tests hand in their own loader or reporter
    reporter = seams.get("reporter") or RichReporter()
    quiet_transformers(show_progress=getattr(reporter, "console", None) is not None and reporter.console.is_terminal)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        thresholds = Thresholds(local_min_locality, copy_max_norm_entropy, broad_min_norm_entropy)
        roles = RoleThresholds(role_probe_min, role_sink_rate_min, role_offset_share_min)
    with user_errors(ctx):
        out = out or Path("reports") / resolve_source(model).slug
        seams = {"loader": seams["loader"]} if "loader" in seams else {}
        report = run_analysis(
            model,
            corpus,
            out=out,
            overwrite=overwrite,
            resume=resume,
            config=settings,
            thresholds=thresholds,
            roles=roles,
            charts=chart_format.value if charts else None,
            page=page,
            reporter=reporter,
            **seams,
        )
    if report is None:  # a data-parallel rank other than 0: rank 0 reports
        return
    from headscope.cli.printing import print_analysis

    print_analysis(report)


@app.command()
def classify(
    ctx: typer.Context,
    report: Annotated[Path, typer.Argument(help="A folder written by `headscope analyze`.")],
    out: Annotated[
        Path | None, typer.Option(help="Write the re-labelled report into this new folder instead of in place.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a report at --out (one classify --out wrote).")] = False,
    local_min_locality: LocalMinLocality = THRESHOLDS.local_min_locality,
    copy_max_norm_entropy: CopyMaxNormEntropy = THRESHOLDS.copy_max_norm_entropy,
    broad_min_norm_entropy: BroadMinNormEntropy = THRESHOLDS.broad_min_norm_entropy,
    role_probe_min: RoleProbeMin = ROLE_THRESHOLDS.probe_min,
    role_sink_rate_min: RoleSinkRateMin = ROLE_THRESHOLDS.sink_rate_min,
    role_offset_share_min: RoleOffsetShareMin = ROLE_THRESHOLDS.offset_share_min,
) -> None:
    """Re-label the heads of REPORT (types and roles) with other thresholds (no model needed)."""
    from headscope.cli.printing import print_label_counts, print_role_heads
    from headscope.report.write import reclassify

    with usage_errors(ctx):
        thresholds = Thresholds(local_min_locality, copy_max_norm_entropy, broad_min_norm_entropy)
        roles = RoleThresholds(role_probe_min, role_sink_rate_min, role_offset_share_min)
    with user_errors(ctx):
        relabelled = reclassify(report, thresholds, roles, out=out, overwrite=overwrite)
    print_label_counts(relabelled, str(report))
    print_role_heads(relabelled)
    say(f"wrote {(out or report) / 'heads.parquet'}")


@app.command()
def plot(
    ctx: typer.Context,
    report: Annotated[Path, typer.Argument(help="A folder written by `headscope analyze`.")],
    out: Annotated[Path | None, typer.Option(help="A new folder for the charts (default: REPORT itself).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace the charts an earlier plot --out drew there.")] = False,
    chart_format: Format = DEFAULT_FORMAT,
    page: Annotated[bool, typer.Option(help="Also rewrite report.html.")] = True,
) -> None:
    """Draw the charts and report.html of REPORT from its tables (no model needed)."""
    from headscope.report.write import plot_report

    with user_errors(ctx):
        written, failed = plot_report(report, fmt=chart_format.value, out=out, page=page, overwrite=overwrite)
        for path in written:
            say(f"wrote {path}")
        if failed:
            raise HeadscopeError(f"could not draw {', '.join(failed)}")


@app.command()
def compare(
    ctx: typer.Context,
    a: Annotated[Path, typer.Argument(help="Report A, the baseline (a folder written by `headscope analyze`).")],
    b: Annotated[Path, typer.Argument(help="Report B; deltas are B - A.")],
    out: Annotated[
        Path | None, typer.Option(help="Folder for the comparison. Default: reports/compare-<A>-vs-<B>.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing comparison folder (and nothing else).")] = False,
    charts: Annotated[bool, typer.Option(help="Draw the comparison charts.")] = True,
    page: Annotated[bool, typer.Option(help="Write compare.html, the self-contained page of the comparison.")] = True,
    chart_format: Format = DEFAULT_FORMAT,
    replicates: Annotated[
        int, typer.Option(help="Paired bootstrap replicates (same sentences in both reports), 2 to 100,000.")
    ] = COMPARE_REPLICATES,
    seed: Annotated[
        int, typer.Option(help="Bootstrap seed (0 to 2**64 - 1): the intervals are a pure function of it.")
    ] = 0,
) -> None:
    """Compare two reports head by head (B - A), with 95% intervals and a false-discovery-rate flag."""
    from headscope.cli.printing import print_comparison
    from headscope.config import check_replicates, check_seed
    from headscope.report.compare import compare_reports
    from headscope.report.write import write_comparison

    with usage_errors(ctx):
        check_replicates("--replicates", replicates)
        check_seed("--seed", seed)
    with user_errors(ctx):
        comparison = compare_reports(a, b, replicates=replicates, seed=seed)
        out = out or Path("reports") / f"compare-{a.resolve().name}-vs-{b.resolve().name}"
        target, failed = write_comparison(
            comparison, out, a=a, b=b, overwrite=overwrite, fmt=chart_format.value if charts else None, page=page
        )
    print_comparison(comparison)
    if failed:
        say(f"warning: could not draw {', '.join(failed)}; the tables are written", err=True)
    say(f"wrote {target}/")


app.command()(inspect)  # in its own module, with its options
app.command()(ablate)
app.command()(prune)


def main() -> None:
    signal.signal(signal.SIGTERM, raise_terminated)
    if not sys.stderr.isatty():
        # No progress bars in a log: tqdm (transformers' GGUF de-quantizer uses it bare) reads this variable once,
        # when it is first imported, so it is set before anything imports it.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        app()
    # A signal before a command's own handler is in place (while Typer builds the commands, or a command imports
    # torch): still one line and the signal's exit code.
    except KeyboardInterrupt:
        say(f"{INTERRUPTED[130]}.", err=True)
        sys.exit(130)
    except Terminated:
        say(f"{INTERRUPTED[143]}.", err=True)
        sys.exit(143)
