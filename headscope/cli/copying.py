"""`headscope copying`: what each head's weights copy, the OV copying score, with no data (over headscope.copying)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors


@o.takes(o.MODEL_OPTIONS)
def copying(ctx: typer.Context, model: o.ModelArgument, count: o.CopyingCount = 10, **options) -> None:
    """Each head's OV copying score from its weights alone: 1 copies what it attends to, -1 suppresses it."""
    from headscope.cli.printing import print_copying
    from headscope.commands.copying import copying as run_copying
    from headscope.config import settings_from_command_line

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
    with user_errors(ctx):
        found = run_copying(model, config=settings, reporter=reporter, **loader)
    print_copying(found, count)
