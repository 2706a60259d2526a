"""`headscope inspect`: chosen heads' attention on chosen texts, over headscope.run.inspect."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from headscope.cli.common import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULTS,
    ROLE_THRESHOLDS,
    Device,
    DType,
    ModelArgument,
    Revision,
    RoleProbeMin,
    TextColumn,
    TrustRemoteCode,
    choices,
    usage_errors,
    user_errors,
)
from headscope.config import RoleThresholds
from headscope.errors import ConfigError

ProbeChoice = choices("ProbeChoice", ("induction", "duplicate", "previous"))


def inspect(
    ctx: typer.Context,
    model: ModelArgument,
    text: Annotated[list[str] | None, typer.Option(help="A text to inspect (repeat for more).")] = None,
    sentences: Annotated[str | None, typer.Option(help="Sentences of --corpus to inspect, by id: 0,5,10-12.")] = None,
    corpus: Annotated[
        Path | None, typer.Option(help="The corpus --sentences names (default: the shipped 100 sentences).")
    ] = None,
    probe: Annotated[
        list[ProbeChoice] | None,
        typer.Option(help="Add the probe sequence (repeated random tokens) and score each head on this probe."),
    ] = None,
    heads: Annotated[str | None, typer.Option(help="Heads as LAYER.HEAD: 18.6,17.4.")] = None,
    role: Annotated[
        list[str] | None,
        typer.Option(
            help="Heads of this role: from --report, or (induction, duplicate-token, previous-token) "
            "from the probes, run first."
        ),
    ] = None,
    report: Annotated[
        Path | None, typer.Option(help="A report of this model, for --role and the heads' roles.")
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="Only heads of these layers, e.g. 0-5,10 (alone: every head of them).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output folder. Default: reports/inspect-<model-name>.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an inspection folder (and nothing else).")] = False,
    page: Annotated[bool, typer.Option(help="Write inspect.html.")] = True,
    max_length: Annotated[int | None, typer.Option(help="Cut texts to this many tokens.")] = DEFAULTS.max_length,
    max_memory: Annotated[
        str | None,
        typer.Option(help="Memory for the kept attention and the forward pass, e.g. 8GiB. Default: half the free."),
    ] = DEFAULTS.max_memory,
    probe_length: Annotated[int, typer.Option(help="Random tokens per copy in probe sequences.")] = (
        DEFAULTS.probe_length
    ),
    probe_seeds: Annotated[int, typer.Option(help="Probe sequences run to find --role's heads.")] = (
        DEFAULTS.probe_seeds
    ),
    role_probe_min: RoleProbeMin = ROLE_THRESHOLDS.probe_min,
    text_column: TextColumn = DEFAULTS.text_column,
    device: Device = DEFAULT_DEVICE,
    dtype: DType = DEFAULT_DTYPE,
    threads: Annotated[int | None, typer.Option(help="CPU threads torch may use. Default: torch's.")] = (
        DEFAULTS.threads
    ),
    revision: Revision = DEFAULTS.revision,
    trust_remote_code: TrustRemoteCode = DEFAULTS.trust_remote_code,
) -> None:
    """Show chosen heads' attention on chosen texts, token by token (attention.parquet, inspect.html)."""
    from headscope.arguments import parse_heads, parse_ids
    from headscope.cli.printing import print_inspection
    from headscope.config import settings_from_command_line
    from headscope.model.loading import quiet_transformers, resolve_source
    from headscope.run.inspect import check_request
    from headscope.run.inspect import inspect as run_inspection
    from headscope.run.progress import RichReporter

    seams = ctx.obj if isinstance(ctx.obj, dict) else {}
    reporter = seams.get("reporter") or RichReporter()
    quiet_transformers(show_progress=getattr(reporter, "console", None) is not None and reporter.console.is_terminal)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        chosen = parse_heads(heads) if heads is not None else ()
        ids = parse_ids(sentences, "--sentences") if sentences is not None else ()
        roles = RoleThresholds(probe_min=role_probe_min)
        if corpus is not None and sentences is None:
            raise ConfigError("--corpus needs --sentences (the ids of the sentences to inspect, e.g. 0,5)")
        probes = [p.value for p in probe or ()]
        check_request(text or (), ids, probes, chosen, role or (), report)
    with user_errors(ctx):
        out = out or Path("reports") / f"inspect-{resolve_source(model).slug}"
        seams = {"loader": seams["loader"]} if "loader" in seams else {}
        found = run_inspection(
            model,
            texts=text or (),
            corpus=corpus,
            sentences=ids,
            probes=probes,
            heads=chosen,
            roles=role or (),
            report=report,
            out=out,
            overwrite=overwrite,
            page=page,
            config=settings,
            role_thresholds=roles,
            reporter=reporter,
            **seams,
        )
    print_inspection(found)
