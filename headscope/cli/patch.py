"""`headscope patch`: which heads carry a behaviour, by activation patching on prompt pairs (over headscope.patch)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS)
def patch(
    ctx: typer.Context,
    model: o.ModelArgument,
    pairs: o.Pairs,
    what: o.What = o.DEFAULT_WHAT,
    direction: o.Direction = o.DEFAULT_DIRECTION,
    positions: o.Positions = o.DEFAULT_POSITIONS,
    heads: o.HeadsToPatch = None,
    layers: o.Layers = o.DEFAULTS.layers,
    metric: o.Metric = o.DEFAULT_METRIC,
    fast: o.Fast = False,
    parts: o.Parts = False,
    report: o.Report = None,
    out: o.OutPatch = None,
    overwrite: o.Overwrite = False,
    charts: o.Charts = True,
    chart_format: o.Format = o.DEFAULT_FORMAT,
    bootstrap: o.Bootstrap = o.DEFAULTS.bootstrap,
    bootstrap_seed: o.BootstrapSeed = o.DEFAULTS.bootstrap_seed,
    batch_size: o.BatchSize = o.DEFAULTS.batch_size,
    **options,
) -> None:
    """Patch each head from the other prompt of each pair: which heads carry the behaviour (patching.parquet)."""
    from pathlib import Path

    from headscope.arguments import parse_heads
    from headscope.cli.printing import print_patching
    from headscope.commands.patch import check_request
    from headscope.commands.patch import patch as run_patching
    from headscope.config import settings_from_command_line
    from headscope.model.loading import resolve_source

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        chosen = sorted({head for text in heads or () for head in parse_heads(text)})
        check_request(what.value, direction.value, positions.value, metric.value, fast,
                      chart_format.value if charts else None, parts)  # fmt: skip
    with user_errors(ctx):
        found = run_patching(
            model,
            pairs,
            what=what.value,
            direction=direction.value,
            positions=positions.value,
            heads=chosen,
            metric=metric.value,
            fast=fast,
            parts=parts,
            report=report,
            out=out or Path("reports") / f"patch-{resolve_source(model).slug}",
            overwrite=overwrite,
            charts=chart_format.value if charts else None,
            config=settings,
            reporter=reporter,
            **loader,
        )
    print_patching(found)
