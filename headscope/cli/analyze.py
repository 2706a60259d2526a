"""`headscope analyze`: measure every head on a corpus, classify the heads, write tables and charts."""

from __future__ import annotations

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors, written


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.CORPUS_OPTIONS, o.BOOTSTRAP_OPTIONS, o.output("analyze"), o.RESUME_OPTIONS,
         o.CHART_OPTIONS, o.PAGE_OPTIONS, o.LABEL_RULES)  # fmt: skip
def analyze(
    ctx: typer.Context,
    model: o.ModelArgument,
    corpus: o.Corpus = None,
    # Every option here is the RunConfig field of the same name (its default there).
    window: o.Window = o.DEFAULTS.window,
    stream_window: o.StreamWindow = o.DEFAULTS.stream_window,
    stream_sink: o.StreamSink = o.DEFAULTS.stream_sink,
    batch_size: o.BatchSize = o.DEFAULTS.batch_size,
    layers: o.Layers = o.DEFAULTS.layers,
    sentence_heads: o.SentenceHeads = o.DEFAULTS.sentence_heads,
    probes: o.Probes = o.DEFAULTS.probes,
    probe_seeds: o.ProbeSeeds = o.DEFAULTS.probe_seeds,
    probe_length: o.ProbeLength = o.DEFAULTS.probe_length,
    retrieval_length: o.RetrievalLength = o.DEFAULTS.retrieval_length,
    copying: o.Copying = o.DEFAULTS.copying,
    importance: o.Importance = o.DEFAULT_IMPORTANCE,
    check_dormant: o.CheckDormant = o.DEFAULTS.check_dormant,
    dormant_tolerance: o.DormantTolerance = o.DEFAULTS.dormant_tolerance,
    sink_threshold: o.SinkThreshold = o.DEFAULTS.sink_threshold,
    examples: o.Examples = o.DEFAULTS.examples,
    exemplars: o.Exemplars = o.DEFAULTS.exemplars,
    detectors: o.Detectors = None,
    chunk_sentences: o.ChunkSentences = o.DEFAULTS.chunk_sentences,
    **options,
) -> None:
    """Measure every attention head of MODEL on a corpus, classify the heads, write tables and charts."""
    from headscope.commands.analyze import analyze as run_analysis
    from headscope.config import label_rules_from_command_line, settings_from_command_line

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        thresholds, roles = label_rules_from_command_line(ctx.params)
    with user_errors(ctx):
        report = run_analysis(
            model,
            corpus,
            config=settings,
            thresholds=thresholds,
            roles=roles,
            reporter=reporter,
            **written(ctx, model=model),
            **loader,
        )
    if report is None:  # a data-parallel rank other than 0: rank 0 reports
        return
    from headscope.cli.printing import print_analysis

    print_analysis(report)
