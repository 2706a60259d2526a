"""`headscope classify`: re-label a report's heads with other thresholds (no model needed)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import say, usage_errors, user_errors


def classify(
    ctx: typer.Context,
    report: o.ReportArgument,
    out: o.Out = None,
    overwrite: o.Overwrite = False,
    local_min_locality: o.LocalMinLocality = o.THRESHOLDS.local_min_locality,
    copy_max_norm_entropy: o.CopyMaxNormEntropy = o.THRESHOLDS.copy_max_norm_entropy,
    broad_min_norm_entropy: o.BroadMinNormEntropy = o.THRESHOLDS.broad_min_norm_entropy,
    role_probe_min: o.RoleProbeMin = o.ROLE_THRESHOLDS.probe_min,
    role_sink_rate_min: o.RoleSinkRateMin = o.ROLE_THRESHOLDS.sink_rate_min,
    role_offset_share_min: o.RoleOffsetShareMin = o.ROLE_THRESHOLDS.offset_share_min,
    role_dormant_max_write_ratio: o.RoleDormantMaxWriteRatio = o.ROLE_THRESHOLDS.dormant_max_write_ratio,
) -> None:
    """Re-label the heads of REPORT (types and roles) with other thresholds (no model needed)."""
    from headscope.cli.printing import print_label_counts, print_role_heads
    from headscope.config import RoleThresholds, Thresholds
    from headscope.report.write import reclassify

    with usage_errors(ctx):
        thresholds = Thresholds(local_min_locality, copy_max_norm_entropy, broad_min_norm_entropy)
        roles = RoleThresholds(role_probe_min, role_sink_rate_min, role_offset_share_min, role_dormant_max_write_ratio)
    with user_errors(ctx):
        relabelled = reclassify(report, thresholds, roles, out=out, overwrite=overwrite)
    print_label_counts(relabelled, str(report))
    print_role_heads(relabelled)
    say(f"wrote {(out or report) / 'heads.parquet'}")
