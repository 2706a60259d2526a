"""The probe battery: repeated random tokens, and how much attention each head gives the keys that three
mechanisms would pick.

Inputs (`probe_inputs`), one sequence per seed s = 0, 1, ..., seeds - 1:
    prefix + r + r        (r repeated `repeats` times, 2 by default)
- r: `length` token ids drawn without replacement by ``numpy.random.default_rng(s).choice`` from the
  tokenizer's *ordinary* ids: every id below ``len(tokenizer)`` that is neither a special token
  (``all_special_ids``) nor an added token (``added_tokens_decoder``), in increasing order. Without
  replacement, a token's only earlier occurrences are its copies in earlier repeats.
- prefix: exactly the ids the tokenizer puts before ordinary text (its BOS, for most models), found by
  encoding a sample sentence with and without special tokens.

Scores, per head, each a mean over only the query rows where its pattern is defined (p = position in the
sequence, P = prefix length, L = length):
    probe_induction  rows in a repeat (p >= P + L): mass on p - kL + 1 for every earlier copy k >= 1,
                     the token that followed each earlier occurrence of the current one
    probe_duplicate  rows in a repeat: mass on p - kL, the earlier occurrences of the current token
    probe_previous   rows p >= P + 1 (query and key random tokens): mass on p - 1
Each has a chance level beside it: what uniform causal attention gives on the same rows, the number of
target keys over the p + 1 keys a row sees. Scores are per seed first; the reported score is their mean,
with a Student-t interval over seeds.

Off the sink (probe_<pattern>_offsink): the same mass with each row's attention renormalised without the
sequence's first token (mass / the row's mass on every other key), over the rows whose targets are not that token
(with no prefix, the first copy's first token is both): what a head that parks most of its mass on the first token
does with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.columns import PROBE_PATTERNS
from headscope.errors import ConfigError
from headscope.estimates import ProbeResult, summarise_probes
from headscope.measures.row_sums import diagonal_rows
from headscope.measures.rows import without_first
from headscope.model.batch import Batch
from headscope.progress import Reporter

SAMPLE_TEXT = "The cat sat on the mat."  # encoded once to learn which ids the tokenizer puts before text


@dataclass(frozen=True)
class ProbeSpec:
    """The size of the battery; with the tokenizer, it fixes every input."""

    seeds: int  # sequences, one per seed 0..seeds-1
    length: int  # random tokens per copy
    repeats: int = 2  # copies of them in each sequence

    def __post_init__(self) -> None:
        if self.seeds < 2:
            raise ConfigError(f"--probe-seeds must be 2 or more (an interval needs two); got {self.seeds}")
        if self.length < 2:
            raise ConfigError(f"--probe-length must be 2 or more; got {self.length}")
        if self.repeats < 2:
            raise ConfigError(f"probe repeats must be 2 or more; got {self.repeats}")


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """Every id below len(tokenizer) that is neither special nor added, in increasing order."""
    excluded = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", None) or {})
    return np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)


def prefix_ids(tokenizer) -> list[int]:
    """The ids the tokenizer adds before ordinary text (a BOS, usually; none for GPT-2)."""
    plain = tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    full = tokenizer(SAMPLE_TEXT, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def probe_inputs(tokenizer, spec: ProbeSpec) -> tuple[list[list[int]], int]:
    """One token-id sequence per seed, and the prefix length P."""
    sequence, prefix = probe_sequences(tokenizer, spec)
    return [sequence(seed) for seed in range(spec.seeds)], prefix


def probe_sequences(tokenizer, spec: ProbeSpec):
    """sequence(seed) -> the seed's token ids, and the prefix length P: each sequence made when it is wanted."""
    candidates = ordinary_token_ids(tokenizer)
    if len(candidates) < spec.length:
        raise ConfigError(
            f"--probe-length {spec.length} needs that many distinct ordinary tokens; "
            f"the tokenizer has {len(candidates)}: lower --probe-length, or pass --no-probes"
        )
    prefix = prefix_ids(tokenizer)

    def sequence(seed: int) -> list[int]:
        random_part = np.random.default_rng(seed).choice(candidates, size=spec.length, replace=False).tolist()
        return prefix + random_part * spec.repeats

    return sequence, len(prefix)


def pattern_rows(positions: torch.Tensor, prefix: int, spec: ProbeSpec) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """For each pattern: which rows it is defined on, and the key offsets (key - query) it targets.

    positions: (..., rows) position of each row in its sequence. Returns pattern -> (bool mask like
    `positions`, offsets); a row's target keys are those offsets that land at or after the prefix.
    """
    length, repeats = spec.length, spec.repeats
    in_repeat = (positions >= prefix + length) & (positions < prefix + repeats * length)
    random_rows = (positions >= prefix + 1) & (positions < prefix + repeats * length)
    earlier = [-k * length for k in range(1, repeats)]
    return {
        "induction": (in_repeat, [offset + 1 for offset in earlier]),
        "duplicate": (in_repeat, earlier),
        "previous": (random_rows, [-1]),
    }


def pattern_mass(
    probs: torch.Tensor,
    row_offset: int,
    seq_start: torch.Tensor,
    query_valid: torch.Tensor,
    prefix: int,
    spec: ProbeSpec,
) -> torch.Tensor:
    """Mass on each pattern's target keys, summed over a block of rows where the pattern is defined.

    probs: (batch, heads, rows, keys) probabilities of query positions row_offset .. row_offset + rows - 1;
    query_valid: (batch, rows). Returns (batch, heads, patterns) in float64. Pure: never writes `probs`.
    """
    batch, heads, rows, _ = probs.shape
    positions = torch.arange(row_offset, row_offset + rows, device=probs.device)[None, :] - seq_start[:, None]
    sums = []
    for pattern in PROBE_PATTERNS:
        defined, offsets = pattern_rows(positions, prefix, spec)[pattern]
        mass = torch.zeros(batch, heads, rows, device=probs.device)
        for offset in offsets:
            lands = (defined & query_valid & (positions + offset >= prefix))[:, None, :]  # the target is random
            mass += torch.where(lands, diagonal_rows(probs, row_offset + offset), 0.0)
        sums.append(mass.sum(-1).double())
    return torch.stack(sums, dim=-1)


def off_sink_pattern_mass(
    probs: torch.Tensor,
    row_offset: int,
    seq_start: torch.Tensor,
    query_valid: torch.Tensor,
    prefix: int,
    spec: ProbeSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`pattern_mass` of the attention renormalised without each sequence's first token, over the rows where some
    target is another token: ((batch, heads, patterns) float64 mass, (batch, patterns) float64 rows)."""
    batch, heads, rows, _ = probs.shape
    positions = torch.arange(row_offset, row_offset + rows, device=probs.device)[None, :] - seq_start[:, None]
    rest, _ = without_first(probs, seq_start, None)
    rest_mass = rest.sum(-1, dtype=torch.float64)  # (batch, heads, rows): summed, never 1 - sink
    sums, counts = [], []
    for pattern in PROBE_PATTERNS:
        defined, offsets = pattern_rows(positions, prefix, spec)[pattern]
        mass = torch.zeros(batch, heads, rows, device=probs.device)
        counted = torch.zeros_like(defined)
        for offset in offsets:
            lands = defined & query_valid & (positions + offset >= max(prefix, 1))  # random, and not the first
            counted |= lands
            mass += torch.where(lands[:, None, :], diagonal_rows(probs, row_offset + offset), 0.0)
        kept = counted[:, None, :] & (rest_mass > 0)
        sums.append(torch.where(kept, mass.double() / rest_mass, 0.0).sum(-1))
        counts.append(counted.sum(-1).double())
    return torch.stack(sums, dim=-1), torch.stack(counts, dim=-1)


def pattern_counts(query_valid: torch.Tensor, seq_start: torch.Tensor, prefix: int, spec: ProbeSpec):
    """Per sequence and pattern: the rows it is defined on, and the mass uniform causal attention would put
    on their targets (each row sees p + 1 keys). query_valid: (batch, t). Returns two (batch, patterns)."""
    t = query_valid.shape[-1]
    positions = torch.arange(t, device=query_valid.device)[None, :] - seq_start[:, None]  # (batch, t)
    rows, chance = [], []
    for pattern in PROBE_PATTERNS:
        defined, offsets = pattern_rows(positions, prefix, spec)[pattern]
        defined = defined & query_valid
        targets = sum((defined & (positions + offset >= prefix)).double() for offset in offsets)
        rows.append(defined.sum(-1).double())
        chance.append((targets / (positions + 1).clamp(min=1)).sum(-1))
    return torch.stack(rows, dim=-1), torch.stack(chance, dim=-1)


class ProbeScores:
    """A Measure for probe batches: per (sequence, layer, head), the target mass of every pattern, and off the sink."""

    def __init__(self, spec: ProbeSpec, prefix: int, layers: Sequence[int]) -> None:
        self.spec, self.prefix = spec, prefix
        self.layers = sorted(set(layers))
        self._mass: dict[int, torch.Tensor] = {}  # layer -> (batch, heads, patterns)
        self._off_sink: dict[int, torch.Tensor] = {}  # layer -> (batch, heads, patterns)
        self._off_sink_rows: torch.Tensor | None = None  # (batch, patterns), summed over a layer's blocks
        self._counts: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, batch: Batch) -> None:
        self._mass, self._off_sink, self._off_sink_rows = {}, {}, None
        self._counts = pattern_counts(batch.attention_mask.bool(), batch.seq_start, self.prefix, self.spec)

    def wants(self, layer: int) -> bool:
        return layer in self.layers

    def last_layer(self) -> int | None:
        return self.layers[-1]

    def attention(self, layer: int, block) -> None:
        where = (block.probabilities().float(), block.first_row, block.seq_start, block.query_valid)
        mass = pattern_mass(*where, self.prefix, self.spec)
        off_sink, rows = off_sink_pattern_mass(*where, self.prefix, self.spec)
        self._mass[layer] = mass if layer not in self._mass else self._mass[layer] + mass
        self._off_sink[layer] = off_sink if layer not in self._off_sink else self._off_sink[layer] + off_sink
        if layer == self.layers[0]:  # the rows are the same in every layer: counted once
            self._off_sink_rows = rows if self._off_sink_rows is None else self._off_sink_rows + rows

    def finish(self) -> tuple[np.ndarray, ...]:
        """(layers, batch, heads, patterns) target mass; (batch, patterns) rows and chance mass; the same mass off
        the sink and its (batch, patterns) rows. On the CPU."""
        mass = torch.stack([self._mass[layer] for layer in sorted(self._mass)]).cpu().numpy()
        off_sink = torch.stack([self._off_sink[layer] for layer in sorted(self._off_sink)]).cpu().numpy()
        rows, chance = (x.cpu().numpy() for x in self._counts)
        return mass, rows, chance, off_sink, self._off_sink_rows.cpu().numpy()


@dataclass(frozen=True)
class Battery:
    """The probe battery of a run, checked: its spec, sequence(seed) -> token ids, the prefix length and the tokens
    of one sequence."""

    spec: ProbeSpec
    sequence: Callable[[int], list[int]]
    prefix: int
    tokens: int


def check_probes(tokenizer, plan) -> Battery:
    """The battery of `plan`, refused before anything is measured when it cannot run on this model (sequences
    longer than its positions, fewer ordinary tokens than a sequence needs)."""
    settings = plan.settings
    spec = ProbeSpec(seeds=settings.probe_seeds, length=settings.probe_length)
    sequence, prefix = probe_sequences(tokenizer, spec)
    tokens = prefix + spec.repeats * spec.length
    if plan.model_limit is not None and tokens > plan.model_limit:
        raise ConfigError(
            f"--probe-length {spec.length} makes probe sequences of {tokens} tokens, more than the "
            f"model's limit of {plan.model_limit}; lower --probe-length"
        )
    return Battery(spec, sequence, prefix, tokens)


def run_probes(capture, battery: Battery, device, plan, reporter: Reporter) -> ProbeResult:
    """The probe battery (checked by `check_probes`) through `capture` (an attached model), batch by batch."""
    spec, sequence, prefix, tokens = battery.spec, battery.sequence, battery.prefix, battery.tokens
    reporter.stage(f"probing: {spec.seeds} sequences of {tokens} tokens")
    scores = ProbeScores(spec, prefix, layers=plan.layers)
    limits = plan.limits("corpus")
    per_batch = max(1, min(limits.max_sentences, limits.max_tokens // tokens))
    masses, rows, chances, off_sink, off_sink_rows = [], [], [], [], []
    for first in range(0, spec.seeds, per_batch):
        seeds = range(first, min(first + per_batch, spec.seeds))
        batch = plan.collate(list(seeds), [sequence(seed) for seed in seeds], device)
        capture.run(batch, measures=[scores])
        # (layers, batch, heads, patterns), (batch, patterns) twice; the same off the sink
        mass, row, chance, off_mass, off_rows = scores.finish()
        masses.append(np.moveaxis(mass, 1, 0))
        rows.append(row)
        chances.append(chance)
        off_sink.append(np.moveaxis(off_mass, 1, 0))
        off_sink_rows.append(off_rows)
    joined = (np.concatenate(parts) for parts in (masses, rows, chances, off_sink, off_sink_rows))
    return summarise_probes(*joined, prefix=prefix, repeats=spec.repeats)
