"""analyze(): measure -> tables -> write. The one entry point the CLI (and notebooks) call.

One path for every run: the corpus streams through the model chunk by chunk (`measure` keeps only the
per-head sums and the few facts needed later, and hands each chunk's per-sentence rows to part files);
then the tables are built (the small ones in memory, the per-sentence ones merged from their parts) and
written into the run's work folder, with the run record and the charts drawn from the frames in hand. With
`out`, the work folder is the report's staging folder, published at the end; without, a temporary folder
whose per-sentence tables are read back into the result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from headscope.capture import forward, measuring
from headscope.checkpoint import PartFiles, Progress
from headscope.config import CHART_FORMATS, RoleThresholds, RunConfig, Thresholds
from headscope.corpus import Corpus, corpus_from_texts, default_corpus_path, read_corpus
from headscope.distributed import (
    ONE_PROCESS,
    PeerError,
    Ranks,
    all_sum,
    broadcast,
    gather,
    join,
    leave,
    meet,
    rank_device,
    ranks_from_env,
)
from headscope.errors import ConfigError, OutputError
from headscope.feed import batches_in_order, collate, model_max_length, token_labels, tokenize_sentences
from headscope.labels import label_heads
from headscope.layout import (
    EXAMPLES_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    PAGE_FILE,
    RUN_FILE,
    SENTENCE_HEADS_FILE,
    SENTENCES_FILE,
)
from headscope.loading import (
    LoadedModel,
    ModelSource,
    architecture_of,
    load_config,
    load_model,
    model_files,
    pick_device,
    resolve_source,
)
from headscope.measures.example import ExampleAttention
from headscope.measures.importance import measure_importance
from headscope.measures.probes import ProbeScores, ProbeSpec, probe_inputs
from headscope.measures.statistics import AttentionStatistics
from headscope.memory import (
    MAX_AUTO_SENTENCES,
    bytes_per_token,
    default_budget,
    importance_bytes_per_token,
    tokens_per_batch,
)
from headscope.output import StagedDirectory
from headscope.prefetch import prefetched
from headscope.record import Timings, fingerprint, run_record
from headscope.reporting import NullReporter, Reporter
from headscope.stats import STATS, Bootstrap, ProbeResult, head_intervals, layer_intervals, summarise_probes
from headscope.summary import layer_entropy
from headscope.tables import (
    EXAMPLES_SCHEMA,
    HEADS_SCHEMA,
    LAYERS_SCHEMA,
    SENTENCE_HEADS_SCHEMA,
    SENTENCES_SCHEMA,
    examples_frame,
    heads_frame,
    layers_frame,
    parquet_metadata,
    read_table,
    sentence_heads_frame,
    write_json,
    write_table,
)

EXAMPLE_TOKENS = 14  # the example chart uses the corpus sentence closest to this length (legible labels)
# ... cut to at most this many tokens: the example keeps every head's (t, t) attention, which must stay small
# even when every sentence of the corpus is thousands of tokens long.
EXAMPLE_MAX_TOKENS = 32


@dataclass
class AnalysisResult:
    """What `analyze` measured, as DataFrames (the same tables it writes)."""

    heads: pd.DataFrame  # one row per (layer, head), with its head type
    run: dict  # everything run.json holds
    examples: pd.DataFrame  # every head's attention on one corpus sentence (long-form)
    out_dir: Path | None = None  # where the tables were written, if anywhere
    _tables: dict[str, pd.DataFrame | None] = field(default_factory=dict, repr=False)

    @property
    def sentences(self) -> pd.DataFrame:
        """One row per sentence (read from the report on first use: it can be large)."""
        return self._table(SENTENCES_FILE, SENTENCES_SCHEMA)

    @property
    def sentence_heads(self) -> pd.DataFrame | None:
        """One row per (sentence, layer, head), or None when the run skipped it (read on first use)."""
        return self._table(SENTENCE_HEADS_FILE, SENTENCE_HEADS_SCHEMA)

    def _table(self, name: str, schema) -> pd.DataFrame | None:
        if name not in self._tables:
            path = self.out_dir / name if self.out_dir is not None else None
            self._tables[name] = read_table(path, schema) if path is not None and path.exists() else None
        return self._tables[name]

    def layer_entropy(self) -> pd.Series:
        """Mean entropy per layer (nats): the seed analysis's layer-depth gradient."""
        return layer_entropy(self.heads)["mean"]


@dataclass
class Measured:
    """What `measure` keeps of a whole corpus: sums and a few facts; the per-sentence rows went to parts."""

    sums: np.ndarray  # (layers, heads, stats) corpus-wide sums
    bootstrap: Bootstrap | None  # the replicate sums behind the intervals (None: --bootstrap 0)
    layer_ids: np.ndarray  # (layers,) which model layers the sums are of
    chunks: int  # chunks of sentences the corpus was measured in
    progress: Progress  # counts: sentences measured, empty, tokens, truncated, batches; the example sentence
    max_length: int | None  # the truncation length actually applied
    attention_paths: dict  # attention class -> how its probabilities were read


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
    **options,
) -> AnalysisResult | None:
    """Measure every attention head of `model` on `corpus`.

    Under torchrun (WORLD_SIZE > 1) the corpus is split between the ranks (see headscope.distributed): rank 0
    returns the result and writes the report; the other ranks return None.

    model:   hub id, local folder, .gguf path, alias (``smollm2``) or an already loaded model
    corpus:  file path, list of sentences, or None for the shipped 100-sentence corpus
    out:     folder to write the tables, run.json and charts into (nothing is kept when None)
    overwrite: replace `out` if it holds a headscope report (only once the new report is complete)
    resume:  checkpoint after every chunk of sentences and continue from the checkpoint an interrupted
             run with the same model, corpus and settings left behind (needs `out`)
    thresholds: head-type rule (default: Thresholds())
    roles:   role rule (default: RoleThresholds())
    charts:  chart format written with the tables (png, svg, pdf), or None for no charts (always none
             without `out`)
    page:    write report.html, the self-contained page (only with `out`)
    options: any RunConfig field, e.g. ``window=3`` or ``batch_size=8``
    """
    config = dataclasses.replace(config or RunConfig(), **options)
    thresholds = thresholds or Thresholds()
    roles = roles or RoleThresholds()
    reporter = reporter or NullReporter()
    if resume and out is None:
        raise ConfigError("--resume needs an output folder (--out)")
    ranks = ranks_from_env()
    if ranks.parallel:
        _check_parallel(config, out, model)
        config = dataclasses.replace(config, device=rank_device(ranks, config.device))
        reporter = reporter if ranks.main else NullReporter()  # one progress bar, one summary
    # Everything that can be refused without the model is refused before it loads (which can take minutes).
    corpus = _as_corpus(corpus, config)
    source = model.source if isinstance(model, LoadedModel) else resolve_source(model)
    if out is not None and ranks.main:
        work = StagedDirectory(Path(out), overwrite=overwrite, resumable=resume, protected=_inputs(source, corpus))
    timings = Timings()

    with contextlib.ExitStack() as stack:  # on error the work folder goes (or stays, with resume)
        if out is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="headscope-")))
        elif ranks.main:
            folder = stack.enter_context(work).path
            _report_cleaned(work, reporter)
        if ranks.parallel:
            join(ranks, pick_device(config.device))
            stack.callback(leave, ranks)
            folder = Path(broadcast(ranks, str(folder) if ranks.main else None))  # every rank writes parts there
        with timings.phase("load"):
            try:
                loaded = model if isinstance(model, LoadedModel) else _load(source, config, reporter)
                check_options(config, loaded.model.config)
            except BaseException as err:
                if ranks.parallel:
                    meet(ranks, (0, 0), err)  # every rank stops, with this rank's message
                raise
            if ranks.parallel:
                meet(ranks, (0, 0))

        run_fingerprint = fingerprint(loaded, corpus, config) | ({"ranks": ranks.world} if ranks.parallel else {})
        parts = PartFiles(folder, run_fingerprint, checkpoints=resume, ranks=ranks)
        kinds = ("sentences", "sentence_heads") if config.sentence_heads else ("sentences",)
        progress, running = parts.load_progress(_running_shapes(loaded, config), kinds) if resume else (Progress(), {})
        config = _resumed_settings(config, progress, reporter) if resume else config
        if loaded.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(loaded.device)
        with timings.phase("measure"):
            measured = measure(loaded, corpus, config, parts, progress, running, reporter, ranks)
        if not ranks.main:
            return None  # rank 0 writes the report from everyone's sums and parts
        with timings.phase("probes"):
            probes = run_probes(loaded, config, measured.layer_ids, reporter) if config.probes else None
        with timings.phase("importance"):
            importance = None
            if config.importance != "none":
                importance = run_importance(loaded, corpus, config, measured, reporter)

        with timings.phase("write"):
            reporter.stage("writing tables")
            _merge_parts(parts, folder, measured, corpus, config)
            replicates = measured.bootstrap.metrics() if measured.bootstrap is not None else None
            frame = heads_frame(
                measured.sums,
                loaded.architecture["kv_heads"],
                measured.layer_ids,
                intervals=head_intervals(replicates) if replicates else None,
                probes=probes,
                importance=None if importance is None else importance.columns(),
            )
            heads = label_heads(frame, thresholds, roles)
            layers = layers_frame(heads, layer_intervals(replicates) if replicates else None)
            examples = example_attention(loaded, corpus, measured, config)
            write_table(layers, folder / LAYERS_FILE, LAYERS_SCHEMA)
            write_table(examples, folder / EXAMPLES_FILE, EXAMPLES_SCHEMA)
        run = run_record(loaded, corpus, config, measured, (probes, importance), heads, (thresholds, roles), timings)
        write_table(heads, folder / HEADS_FILE, HEADS_SCHEMA, metadata=parquet_metadata(run))
        write_json(run, folder / RUN_FILE)
        if charts and out is not None:
            from headscope.report.charts import draw_charts  # matplotlib only when charts are drawn
            from headscope.report.folder import chart_title

            reporter.stage("drawing charts")
            draw_charts(heads, layers, examples, thresholds, title=chart_title(run), folder=folder, fmt=charts)
        if page and out is not None:
            from headscope.report.folder import write_report_page

            reporter.stage("writing report.html")
            write_report_page(run, heads, layers, examples, thresholds, folder / PAGE_FILE)
        parts.discard_checkpoint()
        # Without `out` the temporary folder goes with this block: read its per-sentence tables now.
        in_memory = {} if out is not None else _read_per_sentence_tables(folder)
    if out is not None:
        _report_cleaned(work, reporter)
    out_dir = work.target if out is not None else None
    return AnalysisResult(heads=heads, run=run, examples=examples, out_dir=out_dir, _tables=in_memory)


def _read_per_sentence_tables(folder: Path) -> dict[str, pd.DataFrame | None]:
    tables = {SENTENCES_FILE: SENTENCES_SCHEMA, SENTENCE_HEADS_FILE: SENTENCE_HEADS_SCHEMA}
    return {
        name: read_table(folder / name, schema) if (folder / name).exists() else None for name, schema in tables.items()
    }


def measure(
    loaded: LoadedModel,
    corpus: Corpus,
    config: RunConfig,
    parts: PartFiles,
    progress: Progress,
    running: dict[str, np.ndarray],
    reporter: Reporter,
    ranks: Ranks = ONE_PROCESS,
) -> Measured:
    """Stream the corpus through the model chunk by chunk; keep only stat sums (and the bootstrap's replicate
    sums), hand the per-sentence rows to `parts`.

    `progress` and `running` (the sums so far) come from a checkpoint when resuming: chunks already done
    are skipped.
    """
    limits = [x for x in (config.max_length, model_max_length(loaded.model.config)) if x is not None]
    max_length = min(limits) if limits else None
    # MPS has no float64; elsewhere float64 sums keep corpus-wide totals exact to ~1e-12.
    accum_dtype = torch.float32 if loaded.device.type == "mps" else torch.float64
    layer_ids = _selected_layers(config.layers, loaded.architecture["layers"])
    shapes = _running_shapes(loaded, config)
    totals = running.get("sums", np.zeros(shapes["sums"]))
    bootstrap = None
    if config.bootstrap:
        bootstrap = Bootstrap(config.bootstrap, config.bootstrap_seed, *shapes["sums"][:2])
        bootstrap.sums = running.get("bootstrap", bootstrap.sums)
    statistics = AttentionStatistics(
        window=config.window, accum_dtype=accum_dtype, layers=None if config.layers is None else layer_ids
    )
    # Rank 0's limits on every rank: batches decide the order of float sums, so all ranks batch alike.
    progress.batching = progress.batching or broadcast(ranks, _batch_limits(loaded, config))

    reporter.start(len(corpus.sentences))
    chunk_starts = range(0, len(corpus.sentences), config.chunk_sentences)
    host = _host_stream(loaded, corpus, config, max_length, progress, ranks)
    rounds = _Rounds(ranks, reporter, len(chunk_starts))
    with measuring(loaded.model, [statistics], block_bytes=config.block_bytes) as capture, rounds:
        sums = _RunningSums(totals, bootstrap)
        for chunk, batch in prefetched(host, depth=HOST_AHEAD if loaded.device.type == "cuda" else 0):
            if chunk.skipped:  # measured before the interruption
                reporter.advance(len(chunk.sentences), 0)
                rounds.meet(len(chunk.sentences), 0)
                continue
            if batch is not None:
                forward(loaded.model, capture, batch.to(loaded.device))
                sums.add(batch.sentence_ids, statistics.finish())
                progress.tokens += batch.n_tokens
                progress.batches += 1
                reporter.advance(len(batch.sentence_ids), batch.n_tokens)
                continue
            per_sentence = sums.end_chunk()
            reporter.advance(len(chunk.sentences) - len(chunk.tokenized), 0)  # sentences with no tokens
            parts.add(
                chunk.index,
                _sentence_rows(chunk.sentences, chunk.ids, chunk.cut),
                _sentence_head_rows(per_sentence, chunk.tokenized, layer_ids, sums.totals.shape, config),
            )
            _count_chunk(progress, chunk.sentences, chunk.ids, chunk.cut)
            progress.chunks_done = chunk.index + 1
            running = {"sums": sums.totals, **({"bootstrap": bootstrap.sums} if bootstrap else {})}
            parts.save_progress(progress, running)
            rounds.meet(len(chunk.sentences), sum(len(ids) for ids in chunk.tokenized.values()))
    totals = sums.totals
    reporter.finish()
    if ranks.parallel:  # every rank's share added up; float64 sums in a different order: equal within ~1e-15
        device = loaded.device if loaded.device.type == "cuda" else torch.device("cpu")
        totals = all_sum(ranks, totals, device)
        if bootstrap is not None:
            bootstrap.sums = all_sum(ranks, bootstrap.sums, device)
        progress = _combined_progress(gather(ranks, progress), len(chunk_starts))
        paths = {name: path for share in gather(ranks, dict(capture.paths)) for name, path in share.items()}
    else:
        paths = dict(capture.paths)
    if progress.tokens == 0:
        raise ConfigError("no sentence produced any token; check the corpus and the tokenizer")
    return Measured(
        sums=totals,
        bootstrap=bootstrap,
        layer_ids=layer_ids,
        chunks=len(chunk_starts),
        progress=progress,
        max_length=max_length,
        attention_paths=paths,
    )


# Batches (and chunk ends) the host thread may prepare ahead of a GPU. On a CPU the model itself needs every
# core and the GIL between its many small ops: a host thread there made the 20,000-sentence run of
# benchmarks/pipeline.py 0.25 s slower (median of 10, 2 cores), so the CPU runs the host work in series.
HOST_AHEAD = 8
PENDING_BYTES = 64 * 2**20  # per-sentence sums held on the device before they are moved in one transfer


@dataclass
class HostChunk:
    """One chunk of the corpus as the host prepared it: its sentences, token ids and truncation flags."""

    index: int
    sentences: list
    ids: list[list[int]] = field(default_factory=list)
    cut: list[bool] = field(default_factory=list)
    tokenized: dict[int, list[int]] = field(default_factory=dict)  # sentence id -> ids, non-empty only
    skipped: bool = False  # measured before an interruption (resume)


def _host_stream(loaded: LoadedModel, corpus: Corpus, config: RunConfig, max_length, progress: Progress, ranks: Ranks):
    """The host's work, in order: for each chunk, its collated batches, then (chunk, None) when it ends.

    Runs in the prefetch thread: tokenizing, planning and collating (into pinned memory for a GPU) happen
    while the model runs the batches before.
    """
    pin = loaded.device.type == "cuda"
    for index, first in enumerate(range(0, len(corpus.sentences), config.chunk_sentences)):
        if not ranks.owns(index):  # another rank's
            continue
        chunk = HostChunk(index, corpus.sentences[first : first + config.chunk_sentences])
        if index < progress.chunks_done:
            chunk.skipped = True
            yield chunk, None
            continue
        chunk.ids, chunk.cut = tokenize_sentences(loaded.tokenizer, [s.text for s in chunk.sentences], max_length)
        chunk.tokenized = {s.sentence_id: row for s, row in zip(chunk.sentences, chunk.ids, strict=True) if row}
        for batch in batches_in_order(
            chunk.tokenized,
            max_sentences=progress.batching["max_sentences"],
            max_tokens=progress.batching["max_tokens"],
            padding_side=config.padding_side,
        ):
            yield chunk, batch.pinned() if pin else batch
        yield chunk, None


class _Rounds:
    """A data-parallel run's meetings: one per round of chunks on every rank (see headscope.distributed), the
    progress of the others shown on rank 0, and any rank's failure raised on all. Nothing in one process."""

    def __init__(self, ranks: Ranks, reporter: Reporter, chunks: int) -> None:
        self.ranks, self.reporter, self.left = ranks, reporter, ranks.rounds(chunks)

    def meet(self, sentences: int, tokens: int, error: BaseException | None = None) -> None:
        if not self.ranks.parallel:
            return
        self.left -= 1
        all_sentences, all_tokens = meet(self.ranks, (sentences, tokens), error)
        self.reporter.advance(all_sentences - sentences, all_tokens - tokens)  # this rank advanced its own

    def __enter__(self) -> _Rounds:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if not self.ranks.parallel:
            return
        if error is not None:
            if not isinstance(error, PeerError):
                self.meet(0, 0, error)  # raises a PeerError naming this rank here and on the others
            return
        while self.left > 0:  # a rank with fewer chunks still meets the others every round
            self.meet(0, 0)


def _combined_progress(shares: list[Progress], chunks: int) -> Progress:
    """Every rank's counts added up; the example sentence is the best over all ranks."""
    combined = dataclasses.replace(shares[0], chunks_done=chunks)
    for name in ("measured_sentences", "empty_sentences", "truncated", "tokens", "batches"):
        setattr(combined, name, sum(getattr(share, name) for share in shares))
    examples = [share.example for share in shares if share.example is not None]
    combined.example = min(examples) if examples else None
    return combined


def _check_parallel(config: RunConfig, out, model) -> None:
    """What a data-parallel run cannot do (yet), refused before anything loads."""
    if out is None:
        raise ConfigError("a data-parallel run (torchrun) needs --out: every rank writes its part of the tables there")
    if isinstance(model, LoadedModel):
        raise ConfigError("a data-parallel run loads the model on every rank: pass its name or path, not a model")
    if config.importance != "none":
        raise ConfigError("--importance is not split between ranks yet; run it in one process (without torchrun)")
    if config.device_map is not None:
        raise ConfigError("--device-map spreads one model over the devices; it cannot be combined with torchrun")


class _RunningSums:
    """The corpus-wide sums, the bootstrap's, and the current chunk's per-sentence sums.

    Batches' sums wait on the device and reach the host together (one synchronisation): when the chunk ends,
    or once PENDING_BYTES of them wait.
    """

    def __init__(self, totals: np.ndarray, bootstrap: Bootstrap | None) -> None:
        self.totals, self.bootstrap = totals, bootstrap
        self._chunk: dict[int, np.ndarray] = {}  # sentence id -> (layers, heads, stats), moved so far
        self._ids: list[int] = []
        self._waiting: list[torch.Tensor] = []  # (layers, batch, heads, stats) each, on the device
        self._bytes = 0

    def add(self, sentence_ids: list[int], sums: torch.Tensor) -> None:
        self._ids.extend(sentence_ids)
        self._waiting.append(sums)
        self._bytes += sums.numel() * sums.element_size()
        if self._bytes >= PENDING_BYTES:
            self._move()

    def end_chunk(self) -> dict[int, np.ndarray]:
        """The chunk's per-sentence sums; the next chunk starts empty."""
        self._move()
        chunk, self._chunk = self._chunk, {}
        return chunk

    def _move(self) -> None:
        if not self._waiting:
            return
        moved = torch.cat(self._waiting, dim=1).cpu().numpy()  # the one synchronisation
        self.totals = self.totals + moved.sum(axis=1)
        if self.bootstrap is not None:
            self.bootstrap.add(self._ids, moved)
        self._chunk.update(zip(self._ids, np.moveaxis(moved, 1, 0), strict=True))
        self._ids, self._waiting, self._bytes = [], [], 0


def _count_chunk(progress: Progress, chunk, ids: list[list[int]], cut: list[bool]) -> None:
    """Add a measured chunk's counts to `progress`, and keep the best example sentence so far."""
    lengths = [len(row) for row in ids]
    progress.measured_sentences += sum(n > 0 for n in lengths)
    progress.empty_sentences += sum(n == 0 for n in lengths)
    progress.truncated += sum(cut)
    for sentence, n in zip(chunk, lengths, strict=True):
        # Prefer sentences of 2 tokens or more, then the length closest to EXAMPLE_TOKENS, then the first.
        candidate = [int(n < 2), abs(n - EXAMPLE_TOKENS), sentence.sentence_id]
        if n > 0 and (progress.example is None or candidate < progress.example):
            progress.example = candidate


def run_probes(loaded: LoadedModel, config: RunConfig, layer_ids: np.ndarray, reporter: Reporter) -> ProbeResult:
    """The probe battery (headscope.measures.probes) through the same capture as the corpus."""
    spec = ProbeSpec(seeds=config.probe_seeds, length=config.probe_length)
    sequences, prefix = probe_inputs(loaded.tokenizer, spec)
    limit = model_max_length(loaded.model.config)
    if limit is not None and len(sequences[0]) > limit:
        raise ConfigError(
            f"--probe-length {spec.length} makes probe sequences of {len(sequences[0])} tokens, more than the "
            f"model's limit of {limit}; lower --probe-length"
        )
    reporter.stage(f"probing: {spec.seeds} sequences of {len(sequences[0])} tokens")
    scores = ProbeScores(spec, prefix, layers=None if config.layers is None else layer_ids)
    limits = _batch_limits(loaded, config)
    per_seed: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    with measuring(loaded.model, [scores], block_bytes=config.block_bytes) as capture:
        for batch in batches_in_order(
            dict(enumerate(sequences)),
            max_sentences=limits["max_sentences"],
            max_tokens=limits["max_tokens"],
            padding_side=config.padding_side,
            device=loaded.device,
        ):
            forward(loaded.model, capture, batch)
            mass, rows, chance = scores.finish()  # (layers, batch, heads, patterns), (batch, patterns) twice
            for column, seed in enumerate(batch.sentence_ids):
                per_seed[seed] = (mass[:, column], rows[column], chance[column])
    mass, rows, chance = (np.stack([per_seed[seed][i] for seed in sorted(per_seed)]) for i in range(3))
    return summarise_probes(mass, rows, chance, prefix, spec.repeats)


def run_importance(loaded: LoadedModel, corpus: Corpus, config: RunConfig, measured: Measured, reporter: Reporter):
    """Head importance (headscope.measures.importance) on the corpus, through the model's own LM head."""
    if loaded.lm is None:
        raise ConfigError(
            "--importance needs the model's LM head; load the model with headscope.load_model(..., lm_head=True)"
        )
    text = loaded.model.config.get_text_config()
    sizes = (text.hidden_size, _intermediate_size(text), loaded.architecture["layers"], text.vocab_size)
    budget = config.max_memory or default_budget(loaded.device)
    with_grad = importance_bytes_per_token(*sizes, loaded.dtype, grad=True)
    without_grad = importance_bytes_per_token(*sizes, loaded.dtype, grad=False)
    max_tokens = max(1, budget // with_grad)
    max_sentences = config.batch_size or MAX_AUTO_SENTENCES

    def batches():
        for first in range(0, len(corpus.sentences), config.chunk_sentences):
            chunk = corpus.sentences[first : first + config.chunk_sentences]
            ids, _ = tokenize_sentences(loaded.tokenizer, [s.text for s in chunk], measured.max_length)
            tokenized = {s.sentence_id: row for s, row in zip(chunk, ids, strict=True) if row}
            yield from batches_in_order(
                tokenized,
                max_sentences=max_sentences,
                max_tokens=max_tokens,
                padding_side=config.padding_side,
                device=loaded.device,
            )

    exact = config.importance == "exact"
    reporter.stage(f"importance ({config.importance}): {'attribution and ablation' if exact else 'attribution'}")
    reporter.start(len(corpus.sentences) * (2 if exact else 1))
    importance = measure_importance(
        loaded.lm,
        batches,
        layer_ids=measured.layer_ids,
        architecture=loaded.architecture,
        exact=exact,
        replicas_per_forward=lambda batch: budget // (without_grad * batch.input_ids.numel()),
        reporter=reporter,
        block_bytes=config.block_bytes,
    )
    reporter.finish()
    return importance


def example_attention(loaded: LoadedModel, corpus: Corpus, measured: Measured, config: RunConfig) -> pd.DataFrame:
    """Every head's attention on the example sentence (the one closest to EXAMPLE_TOKENS tokens, ties: first)."""
    sentence_id = measured.progress.example[2]
    cut = min(EXAMPLE_MAX_TOKENS, measured.max_length or EXAMPLE_MAX_TOKENS)
    ids, _ = tokenize_sentences(loaded.tokenizer, [corpus.sentences[sentence_id].text], cut)
    batch = collate([sentence_id], ids, padding_side=config.padding_side, device=loaded.device)
    keeper = ExampleAttention()
    with measuring(loaded.model, [keeper], block_bytes=config.block_bytes) as capture:
        forward(loaded.model, capture, batch)
    return examples_frame(sentence_id, token_labels(loaded.tokenizer, ids[0]), keeper.finish().numpy())


def _merge_parts(parts: PartFiles, folder: Path, measured: Measured, corpus: Corpus, config: RunConfig) -> None:
    """The per-sentence tables from their parts, checked against what the run measured."""
    rows = parts.merged("sentences", SENTENCES_SCHEMA, folder / SENTENCES_FILE, measured.chunks)
    _check_rows("sentence", rows, len(corpus.sentences), parts)
    if config.sentence_heads:
        rows = parts.merged("sentence_heads", SENTENCE_HEADS_SCHEMA, folder / SENTENCE_HEADS_FILE, measured.chunks)
        _check_rows("sentence-head", rows, measured.progress.measured_sentences * measured.sums[..., 0].size, parts)


def _check_rows(what: str, rows: int, expected: int, parts: PartFiles) -> None:
    if rows != expected:
        raise OutputError(
            f"the measured parts hold {rows:,} {what} rows where the run measured {expected:,}; "
            f"the checkpoint in {parts.folder} does not add up: delete it and run again"
        )


def _inputs(source: ModelSource, corpus: Corpus) -> dict[str, Path]:
    """The files a run reads, which its output folder must never replace."""
    inputs = {"the corpus": corpus.path} if corpus.path.exists() else {}
    files = model_files(source)
    if files is not None:
        inputs["the model"] = files
    return inputs


def _report_cleaned(stage: StagedDirectory, reporter: Reporter) -> None:
    while stage.cleaned:
        reporter.note(f"removed {stage.cleaned.pop(0)}, left behind by an interrupted run")


def _load(source: ModelSource, config: RunConfig, reporter: Reporter) -> LoadedModel:
    """Read the model's config, check the options against it, then load the weights."""
    reporter.stage(f"loading {source.display}")
    model_config = load_config(source, revision=config.revision, trust_remote_code=config.trust_remote_code)
    check_options(config, model_config)
    return load_model(
        source,
        config=model_config,
        lm_head=config.importance != "none",
        device=config.device,
        dtype=config.dtype,
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        device_map=config.device_map,
        offload_folder=config.offload_folder,
    )


def check_options(config: RunConfig, model_config) -> None:
    """Refuse options the model cannot satisfy (layers it lacks, sentences longer than its positions)."""
    _selected_layers(config.layers, architecture_of(model_config)["layers"])
    limit = model_max_length(model_config)
    if config.max_length and limit and config.max_length > limit:
        raise ConfigError(f"--max-length {config.max_length} exceeds the model's limit of {limit} tokens")


def _running_shapes(loaded: LoadedModel, config: RunConfig) -> dict[str, tuple[int, ...]]:
    """The running sums a run keeps (and checkpoints): name -> shape."""
    layers = loaded.architecture["layers"] if config.layers is None else len(config.layers)
    shapes = {"sums": (layers, loaded.architecture["heads"], len(STATS))}
    if config.bootstrap:
        shapes["bootstrap"] = Bootstrap.shape(config.bootstrap, layers, loaded.architecture["heads"])
    return shapes


def _resumed_settings(config: RunConfig, progress: Progress, reporter: Reporter) -> RunConfig:
    """A resumed run batches as the interrupted one did; run.json then records what was really used."""
    if progress.batching is None:  # a fresh start: remember the settings this run begins with
        progress.batch_size, progress.max_memory = config.batch_size, config.max_memory
        return config
    if (progress.batch_size, progress.max_memory) != (config.batch_size, config.max_memory):
        reporter.note(
            f"resuming with the interrupted run's batching (--batch-size {progress.batch_size or 'auto'}, "
            f"--max-memory {progress.max_memory or 'default'}), so that the tables equal an uninterrupted run's"
        )
    return dataclasses.replace(config, batch_size=progress.batch_size, max_memory=progress.max_memory)


def _as_corpus(corpus, config: RunConfig) -> Corpus:
    if isinstance(corpus, Corpus):
        return corpus
    if isinstance(corpus, list):
        return corpus_from_texts(corpus)
    path = corpus if corpus is not None else default_corpus_path()
    return read_corpus(path, text_column=config.text_column, encoding_errors=config.encoding_errors)


def _sentence_rows(chunk, ids: list[list[int]], cut: list[bool]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "sentence_id": [s.sentence_id for s in chunk],
            "line": [s.line for s in chunk],
            "text": [s.text for s in chunk],
            "n_tokens": [len(row) for row in ids],
            "truncated": cut,
        }
    )


def _sentence_head_rows(per_sentence, tokenized, layer_ids, shape, config: RunConfig) -> pd.DataFrame | None:
    if not config.sentence_heads:
        return None
    order = sorted(per_sentence)
    sums = np.stack([per_sentence[i] for i in order]) if order else np.zeros((0, *shape))
    lengths = np.array([len(tokenized[i]) for i in order], dtype=np.int64)
    return sentence_heads_frame(np.array(order, dtype=np.int64), lengths, sums, layer_ids)


def _selected_layers(requested: tuple[int, ...] | None, n_layers: int) -> np.ndarray:
    if requested is None:
        return np.arange(n_layers)
    beyond = [layer for layer in requested if layer >= n_layers]
    if beyond:
        raise ConfigError(f"--layers names layer {beyond[0]}, but the model has layers 0-{n_layers - 1}")
    return np.array(requested)


def _intermediate_size(text_config) -> int:
    intermediate = getattr(text_config, "intermediate_size", None) or getattr(text_config, "n_inner", None)
    return intermediate or 4 * text_config.hidden_size


def _batch_limits(loaded: LoadedModel, config: RunConfig) -> dict:
    """Sentences and padded tokens per batch: the user's batch size (or up to 256), within the memory budget."""
    budget = config.max_memory or default_budget(loaded.device)
    text_config = loaded.model.config.get_text_config()
    per_token = bytes_per_token(text_config.hidden_size, _intermediate_size(text_config), loaded.dtype)
    return {
        "max_sentences": config.batch_size or MAX_AUTO_SENTENCES,
        "max_tokens": tokens_per_batch(budget, per_token, config.block_bytes),
        "memory_budget_bytes": budget,
    }
