"""`headscope patch`: which heads carry a behaviour, by activation patching on prompt pairs (over headscope.patch)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import chart_format, seams, usage_errors, user_errors, written


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.BOOTSTRAP_OPTIONS, o.output("patch"), o.CHART_OPTIONS)
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
    batch_size: o.BatchSize = o.DEFAULTS.batch_size,
    **options,
) -> None:
    """Patch each head from the other prompt of each pair: which heads carry the behaviour (patching.parquet)."""
    from headscope.arguments import parse_heads
    from headscope.cli.printing import print_patching
    from headscope.commands.patch import check_request
    from headscope.commands.patch import patch as run_patching
    from headscope.config import settings_from_command_line

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        chosen = sorted({head for text in heads or () for head in parse_heads(text)})
        check_request(what.value, direction.value, positions.value, metric.value, fast,
                      chart_format(ctx.params), parts)  # fmt: skip
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
            **written(ctx, model=model),
            config=settings,
            reporter=reporter,
            **loader,
        )
    print_patching(found)
