"""`headscope plot`: draw a report's charts and page again from its tables (no model needed)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import say, user_errors
from headscope.errors import HeadscopeError


def plot(
    ctx: typer.Context,
    report: o.ReportArgument,
    out: o.OutRewrite = None,
    overwrite: o.Overwrite = False,
    chart_format: o.Format = o.DEFAULT_FORMAT,
    page: o.Page = True,
) -> None:
    """Draw the charts and report.html of REPORT from its tables (no model needed)."""
    from headscope.report.write import plot_report

    with user_errors(ctx):
        written, failed = plot_report(report, fmt=chart_format.value, out=out, page=page, overwrite=overwrite)
        for path in written:
            say(f"wrote {path}")
        if failed:
            raise HeadscopeError(f"could not draw {', '.join(failed)}")
