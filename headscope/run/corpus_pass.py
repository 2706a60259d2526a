"""The corpus pass: every chunk of the feed through the attached model, the statistics riding on it.

It keeps only the corpus-wide sums (and the bootstrap's replicate sums) and a few counts; each chunk's
per-sentence rows go to part files, and with --resume a checkpoint follows every chunk. The host's work for a
chunk (tokenizing, planning, collating, pinning) runs a few batches ahead in a thread on CUDA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from headscope.errors import ConfigError
from headscope.estimates import MIN_BOOTSTRAP_SENTENCES, Bootstrap
from headscope.measures.statistics import AttentionStatistics
from headscope.progress import Reporter
from headscope.run.checkpoint import PartFiles, Progress
from headscope.run.distributed import ONE_PROCESS, Ranks, Rounds, combined
from headscope.run.feed import Chunk, CorpusFeed
from headscope.run.head_evidence import HeadEvidence
from headscope.run.plan import Plan
from headscope.run.prefetch import prefetched
from headscope.tables import sentence_heads_frame

# Batches (and chunk ends) the host thread may prepare ahead of a GPU. On a CPU the model itself needs every
# core and the GIL between its many small ops: a host thread there made the 20,000-sentence run of
# benchmarks/pipeline.py 0.25 s slower (median of 10, 2 cores), so the CPU runs the host work in series.
HOST_AHEAD = 8
PENDING_BYTES = 64 * 2**20  # per-sentence sums held on the device before they are moved in one transfer


@dataclass
class Measured:
    """What the corpus pass keeps of a whole corpus: sums and a few facts; the per-sentence rows went to parts."""

    sums: np.ndarray  # (layers, heads, stats) corpus-wide sums
    bootstrap: Bootstrap | None  # the replicate sums behind the intervals (None: --bootstrap 0)
    progress: Progress  # counts: sentences measured, empty, tokens, truncated, batches; the example sentence
    attention_paths: dict  # attention class -> how its probabilities were read
    # how each measured layer's attention output reaches the residual stream (WritePath.describe(), by layer); empty
    # when no pass ran here (a resumed run whose checkpoint held every chunk)
    write_paths: list[str] = dataclasses.field(default_factory=list)
    evidence: HeadEvidence | None = None  # the heads' exemplars and detector sums

    @property
    def resampled(self) -> bool:
        """Do the intervals exist: bootstrap replicates over at least two measured sentences (over one, every
        replicate is that sentence again, and the "interval" would have zero width)?"""
        return self.bootstrap is not None and self.progress.measured_sentences >= MIN_BOOTSTRAP_SENTENCES


def measure_corpus(
    capture,
    feed: CorpusFeed,
    plan: Plan,
    parts: PartFiles,
    progress: Progress,
    running: dict[str, np.ndarray],
    reporter: Reporter,
    *,
    device: torch.device,
    ranks: Ranks = ONE_PROCESS,
) -> Measured:
    """Stream the feed through `capture` chunk by chunk; keep the sums, hand per-sentence rows to `parts`.

    `progress` and `running` (the sums so far) come from a checkpoint when resuming: chunks already done
    are skipped.
    """
    settings = plan.settings
    bootstrap = None
    if settings.bootstrap:
        bootstrap = Bootstrap(settings.bootstrap, settings.bootstrap_seed, len(plan.layers), plan.heads,
                              product=_torch_product)  # fmt: skip
        bootstrap.sums = running.get("bootstrap", bootstrap.sums)
    evidence = HeadEvidence(plan, feed.tokenizer, running)
    statistics = AttentionStatistics.from_plan(plan, exemplars=evidence.exemplars)
    measures = [statistics, *evidence.measures]
    sums = _RunningSums(running.get("sums", np.zeros(plan.sums_shape)), bootstrap)
    reporter.start(len(feed.corpus.sentences))
    rounds = Rounds(ranks, reporter, len(feed))
    with rounds:
        host = _host_work(feed, plan, progress, ranks, pin=device.type == "cuda")
        for chunk, batch in prefetched(host, depth=HOST_AHEAD if device.type == "cuda" else 0):
            if isinstance(chunk, int):  # a chunk measured before the interruption
                skipped = len(feed.sentences(chunk))
                reporter.advance(skipped, 0)
                rounds.meet(skipped, 0)
                continue
            if batch is not None:
                capture.run(batch.to(device), measures=measures)
                sums.add(batch.sentence_ids, statistics.finish())
                evidence.add(batch.sentence_ids)
                progress.tokens += batch.n_tokens
                progress.batches += 1
                reporter.advance(len(batch.sentence_ids), batch.n_tokens)
                continue
            per_sentence = sums.end_chunk()
            tokenized = chunk.tokenized
            reporter.advance(len(chunk.sentences) - len(tokenized), 0)  # sentences with no tokens
            parts.add(chunk.index, _sentence_rows(chunk), _sentence_head_rows(per_sentence, tokenized, plan))
            _count_chunk(progress, chunk)
            progress.chunks_done = chunk.index + 1
            running = {"sums": sums.totals, **({"bootstrap": bootstrap.sums} if bootstrap else {})}
            running |= evidence.running()
            parts.save_progress(progress, running, plan.record())
            rounds.meet(len(chunk.sentences), sum(len(ids) for ids in tokenized.values()))
    reporter.finish()
    write_paths = [path.describe() for path in capture.write_paths]
    measured = Measured(sums.totals, bootstrap, progress, dict(capture.paths), write_paths, evidence)
    if ranks.parallel:  # every rank's share added up
        measured = combined(ranks, measured, device, len(feed))
        evidence.combined(ranks, device)
    if measured.progress.tokens == 0:
        raise ConfigError("no sentence produced any token; check the corpus and the tokenizer")
    return measured


def _host_work(feed: CorpusFeed, plan: Plan, progress: Progress, ranks: Ranks, *, pin: bool):
    """The host's work, in order: for each of this rank's chunks, its collated batches, then (chunk, None)
    when it ends; (index, None) for a chunk measured before an interruption. Runs in the prefetch thread on
    CUDA: tokenizing, planning and collating (into pinned memory) happen while the model runs the batches
    before."""
    for index in range(len(feed)):
        if not ranks.owns(index):  # another rank's
            continue
        if index < progress.chunks_done:
            yield index, None
            continue
        chunk = feed.chunk(index)
        for batch in plan.chunk_batches(feed, chunk):
            yield chunk, batch.pinned() if pin else batch
        yield chunk, None


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


def _torch_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b by torch on the CPU: in the model's thread pool, where numpy's BLAS threads would compete with it."""
    return (torch.from_numpy(a) @ torch.from_numpy(b)).numpy()


def _count_chunk(progress: Progress, chunk: Chunk) -> None:
    """Add a measured chunk's counts to `progress`, and its sentences to the length index."""
    lengths = [len(row) for row in chunk.ids]
    progress.measured_sentences += sum(n > 0 for n in lengths)
    progress.empty_sentences += sum(n == 0 for n in lengths)
    progress.truncated += sum(chunk.cut)
    progress.capped += chunk.capped
    for sentence, n in zip(chunk.sentences, lengths, strict=True):
        entry = progress.lengths.setdefault(str(n), [0, sentence.sentence_id])
        entry[0] += 1
        entry[1] = min(entry[1], sentence.sentence_id)


def _sentence_rows(chunk: Chunk) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "sentence_id": [s.sentence_id for s in chunk.sentences],
            "line": [s.line for s in chunk.sentences],
            "text": [s.text for s in chunk.sentences],
            "n_tokens": [len(row) for row in chunk.ids],
            "truncated": chunk.cut,
        }
    )


def _sentence_head_rows(per_sentence: dict[int, np.ndarray], tokenized, plan: Plan) -> pd.DataFrame | None:
    if not plan.settings.sentence_heads:
        return None
    order = sorted(per_sentence)
    sums = np.stack([per_sentence[i] for i in order]) if order else np.zeros((0, *plan.sums_shape))
    lengths = np.array([len(tokenized[i]) for i in order], dtype=np.int64)
    return sentence_heads_frame(np.array(order, dtype=np.int64), lengths, sums, np.array(plan.layers))
