"""`headscope prune`: as many heads removed as a loss budget allows, every step verified (over headscope.prune)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import chart_format, seams, usage_errors, user_errors, written


@o.takes(
    o.MODEL_OPTIONS,
    o.TEXT_OPTIONS,
    o.CORPUS_OPTIONS,
    o.output("prune"),
    o.RESUME_OPTIONS,
    o.CHART_OPTIONS,
    o.PAGE_OPTIONS,
)
def prune(
    ctx: typer.Context,
    model: o.ModelArgument,
    budget: o.Budget,
    mode: o.Mode = o.DEFAULT_MODE,
    kept_window: o.KeptWindow = None,
    kept_sink: o.KeptSink = None,
    corpus: o.Corpus = None,
    save_model: o.SaveModel = None,
    max_rounds: o.MaxRounds = None,
    patience: o.Patience = o.DEFAULT_PATIENCE,
    layers: o.Layers = o.DEFAULTS.layers,
    **options,
) -> None:
    """Remove as many heads as --budget allows, every step verified (prune.json, head_mask.parquet)."""
    from headscope.cli.printing import print_pruning
    from headscope.commands.prune import check_request
    from headscope.commands.prune import prune as run_pruning
    from headscope.config import settings_from_command_line
    from headscope.interventions.removal import window_of
    from headscope.run.distributed import ranks_from_env

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        check_request(budget, mode.value, chart_format(ctx.params), max_rounds=max_rounds,
                      patience=patience, saving=save_model is not None)  # fmt: skip
        window_of(mode.value, kept_window, kept_sink)
    with user_errors(ctx):
        found = run_pruning(
            model,
            corpus,
            budget=budget,
            mode=mode.value,
            window=kept_window,
            sink=kept_sink,
            **written(ctx, model=model),
            save_model=save_model,
            max_rounds=max_rounds,
            patience=patience,
            config=settings,
            reporter=reporter,
            **loader,
        )
    if ranks_from_env().main:  # under torchrun every rank has the result; rank 0 speaks
        print_pruning(found)
