"""`headscope circuit`: which components feed which, by edge attribution patching on prompt pairs (over
headscope.circuit)."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors, written


@o.takes(
    o.MODEL_OPTIONS,
    o.TEXT_OPTIONS,
    o.BOOTSTRAP_OPTIONS,
    o.output("circuit"),
    o.RESUME_OPTIONS,
    o.CHART_OPTIONS,
    o.PAGE_OPTIONS,
)
def circuit(
    ctx: typer.Context,
    model: o.ModelArgument,
    pairs: o.Pairs,
    method: o.EdgeMethod = o.DEFAULT_EDGE_METHOD,
    steps: o.Steps = o.DEFAULT_STEPS,
    verify: o.Verify = 10,
    target: o.Target = 0.8,
    curve: o.Curve = True,
    select: o.Select = o.DEFAULT_SELECT,
    by_role: o.ByRole = False,
    why: o.CircuitWhy = 0,
    report: o.Report = None,
    **options,
) -> None:
    """Score every edge between components (EAP-IG or EAP) and each component's direct logit attribution on prompt
    pairs (edges.parquet, nodes.parquet)."""
    from headscope.cli.printing import print_circuit
    from headscope.commands.circuit import check_request
    from headscope.commands.circuit import circuit as run_circuit
    from headscope.commands.circuit_why import check_count
    from headscope.config import settings_from_command_line

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        check_request(method.value, steps, verify, target, select.value)
        check_count(why)
    with user_errors(ctx):
        found = run_circuit(
            model,
            pairs,
            method=method.value,
            steps=steps,
            verify=verify,
            target=target,
            curve=curve,
            selection=select.value,
            by_role=by_role,
            why=why,
            report=report,
            **written(ctx, model=model),
            config=settings,
            reporter=reporter,
            **loader,
        )
    print_circuit(found)
