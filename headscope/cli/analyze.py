"""`headscope analyze`: measure every head on a corpus, classify the heads, write tables and charts."""

from __future__ import annotations

from pathlib import Path

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, usage_errors, user_errors


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.CORPUS_OPTIONS)
def analyze(
    ctx: typer.Context,
    model: o.ModelArgument,
    corpus: o.Corpus = None,
    out: o.OutAnalyze = None,
    overwrite: o.Overwrite = False,
    resume: o.Resume = False,
    # From here to the label rules, every option is the RunConfig field of the same name (its default there).
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
    bootstrap: o.Bootstrap = o.DEFAULTS.bootstrap,
    bootstrap_seed: o.BootstrapSeed = o.DEFAULTS.bootstrap_seed,
    sink_threshold: o.SinkThreshold = o.DEFAULTS.sink_threshold,
    examples: o.Examples = o.DEFAULTS.examples,
    exemplars: o.Exemplars = o.DEFAULTS.exemplars,
    detectors: o.Detectors = None,
    chunk_sentences: o.ChunkSentences = o.DEFAULTS.chunk_sentences,
    charts: o.Charts = True,
    page: o.Page = True,
    chart_format: o.Format = o.DEFAULT_FORMAT,
    local_min_locality: o.LocalMinLocality = o.THRESHOLDS.local_min_locality,
    copy_max_norm_entropy: o.CopyMaxNormEntropy = o.THRESHOLDS.copy_max_norm_entropy,
    broad_min_norm_entropy: o.BroadMinNormEntropy = o.THRESHOLDS.broad_min_norm_entropy,
    role_probe_min: o.RoleProbeMin = o.ROLE_THRESHOLDS.probe_min,
    role_sink_rate_min: o.RoleSinkRateMin = o.ROLE_THRESHOLDS.sink_rate_min,
    role_offset_share_min: o.RoleOffsetShareMin = o.ROLE_THRESHOLDS.offset_share_min,
    role_dormant_max_write_ratio: o.RoleDormantMaxWriteRatio = o.ROLE_THRESHOLDS.dormant_max_write_ratio,
    role_streaming_max_far_mass: o.RoleStreamingMaxFarMass = o.ROLE_THRESHOLDS.streaming_max_far_mass,
    role_retrieval_min: o.RoleRetrievalMin = o.ROLE_THRESHOLDS.retrieval_min,
    **options,
) -> None:
    """Measure every attention head of MODEL on a corpus, classify the heads, write tables and charts."""
    from headscope.commands.analyze import analyze as run_analysis
    from headscope.config import RoleThresholds, Thresholds, settings_from_command_line
    from headscope.model.loading import resolve_source

    reporter, loader = seams(ctx)
    with usage_errors(ctx):
        settings = settings_from_command_line(ctx.params)
        thresholds = Thresholds(local_min_locality, copy_max_norm_entropy, broad_min_norm_entropy)
        roles = RoleThresholds(role_probe_min, role_sink_rate_min, role_offset_share_min, role_dormant_max_write_ratio,
                               role_streaming_max_far_mass, role_retrieval_min)  # fmt: skip
    with user_errors(ctx):
        report = run_analysis(
            model,
            corpus,
            out=out or Path("reports") / resolve_source(model).slug,
            overwrite=overwrite,
            resume=resume,
            config=settings,
            thresholds=thresholds,
            roles=roles,
            charts=chart_format.value if charts else None,
            page=page,
            reporter=reporter,
            **loader,
        )
    if report is None:  # a data-parallel rank other than 0: rank 0 reports
        return
    from headscope.cli.printing import print_analysis

    print_analysis(report)
