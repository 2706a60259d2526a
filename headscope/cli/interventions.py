"""`headscope ablate` and `headscope prune`: heads removed together, over headscope.ablate and headscope.prune."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from headscope.cli.common import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_FORMAT,
    DEFAULTS,
    Device,
    DType,
    Format,
    ModelArgument,
    Revision,
    TextColumn,
    TrustRemoteCode,
    choices,
    usage_errors,
    user_errors,
)
from headscope.config import DEFAULT_REMOVAL, LOSS_ON, REMOVAL_MODES

ModeChoice = choices("ModeChoice", REMOVAL_MODES)
LossOnChoice = choices("LossOnChoice", LOSS_ON)
DEFAULT_MODE, DEFAULT_LOSS_ON = ModeChoice(DEFAULT_REMOVAL), LossOnChoice("all")

Mode = Annotated[
    ModeChoice, typer.Option(help="Remove a head by setting its output to 0, or to its mean over the corpus.")
]
Corpus = Annotated[Path | None, typer.Option(help="Sentence file (default: the shipped 100 sentences).")]
MaxLength = Annotated[int | None, typer.Option(help="Cut sentences to this many tokens.")]
MaxMemory = Annotated[
    str | None, typer.Option(help="Memory for activations and replicas, e.g. 8GiB. Default: half the free.")
]
Threads = Annotated[int | None, typer.Option(help="CPU threads torch may use. Default: torch's.")]
Overwrite = Annotated[bool, typer.Option(help="Replace a folder this command wrote before (and nothing else).")]


def _seams(ctx: typer.Context):
    from headscope.model.loading import quiet_transformers
    from headscope.run.progress import RichReporter

    seams = ctx.obj if isinstance(ctx.obj, dict) else {}  # tests hand in their own loader or reporter
    reporter = seams.get("reporter") or RichReporter()
    quiet_transformers(show_progress=getattr(reporter, "console", None) is not None and reporter.console.is_terminal)
    return reporter, ({"loader": seams["loader"]} if "loader" in seams else {})


def ablate(
    ctx: typer.Context,
    model: ModelArgument,
    heads: Annotated[
        list[str] | None, typer.Option(help="A group of heads removed together, as LAYER.HEAD: 18.6,17.4 (repeat).")
    ] = None,
    role: Annotated[list[str] | None, typer.Option(help="A group: every head of this role in --report.")] = None,
    each_role: Annotated[bool, typer.Option(help="A group per role of --report (but other).")] = False,
    report: Annotated[Path | None, typer.Option(help="A report of this model, for --role and --each-role.")] = None,
    mode: Mode = DEFAULT_MODE,
    loss_on: Annotated[
        LossOnChoice,
        typer.Option(help="Score every predicted token, or repeats only (x[t-1] x[t] seen before: induction's)."),
    ] = DEFAULT_LOSS_ON,
    corpus: Corpus = None,
    out: Annotated[Path | None, typer.Option(help="Output folder. Default: reports/ablate-<model-name>.")] = None,
    overwrite: Overwrite = False,
    bootstrap: Annotated[
        int, typer.Option(help="Bootstrap replicates for the 95% interval of each delta (0 skips it).")
    ] = DEFAULTS.bootstrap,
    bootstrap_seed: Annotated[int, typer.Option(help="Seed of the bootstrap.")] = DEFAULTS.bootstrap_seed,
    max_length: MaxLength = DEFAULTS.max_length,
    max_memory: MaxMemory = DEFAULTS.max_memory,
    text_column: TextColumn = DEFAULTS.text_column,
    device: Device = DEFAULT_DEVICE,
    dtype: DType = DEFAULT_DTYPE,
    threads: Threads = DEFAULTS.threads,
    revision: Revision = DEFAULTS.revision,
    trust_remote_code: TrustRemoteCode = DEFAULTS.trust_remote_code,
) -> None:
    """Remove groups of heads together and measure the loss they cost, with a 95% interval (ablation.json)."""
    from headscope.arguments import parse_heads
    from headscope.cli.printing import print_ablation
    from headscope.config import settings_from_command_line
    from headscope.interventions.ablate import ablate as run_ablation
    from headscope.interventions.ablate import check_request
    from headscope.model.loading import resolve_source

    reporter, seams = _seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        groups = [parse_heads(text) for text in heads or ()]
        check_request(groups, role or (), each_role, report, mode.value, loss_on.value)
    with user_errors(ctx):
        out = out or Path("reports") / f"ablate-{resolve_source(model).slug}"
        found = run_ablation(
            model,
            corpus,
            heads=groups,
            roles=role or (),
            each_role=each_role,
            report=report,
            mode=mode.value,
            loss_on=loss_on.value,
            out=out,
            overwrite=overwrite,
            config=settings,
            reporter=reporter,
            **seams,
        )
    print_ablation(found)


def prune(
    ctx: typer.Context,
    model: ModelArgument,
    budget: Annotated[float, typer.Option(help="Nats of corpus loss the removed heads may cost together.")],
    mode: Mode = DEFAULT_MODE,
    corpus: Corpus = None,
    out: Annotated[Path | None, typer.Option(help="Output folder. Default: reports/prune-<model-name>.")] = None,
    save_model: Annotated[
        Path | None,
        typer.Option(help="Also write the pruned model here (a transformers checkpoint), checked by loading it back."),
    ] = None,
    overwrite: Overwrite = False,
    charts: Annotated[bool, typer.Option(help="Draw the pruning curve.")] = True,
    chart_format: Format = DEFAULT_FORMAT,
    max_length: MaxLength = DEFAULTS.max_length,
    max_memory: MaxMemory = DEFAULTS.max_memory,
    text_column: TextColumn = DEFAULTS.text_column,
    device: Device = DEFAULT_DEVICE,
    dtype: DType = DEFAULT_DTYPE,
    threads: Threads = DEFAULTS.threads,
    revision: Revision = DEFAULTS.revision,
    trust_remote_code: TrustRemoteCode = DEFAULTS.trust_remote_code,
) -> None:
    """Remove as many heads as --budget allows, every step verified (prune.json, head_mask.parquet)."""
    from headscope.cli.printing import print_pruning
    from headscope.config import settings_from_command_line
    from headscope.interventions.prune import check_request
    from headscope.interventions.prune import prune as run_pruning
    from headscope.model.loading import resolve_source

    reporter, seams = _seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        check_request(budget, mode.value, chart_format.value if charts else None)
    with user_errors(ctx):
        out = out or Path("reports") / f"prune-{resolve_source(model).slug}"
        found = run_pruning(
            model,
            corpus,
            budget=budget,
            mode=mode.value,
            out=out,
            overwrite=overwrite,
            save_model=save_model,
            charts=chart_format.value if charts else None,
            config=settings,
            reporter=reporter,
            **seams,
        )
    print_pruning(found)
