"""`headscope classify`: re-label a report's heads with other thresholds (no model needed)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import say, usage_errors, user_errors


@o.takes(o.REWRITE_OUTPUT, o.RECORDED_LABEL_RULES)
def classify(ctx: typer.Context, report: o.ReportArgument, **options) -> None:
    """Re-label the heads of REPORT (types and roles) with other thresholds (no model needed). With no threshold
    given it prints the report's labels and writes nothing; with some, the thresholds not given keep the report's
    values, and the report is rewritten in place (heads.parquet, run.json, its charts and report.html, together)
    or written anew into --out."""
    from headscope.cli.printing import print_label_counts, print_role_heads
    from headscope.config import label_rules_from_command_line
    from headscope.report.report import Report
    from headscope.report.write import reclassify

    out, overwrite = options["out"], options["overwrite"]
    changed = {name for name, _, _ in o.RECORDED_LABEL_RULES if options[name] is not None}
    with user_errors(ctx):
        opened = Report.open(report).checked()
        recorded = opened.thresholds, opened.role_thresholds
    with usage_errors(ctx):
        thresholds, roles = label_rules_from_command_line(options, recorded)
    if not changed and out is None:  # nothing to change: the labels as they are, nothing written
        print_label_counts(opened, str(report))
        print_role_heads(opened)
        say("nothing written: give a threshold to re-label (the report's own are used for the rest)")
        return
    with user_errors(ctx):
        relabelled, failed = reclassify(report, thresholds, roles, out=out, overwrite=overwrite)
    print_label_counts(relabelled, str(report))
    print_role_heads(relabelled)
    say(f"wrote {(out or report) / 'heads.parquet'}" + ("" if out else " and redrew what shows the labels"))
    for what in failed:
        say(f"warning: could not redraw {what}; `headscope plot {report}` tries again", err=True)
