"""`headscope classify`: re-label a report's heads with other thresholds (no model needed)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import say, usage_errors, user_errors


def classify(
    ctx: typer.Context,
    report: o.ReportArgument,
    out: o.OutRewrite = None,
    overwrite: o.Overwrite = False,
    local_min_locality: o.recorded(o.LocalMinLocality) = None,
    copy_max_norm_entropy: o.recorded(o.CopyMaxNormEntropy) = None,
    broad_min_norm_entropy: o.recorded(o.BroadMinNormEntropy) = None,
    role_probe_min: o.recorded(o.RoleProbeMin) = None,
    role_sink_rate_min: o.recorded(o.RoleSinkRateMin) = None,
    role_offset_share_min: o.recorded(o.RoleOffsetShareMin) = None,
    role_dormant_max_write_ratio: o.recorded(o.RoleDormantMaxWriteRatio) = None,
    role_streaming_max_far_mass: o.recorded(o.RoleStreamingMaxFarMass) = None,
    role_retrieval_min: o.recorded(o.RoleRetrievalMin) = None,
) -> None:
    """Re-label the heads of REPORT (types and roles) with other thresholds (no model needed). With no threshold
    given it prints the report's labels and writes nothing; with some, the thresholds not given keep the report's
    values, and the report is rewritten in place (heads.parquet, run.json, its charts and report.html, together)
    or written anew into --out."""
    import dataclasses

    from headscope.cli.printing import print_label_counts, print_role_heads
    from headscope.report.report import Report
    from headscope.report.write import reclassify

    given = {name: value for name, value in ctx.params.items() if name not in ("report", "out", "overwrite")}
    changed = {name: value for name, value in given.items() if value is not None}
    with user_errors(ctx):
        opened = Report.open(report).checked()
        recorded = opened.thresholds, opened.role_thresholds
    with usage_errors(ctx):
        thresholds = dataclasses.replace(recorded[0], **{k: v for k, v in changed.items() if not k.startswith("role_")})
        roles = dataclasses.replace(recorded[1], **{k.removeprefix("role_"): v for k, v in changed.items()
                                                    if k.startswith("role_")})  # fmt: skip
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
