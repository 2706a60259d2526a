"""analyze(): load, measure, write. The one entry point the CLI (and notebooks) call."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import platform
import resource
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from headscope.batching import batches_in_order, collate
from headscope.capture import LayerReducer, measure_batch, measuring, sentence_attention
from headscope.checkpoint import MemoryChunks, PartFiles, Progress
from headscope.classify import classify_heads
from headscope.config import RunConfig, Thresholds
from headscope.corpus import Corpus, corpus_from_texts, default_corpus_path, read_corpus
from headscope.errors import ConfigError, OutputError
from headscope.layout import EXAMPLES_FILE, HEADS_FILE, RUN_FILE, SCHEMA_VERSION, SENTENCE_HEADS_FILE, SENTENCES_FILE
from headscope.loading import (
    LoadedModel,
    ModelSource,
    architecture_of,
    dtype_name,
    load_config,
    load_model,
    model_files,
    resolve_source,
)
from headscope.memory import MAX_AUTO_SENTENCES, bytes_per_token, default_budget, tokens_per_batch
from headscope.metrics import STATS
from headscope.output import StagedDirectory
from headscope.report import classification_record, draw_charts, parquet_metadata
from headscope.reporting import NullReporter, Reporter
from headscope.summary import layer_entropy
from headscope.tables import (
    EXAMPLES_SCHEMA,
    HEADS_SCHEMA,
    SENTENCE_HEADS_SCHEMA,
    SENTENCES_SCHEMA,
    examples_frame,
    heads_frame,
    read_table,
    sentence_heads_frame,
    write_json,
    write_table,
)
from headscope.tokenization import model_max_length, token_labels, tokenize_sentences

EXAMPLE_TOKENS = 14  # the example chart uses the corpus sentence closest to this length (legible labels)
# ... cut to at most this many tokens: the example keeps every head's (t, t) attention, which must stay small
# even when every sentence of the corpus is thousands of tokens long.
EXAMPLE_MAX_TOKENS = 32


@dataclass
class AnalysisResult:
    """What `analyze` measured, as DataFrames (the same tables it writes)."""

    heads: pd.DataFrame  # one row per (layer, head), with its head type
    sentences: pd.DataFrame  # one row per sentence
    run: dict  # everything run.json holds
    examples: pd.DataFrame  # every head's attention on one corpus sentence (long-form)
    out_dir: Path | None = None  # where the tables were written, if anywhere
    _sentence_heads: pd.DataFrame | None = None

    @property
    def sentence_heads(self) -> pd.DataFrame | None:
        """One row per (sentence, layer, head); read from disk on first use when it was streamed there."""
        if self._sentence_heads is None and self.out_dir is not None:
            path = self.out_dir / SENTENCE_HEADS_FILE
            if path.exists():
                self._sentence_heads = read_table(path, SENTENCE_HEADS_SCHEMA)
        return self._sentence_heads

    def layer_entropy(self) -> pd.Series:
        """Mean entropy per layer (nats): the seed analysis's layer-depth gradient."""
        return layer_entropy(self.heads)["mean"]


@dataclass
class _Measured:
    sums: np.ndarray  # (layers, heads, stats) corpus-wide sums
    layer_ids: np.ndarray  # (layers,) which model layers the sums are of
    chunks: int  # chunks of sentences the corpus was measured in
    measured_sentences: int  # sentences with at least one token
    tokens: int
    truncated: int
    max_length: int | None  # the truncation length actually applied
    batching: dict  # limits used and number of batches
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
    charts: str | None = "png",
    reporter: Reporter | None = None,
    padding_side: str = "right",
    **options,
) -> AnalysisResult:
    """Measure every attention head of `model` on `corpus`.

    model:   hub id, local folder, .gguf path, alias (``smollm2``) or an already loaded model
    corpus:  file path, list of sentences, or None for the shipped 100-sentence corpus
    out:     folder to write the tables, run.json and charts into (nothing is written when None)
    overwrite: replace a non-empty `out` (only once the new report is complete)
    resume:  checkpoint after every chunk of sentences and continue from the checkpoint an interrupted
             run with the same model, corpus and settings left behind (needs `out`)
    thresholds: head-type rule (default: Thresholds())
    charts:  chart format written with the tables (png, svg, pdf), or None for no charts
    options: any RunConfig field, e.g. ``window=3`` or ``batch_size=8``
    """
    config = dataclasses.replace(config or RunConfig(), **options)
    thresholds = thresholds or Thresholds()
    reporter = reporter or NullReporter()
    if resume and out is None:
        raise ConfigError("--resume needs an output folder (--out)")
    # Everything that can be refused without the model is refused before it loads (which can take minutes).
    corpus = _as_corpus(corpus, config)
    source = model.source if isinstance(model, LoadedModel) else resolve_source(model)
    stage = None
    if out is not None:
        stage = StagedDirectory(Path(out), overwrite=overwrite, resumable=resume, protected=_inputs(source, corpus))

    with contextlib.ExitStack() as cleanup:  # on error the staging folder goes (or stays, with resume)
        if stage is not None:
            cleanup.enter_context(stage)
            _report_cleaned(stage, reporter)
        started = time.perf_counter()
        loaded = model if isinstance(model, LoadedModel) else _load(source, config, reporter)
        check_options(config, loaded.model.config)
        load_seconds = time.perf_counter() - started

        kinds = ("sentences", "sentence_heads") if config.sentence_heads else ("sentences",)
        if stage is not None:
            store = PartFiles(stage.path, _fingerprint(loaded, corpus, config, padding_side), checkpoints=resume)
        else:
            store = MemoryChunks()
        progress, sums = Progress(), None
        if resume:
            progress, sums = store.load_progress(_sums_shape(loaded, config), kinds)
            config = _resumed_settings(config, progress, reporter)
        if loaded.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(loaded.device)
        started = time.perf_counter()
        measured = _measure(loaded, corpus, config, reporter, store, progress, sums, padding_side)
        measure_seconds = time.perf_counter() - started

        started = time.perf_counter()
        if stage is not None:
            reporter.stage("writing tables")
            rows = store.merged("sentences", SENTENCES_SCHEMA, stage.path / SENTENCES_FILE, measured.chunks)
            _check_rows("sentence", rows, len(corpus.sentences), store)
            if config.sentence_heads:
                rows = store.merged(
                    "sentence_heads", SENTENCE_HEADS_SCHEMA, stage.path / SENTENCE_HEADS_FILE, measured.chunks
                )
                _check_rows("sentence-head", rows, measured.measured_sentences * measured.sums[..., 0].size, store)
            sentences = read_table(stage.path / SENTENCES_FILE, SENTENCES_SCHEMA)
        else:
            sentences = store.sentences_table()
        measured_heads = heads_frame(measured.sums, loaded.architecture["kv_heads"], measured.layer_ids)
        heads = classify_heads(measured_heads, thresholds)
        examples = _example_attention(loaded, corpus, sentences, measured.max_length, padding_side)
        run = _run_record(loaded, corpus, config, measured, sentences, heads, load_seconds, measure_seconds)
        run["classification"] = classification_record(heads, thresholds)
        if stage is not None:
            write_table(heads, stage.path / HEADS_FILE, HEADS_SCHEMA, metadata=parquet_metadata(run))
            write_table(examples, stage.path / EXAMPLES_FILE, EXAMPLES_SCHEMA)
            run["timings"]["write_seconds"] = round(time.perf_counter() - started, 3)
            write_json(run, stage.path / RUN_FILE)
            if charts:
                reporter.stage("drawing charts")
                draw_charts(stage.path, fmt=charts)
            store.discard_checkpoint()
    if stage is not None:
        _report_cleaned(stage, reporter)

    return AnalysisResult(
        heads=heads,
        sentences=sentences,
        run=run,
        examples=examples,
        out_dir=stage.target if stage else None,
        _sentence_heads=store.sentence_heads_table() if stage is None else None,
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
        device=config.device,
        dtype=config.dtype,
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        device_map=config.device_map,
    )


def check_options(config: RunConfig, model_config) -> None:
    """Refuse options the model cannot satisfy (layers it lacks, sentences longer than its positions)."""
    _selected_layers(config.layers, architecture_of(model_config)["layers"])
    limit = model_max_length(model_config)
    if config.max_length and limit and config.max_length > limit:
        raise ConfigError(f"--max-length {config.max_length} exceeds the model's limit of {limit} tokens")


def _sums_shape(loaded: LoadedModel, config: RunConfig) -> tuple[int, int, int]:
    layers = loaded.architecture["layers"] if config.layers is None else len(config.layers)
    return (layers, loaded.architecture["heads"], len(STATS))


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


def _check_rows(what: str, rows: int, expected: int, store: PartFiles) -> None:
    if rows != expected:
        raise OutputError(
            f"the measured parts hold {rows:,} {what} rows where the run measured {expected:,}; "
            f"the checkpoint in {store.folder} does not add up: delete it and run again"
        )


def _fingerprint(loaded: LoadedModel, corpus: Corpus, config: RunConfig, padding_side: str) -> dict:
    """What must match for a checkpoint to be continued: everything that changes a number.

    Batch size and memory budget are left out: a resumed run reuses the first run's batching limits.
    """
    settings = {k: v for k, v in config.to_dict().items() if k not in ("batch_size", "max_memory", "device_map")}
    source = loaded.source
    return {
        "model": [source.kind, source.location, source.gguf_file, loaded.revision],
        "corpus_sha256": corpus.sha256,
        "device": loaded.device.type,
        "dtype": dtype_name(loaded.dtype),
        "padding_side": padding_side,
        "settings": settings,
    }


def _example_attention(
    loaded: LoadedModel, corpus: Corpus, all_sentences: pd.DataFrame, max_length: int | None, padding_side: str
) -> pd.DataFrame:
    """Every head's attention on the corpus sentence closest to EXAMPLE_TOKENS tokens (ties: first)."""
    sentences = all_sentences[all_sentences["n_tokens"] >= 2]
    if sentences.empty:
        sentences = all_sentences[all_sentences["n_tokens"] >= 1]
    distance = (sentences["n_tokens"] - EXAMPLE_TOKENS).abs()
    sentence_id = int(sentences.loc[distance.idxmin(), "sentence_id"])
    cut = min(EXAMPLE_MAX_TOKENS, max_length or EXAMPLE_MAX_TOKENS)
    ids, _ = tokenize_sentences(loaded.tokenizer, [corpus.sentences[sentence_id].text], cut)
    batch = collate([sentence_id], ids, padding_side=padding_side, device=loaded.device)
    attention = sentence_attention(loaded.model, batch).numpy()
    return examples_frame(sentence_id, token_labels(loaded.tokenizer, ids[0]), attention)


def _as_corpus(corpus, config: RunConfig) -> Corpus:
    if isinstance(corpus, Corpus):
        return corpus
    if isinstance(corpus, list):
        return corpus_from_texts(corpus)
    path = corpus if corpus is not None else default_corpus_path()
    return read_corpus(path, text_column=config.text_column, encoding_errors=config.encoding_errors)


def _measure(
    loaded: LoadedModel,
    corpus: Corpus,
    config: RunConfig,
    reporter: Reporter,
    store: MemoryChunks | PartFiles,
    progress: Progress,
    totals: np.ndarray | None,
    padding_side: str,
) -> _Measured:
    """Stream the corpus through the model chunk by chunk; keep only stat sums, hand rows to `store`.

    `progress` and `totals` come from a checkpoint when resuming: chunks already done are skipped.
    """
    limits = [x for x in (config.max_length, model_max_length(loaded.model.config)) if x is not None]
    max_length = min(limits) if limits else None
    # MPS has no float64; elsewhere float64 sums keep corpus-wide totals exact to ~1e-12.
    accum_dtype = torch.float32 if loaded.device.type == "mps" else torch.float64
    layer_ids = _selected_layers(config.layers, loaded.architecture["layers"])
    reducer = LayerReducer(
        window=config.window,
        accum_dtype=accum_dtype,
        layers=None if config.layers is None else layer_ids,
        block_bytes=config.block_bytes,
    )
    progress.batching = progress.batching or _batch_limits(loaded, config)
    limits = progress.batching

    reporter.start(len(corpus.sentences))
    chunk_starts = range(0, len(corpus.sentences), config.chunk_sentences)
    with measuring(loaded.model, reducer):
        for index, first in enumerate(chunk_starts):
            chunk = corpus.sentences[first : first + config.chunk_sentences]
            if index < progress.chunks_done:  # measured before the interruption
                reporter.advance(len(chunk), 0)
                continue
            ids, cut = tokenize_sentences(loaded.tokenizer, [s.text for s in chunk], max_length)
            tokenized = {s.sentence_id: row for s, row in zip(chunk, ids, strict=True) if row}
            per_sentence: dict[int, np.ndarray] = {}
            for batch in batches_in_order(
                tokenized,
                max_sentences=limits["max_sentences"],
                max_tokens=limits["max_tokens"],
                padding_side=padding_side,
                device=loaded.device,
            ):
                sums = measure_batch(loaded.model, reducer, batch).numpy()  # (layers, batch, heads, stats)
                batch_total = sums.sum(axis=1)
                totals = batch_total if totals is None else totals + batch_total
                for column, sentence_id in enumerate(batch.sentence_ids):
                    per_sentence[sentence_id] = sums[:, column]
                progress.tokens += batch.n_tokens
                progress.batches += 1
                reporter.advance(len(batch.sentence_ids), batch.n_tokens)
            reporter.advance(len(chunk) - len(tokenized), 0)  # sentences with no tokens
            store.add(
                index,
                _sentence_rows(chunk, ids, cut),
                _sentence_head_rows(per_sentence, tokenized, layer_ids, loaded.architecture["heads"], config),
            )
            progress.measured_sentences += len(tokenized)
            progress.truncated += sum(cut)
            progress.chunks_done = index + 1
            store.save_progress(progress, totals)
    reporter.finish()
    if totals is None:
        raise ConfigError("no sentence produced any token; check the corpus and the tokenizer")
    return _Measured(
        sums=totals,
        layer_ids=layer_ids,
        chunks=len(chunk_starts),
        measured_sentences=progress.measured_sentences,
        tokens=progress.tokens,
        truncated=progress.truncated,
        max_length=max_length,
        batching={**limits, "batches": progress.batches},
        attention_paths=dict(reducer.paths),
    )


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


def _sentence_head_rows(per_sentence, tokenized, layer_ids, heads: int, config: RunConfig) -> pd.DataFrame | None:
    if not config.sentence_heads:
        return None
    order = sorted(per_sentence)
    sums = np.stack([per_sentence[i] for i in order]) if order else np.zeros((0, len(layer_ids), heads, len(STATS)))
    return sentence_heads_frame(
        np.array(order, dtype=np.int64), np.array([len(tokenized[i]) for i in order]), sums, layer_ids
    )


def _selected_layers(requested: tuple[int, ...] | None, n_layers: int) -> np.ndarray:
    if requested is None:
        return np.arange(n_layers)
    beyond = [layer for layer in requested if layer >= n_layers]
    if beyond:
        raise ConfigError(f"--layers names layer {beyond[0]}, but the model has layers 0-{n_layers - 1}")
    return np.array(requested)


def _batch_limits(loaded: LoadedModel, config: RunConfig) -> dict:
    """Sentences and padded tokens per batch: the user's batch size (or up to 256), within the memory budget."""
    budget = config.max_memory or default_budget(loaded.device)
    text_config = loaded.model.config.get_text_config()
    hidden = text_config.hidden_size
    intermediate = getattr(text_config, "intermediate_size", None) or getattr(text_config, "n_inner", None)
    per_token = bytes_per_token(hidden, intermediate or 4 * hidden, loaded.dtype)
    return {
        "max_sentences": config.batch_size or MAX_AUTO_SENTENCES,
        "max_tokens": tokens_per_batch(budget, per_token, config.block_bytes),
        "memory_budget_bytes": budget,
    }


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in ("headscope", "torch", "transformers", "tokenizers", "gguf", "pandas", "pyarrow"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _peak_memory(device: torch.device) -> dict[str, int]:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    peaks = {"peak_rss_bytes": int(rss)}
    if device.type == "cuda":
        peaks["peak_cuda_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return peaks


def _run_record(loaded, corpus, config, measured, sentences, heads, load_seconds, measure_seconds) -> dict:
    source = loaded.source
    return {
        "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "input": source.display,
            "kind": source.kind,
            "location": source.location,
            "gguf_file": source.gguf_file,
            "revision": loaded.revision,
            "architecture": loaded.architecture,
        },
        "device": str(loaded.device),
        "dtype": dtype_name(loaded.dtype),
        "attention_implementation": measured.attention_paths,
        "batching": measured.batching,
        "corpus": {
            "path": str(corpus.path),
            "sha256": corpus.sha256,
            "sentences": len(corpus.sentences),
            "blank_lines_skipped": corpus.blank_skipped,
            "invalid_utf8_lines": corpus.invalid_lines,
            "tokens": measured.tokens,
            "truncated_sentences": measured.truncated,
            "max_length": measured.max_length,
            "empty_sentences": int((sentences["n_tokens"] == 0).sum()),
        },
        "settings": config.to_dict(),
        "versions": _versions(),
        "timings": {
            "load_seconds": round(load_seconds, 3),
            "measure_seconds": round(measure_seconds, 3),
            "write_seconds": None,
            "tokens_per_second": round(measured.tokens / measure_seconds, 1) if measure_seconds > 0 else None,
            **_peak_memory(loaded.device),
        },
        "layer_mean_entropy": [round(float(x), 6) for x in layer_entropy(heads)["mean"]],
        "numerics": {
            "nonfinite_rows": int(heads["nonfinite_rows"].sum()),
            "heads_with_nonfinite_rows": int((heads["nonfinite_rows"] > 0).sum()),
            "unnormalised_rows": int(heads["unnormalised_rows"].sum()),
            "heads_with_unnormalised_rows": int((heads["unnormalised_rows"] > 0).sum()),
        },
    }
