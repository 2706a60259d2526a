"""Numbers from per-head sums, in numpy (and scipy for quantiles): classify, plot and compare never import torch.

The measurements keep *sums* over attention rows, one slot per entry of ``columns.STATS`` (see
``headscope.measures.row_sums`` for how each is computed). Sums over sentences add up exactly to sums over
the corpus, so the means (``columns.RATIOS``) are taken only at the end: every metric is a token-weighted mean over
all non-padding query rows of all sentences.

Uncertainty comes from a streamed Poisson bootstrap over sentences (`Bootstrap`): every replicate weighs each
sentence by a Poisson(1) count drawn from (seed, sentence id, replicate) alone, so the intervals do not depend
on batching, sentence order, chunking or how the corpus is split between processes, and memory is
O(replicates x heads) whatever the corpus size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from headscope.columns import (
    COUNTS,
    INTERVAL_METRICS,
    OFFSET_CATEGORIES,
    OFFSINK_CATEGORIES,
    PROBE_PATTERNS,
    RATIOS,
    STAT_INDEX,
)


def metric_means(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Turn stat sums (..., len(STATS)) into metric means (...), ``entropy_std``, the row counts, and the
    top-offset evidence: ``top_offset`` (the category holding most rows' largest weight, a string) and
    ``top_offset_share`` (the share of evidence rows it holds); likewise ``offsink_top_offset`` and its share, off
    the sink.

    A metric with no rows to average (e.g. prev_token of one-token sentences) is NaN (top_offset: None).
    """
    sums = np.asarray(sums, dtype=np.float64)

    def stat(name: str) -> np.ndarray:
        return sums[..., STAT_INDEX[name]]

    out: dict[str, np.ndarray] = {name: stat(name).astype(np.int64) for name in COUNTS}
    with np.errstate(invalid="ignore", divide="ignore"):
        for metric, (numerator, denominator) in RATIOS.items():
            out[metric] = ratio(stat(numerator), stat(denominator))
        n = stat("n_rows")
        variance = stat("entropy_sq") / np.where(n > 0, n, 1) - out["entropy"] ** 2
        out["entropy_std"] = np.where(n > 0, np.sqrt(np.clip(variance, 0.0, None)), np.nan)
    for prefix, categories in (("", OFFSET_CATEGORIES), ("offsink_", OFFSINK_CATEGORIES)):
        counts = np.stack([stat(f"{prefix}top_{category}") for category in categories], axis=-1)  # (..., categories)
        evidence = stat(f"{prefix}evidence_rows")
        top = counts.argmax(-1)
        out[f"{prefix}top_offset"] = np.where(evidence > 0, np.array(categories, dtype=object)[top], None)
        out[f"{prefix}top_offset_share"] = ratio(np.take_along_axis(counts, top[..., None], -1)[..., 0], evidence)
    return out


def ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, NaN where the denominator is 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, numerator / np.where(denominator > 0, denominator, 1), np.nan)


# ---------------------------------------------------------------- bootstrap over sentences

# The (numerator, denominator) slots the intervals need, gathered from the sums in this order.
_BOOTSTRAP_SLOTS = tuple(dict.fromkeys(slot for metric in INTERVAL_METRICS for slot in RATIOS[metric]))
_BOOTSTRAP_INDEX = [STAT_INDEX[slot] for slot in _BOOTSTRAP_SLOTS]
# P(Poisson(1) <= k) for k = 0, 1, ...: a uniform number below entry k draws k.
_POISSON_CDF = np.cumsum([math.exp(-1) / math.factorial(k) for k in range(20)])
# The same cut points on the 53-bit integers the uniform numbers are made of (u = m / 2^53): CDF_k <= u exactly when
# ceil(CDF_k * 2^53) <= m (a power-of-two scaling is exact), so the draws are the float comparison's, bit for bit,
# without turning 4 million integers into floats (a tenth of a near-free model's run).
_POISSON_CUTS = np.ceil(_POISSON_CDF * 2.0**53).astype(np.uint64)
# The draw read off the top 16 of the 53 bits: all but 8 of the 65,536 prefixes hold no cut point, so the prefix
# decides the count; AMBIGUOUS marks those 8, whose draws are looked up exactly. One byte gathered per draw instead of
# a binary search (20,000 sentences x 200 replicates: 0.32 s -> 0.05-0.12 s), the same draws bit for bit.
_PREFIX_SHIFT = np.uint64(53 - 16)
_PREFIX_LOW = np.arange(2**16, dtype=np.uint64) << _PREFIX_SHIFT
_AMBIGUOUS = 255
_PREFIX_DRAW = np.where(
    np.searchsorted(_POISSON_CUTS, _PREFIX_LOW, side="right")
    == np.searchsorted(_POISSON_CUTS, _PREFIX_LOW + (np.uint64(1) << _PREFIX_SHIFT) - np.uint64(1), side="right"),
    np.searchsorted(_POISSON_CUTS, _PREFIX_LOW, side="right"),
    _AMBIGUOUS,
).astype(np.uint8)


def _mix(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finaliser: a bijective scramble of uint64 values (wrapping arithmetic is intended); into `out`
    (which may be `x`) when given."""
    out = np.array(x, dtype=np.uint64) if out is None else out
    with np.errstate(over="ignore"):
        out ^= out >> np.uint64(30)
        out *= np.uint64(0xBF58476D1CE4E5B9)
        out ^= out >> np.uint64(27)
        out *= np.uint64(0x94D049BB133111EB)
        out ^= out >> np.uint64(31)
    return out


# A bootstrap over sentences needs at least this many: over one sentence every replicate is that sentence again,
# and the "interval" has zero width whatever the sentence's own spread.
MIN_BOOTSTRAP_SENTENCES = 2
ONE_SENTENCE_NOTE = "a 95% interval needs two or more sentences: the intervals are left empty (NaN)"


def replicate_weights(sentence_ids: np.ndarray, replicates: int, seed: int) -> np.ndarray:
    """(replicates, sentences) Poisson(1) counts: bootstrap weights that are a pure function of (seed, sentence id,
    replicate), so any order or split of the corpus draws the same ones. C-contiguous, the left factor of every
    bootstrap product (analyze's, ablate's and patch's ratios, compare's paired sums), made in place (the draws of
    4 million pairs were 0.3 s with their temporaries, a fifth of a near-free run)."""
    ids = np.asarray(sentence_ids, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        key = (
            _mix(np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + ids)
            + np.arange(replicates, dtype=np.uint64)[:, None]
        )
        key = _mix(key, out=key)
    key >>= np.uint64(11)  # 53 random bits: u = bits / 2^53 in [0, 1)
    return poisson_draws(key).astype(np.float64)


def poisson_draws(bits: np.ndarray) -> np.ndarray:
    """Poisson(1) draws (uint8) by inverse CDF from uniform numbers given as 53-bit integers (u = bits / 2^53)."""
    draws = _PREFIX_DRAW[(bits >> _PREFIX_SHIFT).astype(np.uint16)]
    ambiguous = np.flatnonzero(draws == _AMBIGUOUS)
    draws.flat[ambiguous] = np.searchsorted(_POISSON_CUTS, bits.flat[ambiguous], side="right")
    return draws


class Bootstrap:
    """Streamed Poisson bootstrap of the INTERVAL_METRICS of every head: replicate sums of their slots.

    add() takes each batch's per-sentence sums; memory stays (replicates, layers, heads, slots).

    `product` multiplies two float64 matrices. numpy's (OpenBLAS) leaves its threads spinning after each call, and
    on a 2-core CPU they took the cores from the model's next forward passes: the analyze pass ran 0.2-0.4 s slower
    on a near-free model's 20,000 sentences (benchmarks/pipeline.py). The pass hands torch's, which shares the
    model's thread pool; this module stays torch-free.
    """

    def __init__(self, replicates: int, seed: int, layers: int, heads: int, product=np.matmul) -> None:
        self.replicates, self.seed, self.product = replicates, seed, product
        self.sums = np.zeros(self.shape(replicates, layers, heads))

    @staticmethod
    def shape(replicates: int, layers: int, heads: int) -> tuple[int, int, int, int]:
        return (replicates, layers, heads, len(_BOOTSTRAP_SLOTS))

    def add(self, sentence_ids, sums: np.ndarray) -> None:
        """sentence_ids: (batch,); sums: (layers, batch, heads, len(STATS)) of those sentences."""
        weights = replicate_weights(np.asarray(sentence_ids), self.replicates, self.seed)  # (replicates, batch)
        picked = np.moveaxis(sums[..., _BOOTSTRAP_INDEX], 1, 0)  # (batch, layers, heads, slots)
        replicated = self.product(weights, np.ascontiguousarray(picked.reshape(weights.shape[1], -1)))
        self.sums += replicated.reshape(self.sums.shape)

    def metrics(self) -> dict[str, np.ndarray]:
        """Every replicate's value of each interval metric, (replicates, layers, heads)."""
        slot = {name: i for i, name in enumerate(_BOOTSTRAP_SLOTS)}
        return {
            metric: ratio(self.sums[..., slot[numerator]], self.sums[..., slot[denominator]])
            for metric, (numerator, denominator) in ((m, RATIOS[m]) for m in INTERVAL_METRICS)
        }


def head_intervals(replicates: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per metric, the 95% percentile interval of every head, (layers, heads) each side."""
    return {metric: percentile_interval(values) for metric, values in replicates.items()}


def layer_intervals(replicates: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per metric, the 95% interval of each layer's mean over its heads, (layers,) each side."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a layer whose heads saw no rows: NaN
        return {metric: percentile_interval(np.nanmean(values, axis=-1)) for metric, values in replicates.items()}


def replicate_ratios(
    sentence_ids: np.ndarray, replicates: int, seed: int, numerator: np.ndarray, denominator: np.ndarray
) -> np.ndarray:
    """The ratio of sums every interval of ablate and patch is read from, in each bootstrap replicate r:
    sum_i w_ri numerator_i / sum_i w_ri denominator_i over the sentences (or pairs) i, with the Poisson weights of
    `replicate_weights`. numerator, denominator: (sentences, ...) -> (replicates, ...); NaN where a replicate's
    denominator is 0 (a signed one, such as patch's gap, may be negative)."""
    weights = replicate_weights(sentence_ids, replicates, seed)  # (replicates, sentences)
    top, bottom = weights @ numerator, weights @ denominator
    bottom = bottom.reshape(bottom.shape + (1,) * (top.ndim - bottom.ndim))  # one denominator for every column
    return np.divide(top, bottom, out=np.full(np.broadcast(top, bottom).shape, np.nan), where=bottom != 0)


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """The central `level` interval of bootstrap replicates along axis 0 (replicates with NaN are skipped)."""
    tail = 100 * (1 - level) / 2
    # np.nanpercentile works column by column in Python (apply_along_axis): 0.23 s for SmolLM2's heads. Columns
    # without NaN take np.percentile's vectorised path, which gives the same numbers (to an ulp of rounding).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN slice (a head without rows): NaN is right
        if replicates.ndim < 2:  # one column: scalars, as nanpercentile gives them
            low, high = np.nanpercentile(replicates, [tail, 100 - tail], axis=0)
            return low, high
        has_nan = np.isnan(replicates).any(axis=0)
        low, high = np.percentile(replicates, [tail, 100 - tail], axis=0)
        if has_nan.any():
            low[has_nan], high[has_nan] = np.nanpercentile(replicates[:, has_nan], [tail, 100 - tail], axis=0)
    return low, high


def t_interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and Student-t `level` interval over axis 0 (independent samples: probe seeds, say)."""
    from scipy import stats  # only where intervals are computed: it takes ~0.6 s to import

    n = samples.shape[0]
    mean = samples.mean(axis=0)
    if n < 2:
        return mean, np.full_like(mean, np.nan), np.full_like(mean, np.nan)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * samples.std(axis=0, ddof=1) / math.sqrt(n)
    return mean, mean - half, mean + half


# ---------------------------------------------------------------- probe scores


@dataclass
class ProbeResult:
    """Per head, for every pattern: the score (mean over seeds), its interval, and its chance level."""

    scores: dict[str, np.ndarray]  # pattern -> (layers, heads)
    low: dict[str, np.ndarray]
    high: dict[str, np.ndarray]
    chance: dict[str, float]  # pattern -> chance level (the same for every head)
    prefix: int  # tokens the tokenizer put before the random ones
    repeats: int  # copies of the random tokens in each sequence
    per_seed: np.ndarray | None = None  # (seeds, layers, heads, patterns): each seed's score
    off_sink: dict[str, np.ndarray] | None = None  # pattern -> (layers, heads): the score off the sink
    retrieval: object | None = None  # measures.retrieval.RetrievalResult, with --retrieval-length


def summarise_probes(
    mass: np.ndarray,
    rows: np.ndarray,
    chance: np.ndarray,
    off_sink: np.ndarray | None = None,
    off_sink_rows: np.ndarray | None = None,
    *,
    prefix: int,
    repeats: int,
) -> ProbeResult:
    """Scores per seed (mass / rows), then their mean and 95% t-interval over seeds; off the sink, the mean over
    seeds of each seed's off-sink mass / its rows.

    mass, off_sink: (seeds, layers, heads, patterns); rows, chance, off_sink_rows: (seeds, patterns).
    """
    per_seed = mass / rows[:, None, None, :]
    mean, low, high = t_interval(per_seed)
    chance_level = chance.sum(0) / rows.sum(0)
    off_sink_mean = None
    if off_sink is not None:
        scores = (off_sink / off_sink_rows[:, None, None, :]).mean(axis=0)
        off_sink_mean = {p: scores[..., i] for i, p in enumerate(PROBE_PATTERNS)}
    return ProbeResult(
        scores={p: mean[..., i] for i, p in enumerate(PROBE_PATTERNS)},
        low={p: low[..., i] for i, p in enumerate(PROBE_PATTERNS)},
        high={p: high[..., i] for i, p in enumerate(PROBE_PATTERNS)},
        chance={p: float(chance_level[i]) for i, p in enumerate(PROBE_PATTERNS)},
        prefix=prefix,
        repeats=repeats,
        per_seed=per_seed,
        off_sink=off_sink_mean,
    )
