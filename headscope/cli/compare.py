"""`headscope compare`: two reports head by head (B - A), with intervals and a false-discovery-rate flag."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import say, usage_errors, user_errors, written
from headscope.config import COMPARE_REPLICATES


@o.takes(o.output("compare"), o.CHART_OPTIONS, o.PAGE_OPTIONS)
def compare(
    ctx: typer.Context,
    a: o.ReportA,
    b: o.ReportB,
    replicates: o.Replicates = COMPARE_REPLICATES,
    seed: o.Seed = 0,
    **options,
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
        output = written(ctx, a=a.resolve().name, b=b.resolve().name)
        target, failed = write_comparison(comparison, output.pop("out"), a=a, b=b, fmt=output.pop("charts"), **output)
    print_comparison(comparison)
    if failed:
        say(f"warning: could not draw {', '.join(failed)}; the tables are written", err=True)
    say(f"wrote {target}/")
