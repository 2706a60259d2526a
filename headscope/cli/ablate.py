"""`headscope ablate`: groups of heads removed together, and the loss they cost (over headscope.ablate)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors, written


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.CORPUS_OPTIONS, o.BOOTSTRAP_OPTIONS, o.output("ablate"))
def ablate(
    ctx: typer.Context,
    model: o.ModelArgument,
    heads: o.HeadGroups = None,
    role: o.Role = None,
    each_role: o.EachRole = False,
    report: o.Report = None,
    mode: o.Mode = o.DEFAULT_MODE,
    kept_window: o.KeptWindow = None,
    kept_sink: o.KeptSink = None,
    loss_on: o.LossOn = o.DEFAULT_LOSS_ON,
    pairs: o.AblatePairs = None,
    corpus: o.Corpus = None,
    **options,
) -> None:
    """Remove groups of heads together and measure the loss they cost, with a 95% interval (ablation.json)."""
    from headscope.arguments import parse_heads
    from headscope.cli.printing import print_ablation
    from headscope.commands.ablate import ablate as run_ablation
    from headscope.commands.ablate import check_request
    from headscope.config import settings_from_command_line
    from headscope.interventions.removal import window_of
    from headscope.run.distributed import ranks_from_env

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        groups = [parse_heads(text) for text in heads or ()]
        check_request(groups, role or (), each_role, report, mode.value, loss_on.value)
        window_of(mode.value, kept_window, kept_sink)
    with user_errors(ctx):
        found = run_ablation(
            model,
            corpus,
            heads=groups,
            roles=role or (),
            each_role=each_role,
            report=report,
            mode=mode.value,
            window=kept_window,
            sink=kept_sink,
            loss_on=loss_on.value,
            pairs=pairs,
            **written(ctx, model=model),
            config=settings,
            reporter=reporter,
            **loader,
        )
    if ranks_from_env().main:  # under torchrun every rank has the result; rank 0 speaks
        print_ablation(found)
