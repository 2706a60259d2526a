"""analyze(): the one entry point the CLI (and notebooks) call. It orchestrates; every step lives elsewhere.

    settings, corpus, output folder  checked before anything loads (config, corpus, output)
    the model                        read its config, check the settings against it, then load (loading)
    the plan                         resolved once (plan); a resumed run or another rank resolves the same
    the passes                       with the model attached (capture): the corpus (corpus_pass), the probes,
                                     head importance and the example sentence (measures/), one feed (feed)
    the report                       tables and run.json (assemble), charts and page (report/write)

With `out`, the work folder is the report's staging folder, published at the end; without, a temporary
folder whose per-sentence tables are read back into the result.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pandas as pd
import torch

from headscope.arguments import as_path
from headscope.commands.analysis import Analysis, labelled_heads, write_tables
from headscope.config import CHART_FORMATS, RoleThresholds, RunConfig, Thresholds, check_rules
from headscope.errors import ConfigError, OutputError
from headscope.estimates import ONE_SENTENCE_NOTE
from headscope.interventions.copying_cache import cached_copying
from headscope.interventions.dormant import DormantCheck, check_dormant
from headscope.interventions.importance import check_importance_fits, run_importance
from headscope.layout import SENTENCE_HEADS_FILE, SENTENCES_FILE
from headscope.measures.probes import ProbeSpec, check_probes, probe_sequences, run_probes
from headscope.measures.retrieval import check_retrieval, run_retrieval
from headscope.model.attention import cpu_kernel
from headscope.model.capture import attached
from headscope.model.loading import (
    LoadedModel,
    Loader,
    load_for_run,
)
from headscope.progress import Reporter
from headscope.report.report import Report
from headscope.run.checkpoint import PartFiles, Progress
from headscope.run.corpus import Corpus
from headscope.run.corpus_pass import measure_corpus
from headscope.run.distributed import (
    ONE_PROCESS,
    broadcast,
    together,
)
from headscope.run.example_views import example_views
from headscope.run.feed import CorpusFeed
from headscope.run.plan import Plan, needs_lm_head, resized
from headscope.run.record import Timings, fingerprint
from headscope.run.setup import CommandRun


def analyze(
    model: str | LoadedModel,
    corpus: str | Path | Corpus | list[str] | None = None,
    *,
    out: str | Path | None = None,
    overwrite: bool = False,
    resume: bool = False,
    config: RunConfig | None = None,
    thresholds: Thresholds | None = None,
    roles: RoleThresholds | None = None,
    charts: str | None = CHART_FORMATS[0],
    page: bool = True,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Report | None:
    """Measure every attention head of `model` on `corpus`; return the report (also written to `out`).

    Under torchrun (WORLD_SIZE > 1) the corpus is split between the ranks (see headscope.run.distributed): rank 0
    returns the report and writes it; the other ranks return None.

    Args:
        model: hub id, local folder, .gguf path, alias (`smollm2`) or an already loaded model (left as it was).
        corpus: file path, list of sentences, or None for the shipped 100-sentence corpus.
        out: folder to write the tables, run.json, charts and page into (nothing is kept when None).
        overwrite: replace `out` if it holds a headscope report (only once the new report is complete).
        resume: checkpoint after every chunk of sentences, and continue from the checkpoint an interrupted run with
            the same model, corpus and settings left behind (needs `out`).
        config: the settings as a RunConfig; `options` may name any of its fields instead (`window=3`).
        thresholds: the head-type rule (default: Thresholds()).
        roles: the role rule (default: RoleThresholds()).
        charts: chart format written with the tables (png, svg, pdf), or None (only with `out`).
        page: write report.html (only with `out`).
        reporter: progress and notes (default: silent; in a notebook, one display updated in place).
        loader: loads the model (default: headscope.model.loading.load_for_run).
        **options: RunConfig fields by name.

    Returns:
        The report (headscope.Report): heads, layers, sentences, sentence_heads, examples, probes and run.json's
        record; None on every rank but the first under torchrun.
    """
    thresholds, roles = thresholds or Thresholds(), roles or RoleThresholds()
    out = as_path(out, "out")
    check_rules(thresholds, roles)
    if charts is not None and charts not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {charts!r}")
    if resume and out is None:
        raise ConfigError("--resume needs an output folder (--out)")
    # Everything that can be refused without the model is refused before it loads (which can take minutes), on
    # every rank: a refusal stops them all at once, before any of them waits.
    command = CommandRun.prepare(model, corpus, config=config, options=options, reporter=reporter)
    command.request = {"thresholds": thresholds, "roles": roles, "resume": resume, "page": page, "charts": charts}
    ranks = command.data_parallel(model, "run", missing_out=out is None)
    settings, reporter, corpus = command.settings, command.reporter, command.corpus  # one progress bar, one summary
    timings = Timings()
    session = command.session(model, loader, what="--importance", out=out, kind="report", overwrite=overwrite,
                              resumable=resume, scratch="analyze", shared=True, lm_head=needs_lm_head(settings),
                              before_weights=_tokenizer_checks(settings), timings=timings)  # fmt: skip
    with session as opened:  # on error the work folder goes (or stays, with resume)
        loaded, plan, folder = opened.loaded, opened.plan, opened.folder
        parts = PartFiles(folder, fingerprint(loaded, corpus, settings, ranks), checkpoints=resume, ranks=ranks,
                          in_memory=out is None and not ranks.parallel)  # fmt: skip
        progress, running = Progress(), {}
        if resume:
            progress, running, plan = together(ranks, lambda: _resumed(parts, plan, loaded, reporter))
        checks_dormant = settings.check_dormant and loaded.lm is not None
        scores_loss = plan.measures_importance or checks_dormant  # another pass over the corpus, through the LM
        feed = CorpusFeed(
            corpus,
            loaded.tokenizer,
            max_length=plan.max_length,
            chunk_sentences=settings.chunk_sentences,
            keep=scores_loss,
        )
        if settings.probes:  # what can be refused is refused before hours of measuring
            battery = check_probes(loaded.tokenizer, plan)
        retrieval = check_retrieval(loaded.tokenizer, plan)
        if scores_loss:
            check_importance_fits(feed, plan, "--importance" if plan.measures_importance else "--check-dormant")
        if loaded.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(loaded.device)
        with attached(loaded.lm or loaded.model, block_bytes=settings.block_bytes) as capture:
            with timings.phase("measure"), timings.set_apart("kernel_build", cpu_kernel.BUILD_SECONDS):
                measured = measure_corpus(
                    capture, feed, plan, parts, progress, running, reporter, device=loaded.device, ranks=ranks
                )
            # Rank 0 writes the report from everyone's sums and parts; importance and the dormant check are split
            # between the ranks, so with them every rank stays, and waits (or stops with rank 0) while rank 0 runs
            # the probes.
            if not ranks.main and not scores_loss:
                return None
            stay = ranks if scores_loss else ONE_PROCESS
            with timings.phase("probes"):
                probes = together(stay, lambda: run_probes(capture, battery, loaded.device, plan, reporter)
                                  if settings.probes and ranks.main else None)  # fmt: skip
                retrieved = together(stay, lambda: run_retrieval(capture, retrieval, loaded.device, plan, reporter)
                                     if retrieval is not None and ranks.main else None)  # fmt: skip
                if probes is not None:  # the retrieval probe runs only with the battery (check_retrieval)
                    probes.retrieval = retrieved

            def label():  # on rank 0, which has the probes' scores; handed to every rank
                return labelled_heads(plan, measured, probes, None, (thresholds, roles)) if ranks.main else None

            labelled = broadcast(ranks, together(ranks, label)) if scores_loss else None
            with timings.phase("importance"):
                importance = None
                if plan.measures_importance:  # each role's heads are ablated together too
                    importance = run_importance(capture, feed, plan, reporter, device=loaded.device, roles=labelled,
                                                ranks=ranks)  # fmt: skip
            with timings.phase("dormant_check"):
                if checks_dormant:
                    dormant = check_dormant(capture, lambda: plan.batches(feed, "importance", loaded.device), plan,
                                            labelled, reporter, sentences=len(feed.corpus.sentences),
                                            tolerance=settings.dormant_tolerance, ranks=ranks)  # fmt: skip
                else:
                    dormant = DormantCheck.unverified(_unchecked_why(settings, loaded))
            if not ranks.main:
                return None
            with timings.phase("copying"):
                copying, copying_from = (cached_copying(loaded, capture, plan.architecture) if settings.copying
                                         else (None, "--no-copying"))  # fmt: skip
                if settings.copying and copying is None:
                    reporter.note(f"ov_copying is not computed: {copying_from}")
            lengths = measured.progress.lengths
            if out is None and isinstance(model, LoadedModel) and not ranks.parallel:
                # A report kept in memory, of a model the caller keeps: the example views' forward pass waits until
                # someone reads report.examples (a chart, the notebook view); on one short text it was a third of
                # the run. A model loaded here is let go with the run, so its views are computed now.
                examples = functools.partial(_example_views, loaded, feed, plan, lengths)
            else:
                with timings.phase("write"):  # the example views: their attention is written with the tables
                    examples = example_views(capture, feed, plan, lengths, device=loaded.device)
        if settings.bootstrap and not measured.resampled:
            reporter.note(ONE_SENTENCE_NOTE)
        reporter.stage("writing tables")
        analysis = Analysis(loaded, corpus, plan, measured, probes, importance, examples, thresholds, roles, timings,
                            dormant, copying, copying_from)  # fmt: skip
        run, tables = write_tables(folder, analysis, parts, in_memory=out is None)
        report = Report(run, folder=folder, tables=tables)
        if out is not None and (charts or page):  # drawn in the work folder: published with the tables, or not at all
            _draw(report, folder, charts, page, opened.stage.target, reporter)
        parts.discard_checkpoint()  # only now: an interrupted drawing leaves a checkpoint that --resume continues
        if out is None:  # one process: the per-sentence tables were merged in memory
            held = parts.merged_frames()
            tables |= {SENTENCES_FILE: held.get("sentences"), SENTENCE_HEADS_FILE: held.get("sentence_heads")}
    command.done(opened)  # the notebook's display ends here
    return Report(run, folder=opened.target, tables=tables)


def _tokenizer_checks(settings):
    """What the tokenizer alone can refuse, before the weights load: probe sequences its vocabulary cannot fill."""

    def check(tokenizer, model_config) -> None:
        if settings.probes:
            probe_sequences(tokenizer, ProbeSpec(seeds=settings.probe_seeds, length=settings.probe_length))

    return check


def _unchecked_why(settings, loaded: LoadedModel) -> str:
    """Why the run did not check the dormant label by removal."""
    if not settings.check_dormant:
        return "--no-check-dormant"
    return "no LM head: the checkpoint has none, or the model was handed in without it (load_model(lm_head=True))"


def _example_views(loaded: LoadedModel, feed: CorpusFeed, plan: Plan, lengths: dict) -> pd.DataFrame:
    """The example views of a finished run, through a capture of their own (run.example_views.example_views), with
    the run's --threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(plan.settings.threads or threads)
    try:
        with attached(loaded.lm or loaded.model, block_bytes=plan.settings.block_bytes) as capture:
            return example_views(capture, feed, plan, lengths, device=loaded.device)
    finally:
        torch.set_num_threads(threads)


def _draw(report: Report, folder: Path, charts: str | None, page: bool, target: Path, reporter: Reporter) -> None:
    from headscope.report.write import write_presentation

    reporter.stage("drawing charts and writing report.html")
    for what in write_presentation(report, folder, fmt=charts, page=page)[1]:
        reporter.warn(f"could not draw {what}; the tables are written (headscope plot {target} tries again)")


def _resumed(parts: PartFiles, plan: Plan, loaded: LoadedModel, reporter: Reporter):
    """The checkpoint's progress and sums, and the plan batched as the interrupted run was (so that the tables
    equal an uninterrupted run's bit for bit; run.json then records what was really used)."""
    kinds = ("sentences", "sentence_heads") if plan.settings.sentence_heads else ("sentences",)
    progress, running, saved = parts.load_progress(plan.running_shapes, kinds)
    if saved is None:
        return progress, running, plan
    sizing, settings = saved.get("sizing") or {}, plan.settings
    if (sizing.get("batch_size"), sizing.get("max_memory")) != (settings.batch_size, settings.max_memory):
        reporter.note(
            f"resuming with the interrupted run's batching (--batch-size {sizing.get('batch_size') or 'auto'}, "
            f"--max-memory {sizing.get('max_memory') or 'default'}), so that the tables equal an uninterrupted run's"
        )
    if sizing != plan.sizing:  # the memory free at the start decided the batches too
        plan = resized(plan, sizing, loaded.model.config, dtype=loaded.dtype, device_type=loaded.device.type)
    if plan.record() != saved:
        differ = sorted(key for key in saved.keys() | plan.record().keys() if saved.get(key) != plan.record().get(key))
        raise OutputError(
            f"the checkpoint in {parts.folder} was planned differently ({', '.join(differ)}: the model changed?); "
            "delete that folder or run without --resume"
        )
    return progress, running, plan
