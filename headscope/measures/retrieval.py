"""The retrieval probe (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality"): a span of
random tokens planted early in a long sequence and repeated at its end, and how often each head's strongest key, on
the repeat, is the token that followed the span's first copy (their copy-paste criterion, teacher-forced).

Inputs (`retrieval_inputs`), one sequence of `tokens` ids per seed s = 0, 1, ..., seeds - 1:
    prefix + filler[:early] + span + filler[early:] + span
- span: `span` ordinary ids (measures.probes.ordinary_token_ids) drawn without replacement by
  ``numpy.random.default_rng([RETRIEVAL_STREAM, s])`` (a stream of its own: not the battery's sequences);
- filler: ordinary ids not in the span, drawn with replacement from the same generator, so that each of the span's
  tokens occurs exactly twice; early = a tenth of the filler, so the first copy lies past a streaming cache's sink;
- prefix: the ids the tokenizer puts before ordinary text (measures.probes.prefix_ids).

Score, per head: over the rows p = second + j of the repeat (j = 0 .. span - 2), a hit where the key first + j + 1
(the token after the current one's first copy) holds the row's largest weight alone (a tie is no hit: an argmax
over keys in order would name the earliest, and uniform attention must not score);
probe_retrieval is the share of hits, per seed, then the mean over seeds with a Student-t interval. Chance: a key
drawn uniformly from those the row sees hits with probability 1 / (p + 1); probe_retrieval_chance is its mean over
the same rows.

Where headscope differs from Wu et al.: the haystack is random tokens rather than essays, the needle a random span
rather than a sentence, and the rows are read teacher-forced (the repeat is in the input) rather than while the
model generates, so a head is scored on every token of the repeat, not only on those the model got right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headscope.errors import ConfigError
from headscope.estimates import t_interval
from headscope.measures.probes import ordinary_token_ids, prefix_ids
from headscope.measures.row_sums import diagonal_rows
from headscope.model.batch import Batch
from headscope.progress import Reporter

RETRIEVAL_STREAM = 0x72657472  # "retr": the generator's stream, apart from the battery's seeds 0, 1, ...
EARLY_SHARE = 10  # the span's first copy starts after 1/EARLY_SHARE of the filler


@dataclass(frozen=True)
class RetrievalSpec:
    """The probe's size: with the tokenizer it fixes every input."""

    seeds: int  # sequences, one per seed
    tokens: int  # tokens per sequence (prefix included)
    span: int  # random tokens planted, and repeated at the end


@dataclass(frozen=True)
class RetrievalProbe:
    """The probe of a run, checked: its spec, sequence(seed) -> ids, and where the span's copies start."""

    spec: RetrievalSpec
    sequence: object  # Callable[[int], list[int]]
    first: int  # position of the span's first copy
    second: int  # and of its repeat (tokens - span)


@dataclass
class RetrievalResult:
    """Per head: probe_retrieval (mean over seeds), its interval, and chance (the same for every head)."""

    scores: np.ndarray  # (layers, heads)
    low: np.ndarray
    high: np.ndarray
    chance: float
    per_seed: np.ndarray  # (seeds, layers, heads)


def retrieval_probe(tokenizer, spec: RetrievalSpec) -> RetrievalProbe:
    """The probe's sequences, refused in one line where the tokenizer or the length cannot hold them."""
    prefix = prefix_ids(tokenizer)
    filler = spec.tokens - len(prefix) - 2 * spec.span
    if filler < 2 * spec.span:
        raise ConfigError(
            f"--retrieval-length {spec.tokens} leaves {max(filler, 0)} filler tokens between two copies of "
            f"--probe-length {spec.span}; it needs at least {len(prefix) + 4 * spec.span} tokens"
        )
    candidates = ordinary_token_ids(tokenizer)
    if len(candidates) <= spec.span:
        raise ConfigError(
            f"--probe-length {spec.span} needs more distinct ordinary tokens than the tokenizer's {len(candidates)}"
        )
    early = filler // EARLY_SHARE

    def sequence(seed: int) -> list[int]:
        rng = np.random.default_rng([RETRIEVAL_STREAM, seed])
        span = rng.choice(candidates, size=spec.span, replace=False)
        hay = rng.choice(np.setdiff1d(candidates, span), size=filler).tolist()
        return prefix + hay[:early] + span.tolist() + hay[early:] + span.tolist()

    return RetrievalProbe(spec, sequence, first=len(prefix) + early, second=spec.tokens - spec.span)


def retrieval_hits(
    probs: torch.Tensor,
    row_offset: int,
    seq_start: torch.Tensor,
    query_valid: torch.Tensor,
    lengths: torch.Tensor,
    first: int,
    second: int,
) -> torch.Tensor:
    """Rows of a block where the target alone holds the row's largest weight, summed: (batch, heads) float64.

    probs: (batch, heads, rows, keys) of query positions row_offset .. row_offset + rows - 1 (every key of each row);
    query_valid: (batch, rows); lengths: (batch,) tokens of each whole sequence (a block holds only some of its rows).
    The rows scored are positions second .. length - 2 of each sequence (counted from seq_start), each targeting the
    key `second - first - 1` back from it. Pure: never writes `probs`.
    """
    _, scored = repeat_rows(row_offset, seq_start, query_valid, lengths, second)
    target = diagonal_rows(probs, row_offset + first - second + 1)  # (batch, heads, rows)
    largest = probs.amax(-1, keepdim=True)
    alone = (probs == largest).sum(-1) == 1  # one key holds it: uniform attention's rows are no hits
    hit = (target >= largest[..., 0]) & alone & (target > 0) & scored[:, None, :]
    return hit.sum(-1, dtype=torch.float64)


def repeat_rows(row_offset: int, seq_start: torch.Tensor, query_valid: torch.Tensor, lengths: torch.Tensor,
                second: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Of query rows row_offset, row_offset + 1, ... (query_valid: (batch, rows)): each row's position in its sequence
    and whether it is scored (the repeat's rows second .. length - 2, which have a next span token), (batch, rows)."""
    rows = query_valid.shape[-1]
    positions = torch.arange(row_offset, row_offset + rows, device=query_valid.device)[None, :] - seq_start[:, None]
    return positions, query_valid & (positions >= second) & (positions <= lengths[:, None] - 2)


def chance_rows(query_valid: torch.Tensor, seq_start: torch.Tensor, second: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the rows scored and the hits uniform attention's key would make, (batch,) float64 each."""
    positions, scored = repeat_rows(0, seq_start, query_valid, query_valid.sum(-1), second)
    uniform = torch.where(scored, 1.0 / (positions + 1).clamp(min=1).double(), 0.0)
    return scored.sum(-1).double(), uniform.sum(-1)


class RetrievalHits:
    """A Measure for the probe's batches: per (sequence, layer, head), the rows whose strongest key is the target."""

    def __init__(self, probe: RetrievalProbe, layers) -> None:
        self.first, self.second = probe.first, probe.second
        self.layers = sorted(set(layers))
        self._hits: dict[int, torch.Tensor] = {}  # layer -> (batch, heads)
        self._lengths: torch.Tensor | None = None  # (batch,) tokens of each sequence

    def start(self, batch: Batch) -> None:
        self._hits = {}
        self._lengths = batch.attention_mask.sum(-1)

    def wants(self, layer: int) -> bool:
        return layer in self.layers

    def last_layer(self) -> int | None:
        return self.layers[-1]

    def attention(self, layer: int, block) -> None:
        hits = retrieval_hits(block.probabilities().float(), block.first_row, block.seq_start, block.query_valid,
                              self._lengths.to(block.seq_start.device), self.first, self.second)  # fmt: skip
        self._hits[layer] = hits if layer not in self._hits else self._hits[layer] + hits

    def finish(self) -> np.ndarray:
        """(layers, batch, heads) hits, on the CPU."""
        return torch.stack([self._hits[layer] for layer in sorted(self._hits)]).cpu().numpy()


def check_retrieval(tokenizer, plan) -> RetrievalProbe | None:
    """The run's retrieval probe (None: --retrieval-length 0), refused before anything is measured where it cannot
    run: without the probes, longer than the model's positions, or too short to plant the span."""
    settings = plan.settings
    if not settings.retrieval_length:
        return None
    if not settings.probes:
        raise ConfigError("--retrieval-length runs with the probes (their --probe-seeds and --probe-length): drop "
                          "--no-probes, or the retrieval length")  # fmt: skip
    if plan.model_limit is not None and settings.retrieval_length > plan.model_limit:
        raise ConfigError(
            f"--retrieval-length {settings.retrieval_length} is longer than the model's limit of {plan.model_limit} "
            "tokens; lower it"
        )
    spec = RetrievalSpec(settings.probe_seeds, settings.retrieval_length, settings.probe_length)
    return retrieval_probe(tokenizer, spec)


def run_retrieval(capture, probe: RetrievalProbe, device, plan, reporter: Reporter) -> RetrievalResult:
    """The retrieval probe (checked by `check_retrieval`) through `capture`, batch by batch."""
    spec = probe.spec
    reporter.stage(f"retrieval probe: {spec.seeds} sequences of {spec.tokens} tokens")
    hits_of = RetrievalHits(probe, plan.layers)
    limits = plan.limits("corpus")
    per_batch = max(1, min(limits.max_sentences, limits.max_tokens // spec.tokens))
    hits, rows, chance = [], [], []
    for first in range(0, spec.seeds, per_batch):
        seeds = range(first, min(first + per_batch, spec.seeds))
        batch = plan.collate(list(seeds), [probe.sequence(seed) for seed in seeds], device)
        capture.run(batch, measures=[hits_of])
        hits.append(np.moveaxis(hits_of.finish(), 1, 0))  # (batch, layers, heads)
        scored, uniform = chance_rows(batch.attention_mask.bool(), batch.seq_start, probe.second)
        rows.append(scored.cpu().numpy())
        chance.append(uniform.cpu().numpy())
    hits_all, rows_all, chance_all = (np.concatenate(parts) for parts in (hits, rows, chance))
    per_seed = hits_all / rows_all[:, None, None]
    mean, low, high = t_interval(per_seed)
    return RetrievalResult(mean, low, high, float(chance_all.sum() / rows_all.sum()), per_seed)
