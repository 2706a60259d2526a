"""`headscope compare`: two reports head by head (B - A), with intervals and a false-discovery-rate flag."""

from __future__ import annotations

from pathlib import Path

import typer

import headscope.cli.options as o
from headscope.cli.common import say, usage_errors, user_errors
from headscope.config import COMPARE_REPLICATES


def compare(
    ctx: typer.Context,
    a: o.ReportA,
    b: o.ReportB,
    out: o.OutCompare = None,
    overwrite: o.Overwrite = False,
    charts: o.Charts = True,
    page: o.Page = True,
    chart_format: o.Format = o.DEFAULT_FORMAT,
    replicates: o.Replicates = COMPARE_REPLICATES,
    seed: o.Seed = 0,
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
        out = out or Path("reports") / f"compare-{a.resolve().name}-vs-{b.resolve().name}"
        target, failed = write_comparison(
            comparison, out, a=a, b=b, overwrite=overwrite, fmt=chart_format.value if charts else None, page=page
        )
    print_comparison(comparison)
    if failed:
        say(f"warning: could not draw {', '.join(failed)}; the tables are written", err=True)
    say(f"wrote {target}/")
