"""`headscope inspect`: chosen heads' attention on chosen texts, token by token."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors, written


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.CORPUS_OPTIONS, o.output("inspect"), o.PAGE_OPTIONS, o.PROBE_ROLE_RULE)
def inspect(
    ctx: typer.Context,
    model: o.ModelArgument,
    text: o.Text = None,
    sentences: o.Sentences = None,
    corpus: o.Corpus = None,
    probe: o.Probe = None,
    heads: o.HeadsToInspect = None,
    role: o.Role = None,
    report: o.Report = None,
    exemplars_of: o.ExemplarsOf = None,
    why: o.Why = None,
    layers: o.Layers = o.DEFAULTS.layers,
    probe_length: o.ProbeLength = o.DEFAULTS.probe_length,
    probe_seeds: o.ProbeSeeds = o.DEFAULTS.probe_seeds,
    **options,
) -> None:
    """Show chosen heads' attention on chosen texts, token by token (attention.parquet, inspect.html)."""
    from headscope.arguments import parse_heads, parse_ids
    from headscope.cli.printing import print_inspection
    from headscope.commands.exemplar_texts import report_as_model
    from headscope.commands.inspect import check_request, one_head
    from headscope.commands.inspect import inspect as run_inspection
    from headscope.commands.why_rows import as_why, check_why
    from headscope.config import label_rules_from_command_line, settings_from_command_line
    from headscope.errors import ConfigError

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        chosen = tuple(sorted({head for text in heads or () for head in parse_heads(text)}))
        ids = parse_ids(sentences, "--sentences") if sentences is not None else ()
        _, roles = label_rules_from_command_line(ctx.params)
        if corpus is not None and sentences is None and exemplars_of is None:
            raise ConfigError("--corpus needs --sentences (the ids of the sentences to inspect, e.g. 0,5)")
        probes = [p.value for p in probe or ()]
        exemplar_head = None
        if exemplars_of is not None:
            exemplar_head = one_head(exemplars_of)
            model, report = report_as_model(model, report)
        check_request(text or (), ids, probes, chosen, role or (), report, exemplar_head)
        asked = as_why(why)
        check_why(asked, heads=chosen, roles=role or (), exemplars=exemplar_head)
    with user_errors(ctx):
        found = run_inspection(
            model,
            texts=text or (),
            corpus=corpus,
            sentences=ids,
            probes=probes,
            heads=chosen,
            roles=role or (),
            report=report,
            exemplars=exemplar_head,
            why=[request.name for request in asked],
            **written(ctx, model=model),
            config=settings,
            role_thresholds=roles,
            reporter=reporter,
            **loader,
        )
    print_inspection(found)
