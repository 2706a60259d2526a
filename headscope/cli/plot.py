"""`headscope plot`: draw a report's charts and page again from its tables (no model needed)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import say, user_errors
from headscope.errors import HeadscopeError


@o.takes(o.REWRITE_OUTPUT, o.FORMAT_OPTIONS, o.PAGE_OPTIONS)
def plot(ctx: typer.Context, report: o.ReportArgument, **options) -> None:
    """Draw the charts and report.html of REPORT from its tables (no model needed)."""
    from headscope.report.write import plot_report

    with user_errors(ctx):
        drawn, failed = plot_report(report, fmt=options["chart_format"].value, out=options["out"], page=options["page"],
                                    overwrite=options["overwrite"])  # fmt: skip
        for path in drawn:
            say(f"wrote {path}")
        if failed:
            raise HeadscopeError(f"could not draw {', '.join(failed)}")
