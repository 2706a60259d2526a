"""From what the passes measured to the report's tables and run.json, written into the run's work folder (or, for a
report kept in memory, only the per-sentence tables, merged there from their parts).

The per-sentence tables are merged from their part files (never whole in memory) and checked against what the
run measured; heads and layers come from the corpus-wide sums, the bootstrap, the probes and importance; the
labels from the rules; run.json records it all (headscope.run.record).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.config import RoleThresholds, Thresholds
from headscope.errors import OutputError
from headscope.estimates import ProbeResult, head_intervals, layer_intervals
from headscope.interventions.dormant import DormantCheck
from headscope.interventions.importance import Importance
from headscope.labels import label_heads
from headscope.layout import (
    EXAMPLES_FILE,
    EXEMPLARS_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    PROBES_FILE,
    RUN_FILE,
    SENTENCE_HEADS_FILE,
    SENTENCES_FILE,
)
from headscope.measures.exemplars import exemplar_frame, with_context
from headscope.model.loading import LoadedModel
from headscope.run.checkpoint import PartFiles
from headscope.run.corpus import Corpus
from headscope.run.corpus_pass import Measured
from headscope.run.feed import char_limit, token_texts, tokenize_sentences
from headscope.run.plan import Plan
from headscope.run.record import Timings, run_record
from headscope.tables import (
    REPORT_SCHEMAS,
    heads_frame,
    heads_schema,
    layers_frame,
    parquet_metadata,
    probes_frame,
    write_json,
    write_table,
)


@dataclass
class Analysis:
    """Everything an analyze run measured and what it measured it on, named: what the tables and run.json are
    written from."""

    loaded: LoadedModel
    corpus: Corpus
    plan: Plan
    measured: Measured  # the corpus pass: sums, bootstrap, progress, attention paths
    probes: ProbeResult | None
    importance: Importance | None
    # the example views (tables.EXAMPLES_SCHEMA), or what computes them when first read (a report kept in memory)
    examples: pd.DataFrame | Callable[[], pd.DataFrame]
    thresholds: Thresholds
    roles: RoleThresholds
    timings: Timings
    dormant: DormantCheck | None = None  # the dormant label's removal check (interventions.dormant)
    copying: np.ndarray | None = None  # every model layer's ov_copying scores, (layers, heads)
    copying_from: str = "not computed"  # where W_U came from, and the cache; or why there are no scores


def write_tables(
    folder: Path, analysis: Analysis, parts: PartFiles, *, in_memory: bool = False
) -> tuple[dict, dict[str, pd.DataFrame | Callable | None]]:
    """Write every table and run.json into `folder`; return run.json's content and the small tables in hand
    (heads, layers, examples, probes, by file name). in_memory: a report nobody will open from `folder` (a
    temporary one): only the per-sentence tables are written there (merged from their parts, read back by the
    caller); the small tables stay frames, unwritten."""
    a, plan, measured = analysis, analysis.plan, analysis.measured
    with a.timings.phase("write"):
        _merge_parts(parts, folder, measured, a.corpus, plan)
        replicates = measured.bootstrap.metrics() if measured.resampled else None
        heads = labelled_heads(plan, measured, a.probes, a.importance, (a.thresholds, a.roles), replicates, a.dormant,
                               a.copying)  # fmt: skip
        layers = layers_frame(heads, layer_intervals(replicates) if replicates else None, plan.attention)
        probes = None if a.probes is None else probes_frame(a.probes.per_seed, np.array(plan.layers))
        small = {LAYERS_FILE: layers, EXAMPLES_FILE: a.examples, PROBES_FILE: probes,
                 EXEMPLARS_FILE: exemplars_of(measured, plan, a.loaded.tokenizer, a.corpus)}  # fmt: skip
        if not in_memory:
            for name, frame in small.items():
                if frame is not None:
                    write_table(frame, folder / name, REPORT_SCHEMAS[name])
    run = run_record(analysis, heads)
    if not in_memory:
        write_table(heads, folder / HEADS_FILE, heads_schema(heads), metadata=parquet_metadata(run))
        write_json(run, folder / RUN_FILE)
    return run, {HEADS_FILE: heads, **small}


def labelled_heads(
    plan, measured, probes, importance, rules, replicates=None, dormant=None, copying=None
) -> pd.DataFrame:
    """The heads table with both labels, from what the passes measured (intervals when `replicates` are given; the
    dormant label as its removal check, `dormant`, left it; ov_copying from `copying`, every model layer's)."""
    frame = heads_frame(
        measured.sums,
        plan.architecture["kv_heads"],
        np.array(plan.layers),
        intervals=head_intervals(replicates) if replicates else None,
        probes=probes,
        importance=None if importance is None else importance.columns(),
        dormant_check=None if dormant is None else dormant.statuses(),
        copying=None if copying is None else copying[np.array(plan.layers)],
    )
    detectors = None if measured.evidence is None else measured.evidence.detector_scores(measured.resampled)
    if detectors is not None:  # the run's own columns, after the registry's
        frame = frame.assign(**{name: values.reshape(-1) for name, values in detectors.columns().items()})
    return label_heads(frame, *rules)


def exemplars_of(measured, plan, tokenizer, corpus) -> pd.DataFrame | None:
    """exemplars.parquet's rows, each with the tokens around it (None: the run kept none, --exemplars 0). The
    exemplars' sentences are tokenized again, as the pass tokenized them; the model does not run."""
    evidence = measured.evidence
    state = None if evidence is None else evidence.exemplar_state()
    if state is None:
        return None
    frame = exemplar_frame(state, evidence.kinds, plan.layers)
    wanted = set(frame["sentence"].unique().tolist())
    texts = {s.sentence_id: s.text for s in corpus.sentences if s.sentence_id in wanted}
    order = sorted(texts)
    if not order:  # no row counted (sentences of fewer than 5 tokens): the table has no rows
        return with_context(frame, {})
    ids, _ = tokenize_sentences(tokenizer, [texts[i] for i in order], plan.max_length,
                                max_chars=char_limit(tokenizer, plan.max_length))  # fmt: skip
    tokens = {sentence: token_texts(tokenizer, row) for sentence, row in zip(order, ids, strict=True)}
    return with_context(frame, tokens)


def _merge_parts(parts: PartFiles, folder: Path, measured, corpus, plan) -> None:
    """The per-sentence tables from their parts, checked against what the run measured."""
    chunks = measured.progress.chunks_done
    rows = parts.merged("sentences", REPORT_SCHEMAS[SENTENCES_FILE], folder / SENTENCES_FILE, chunks)
    _check_rows("sentence", rows, len(corpus.sentences), parts)
    if plan.settings.sentence_heads:
        schema = REPORT_SCHEMAS[SENTENCE_HEADS_FILE]
        rows = parts.merged("sentence_heads", schema, folder / SENTENCE_HEADS_FILE, chunks)
        _check_rows("sentence-head", rows, measured.progress.measured_sentences * measured.sums[..., 0].size, parts)


def _check_rows(what: str, rows: int, expected: int, parts: PartFiles) -> None:
    if rows != expected:
        raise OutputError(
            f"the measured parts hold {rows:,} {what} rows where the run measured {expected:,}; "
            f"the checkpoint in {parts.folder} does not add up: delete it and run again"
        )
