"""How sure each number is: the streamed Poisson bootstrap over sentences, and t-intervals over probe seeds."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import headscope
from headscope.columns import RATIOS, STAT_INDEX, STATS
from headscope.estimates import (
    Bootstrap,
    head_intervals,
    poisson_draws,
    replicate_ratios,
    replicate_weights,
    t_interval,
)

INTERVALS = [f"{m}_ci_{side}" for m in ("entropy", "norm_entropy", "sink", "diagonal") for side in ("low", "high")]


def test_poisson_draws_are_the_inverse_cdf_at_every_cut_point():
    """The prefix table decides most draws, an exact look-up the rest: both must give what comparing u = m / 2^53 with
    the CDF gives, at and around every cut point (where a prefix holds a cut) and on random numbers."""
    cdf = np.cumsum([math.exp(-1) / math.factorial(k) for k in range(20)])
    cuts = np.ceil(cdf * 2.0**53).astype(np.uint64)
    near = np.concatenate([cuts - np.uint64(1), cuts, cuts + np.uint64(1)])
    near = near[near < np.uint64(2**53)]
    spread = np.random.default_rng(0).integers(0, 2**53, size=200_000, dtype=np.uint64)
    for bits in (near, spread, np.array([0, 2**53 - 1], dtype=np.uint64)):
        # the plain definition: k = how many CDF values u reaches (floats: u is exact, 53 bits)
        expected = (bits.astype(np.float64)[:, None] / 2.0**53 >= cdf[None, :]).sum(1)
        np.testing.assert_array_equal(poisson_draws(bits), expected)


def test_replicate_weights_are_a_pure_function_of_seed_sentence_and_replicate():
    ids = np.arange(1000)
    weights = replicate_weights(ids, 50, seed=7)
    assert weights.shape == (50, 1000) and (weights == np.round(weights)).all() and weights.min() == 0
    np.testing.assert_array_equal(replicate_weights(ids[::-1], 50, seed=7), weights[:, ::-1])  # any order
    np.testing.assert_array_equal(replicate_weights(ids[500:], 50, seed=7), weights[:, 500:])  # any split
    assert not np.array_equal(replicate_weights(ids, 50, seed=8), weights)
    many = replicate_weights(np.arange(200_000), 1, seed=0)[0]
    assert many.mean() == pytest.approx(1.0, abs=0.01) and many.var() == pytest.approx(1.0, abs=0.02)
    assert (many == 0).mean() == pytest.approx(math.exp(-1), abs=0.005)  # P(0) of Poisson(1)


def test_streamed_replicates_equal_the_direct_weighted_sums():
    rng = np.random.default_rng(0)
    sums = rng.uniform(0, 5, size=(2, 9, 3, len(STATS)))  # (layers, sentences, heads, stats)
    ids = np.array([4, 8, 15, 16, 23, 42, 7, 1, 2])
    streamed = Bootstrap(30, seed=3, layers=2, heads=3)
    for part in (slice(0, 4), slice(4, 9)):  # two batches
        streamed.add(ids[part], sums[:, part])
    weights = replicate_weights(ids, 30, seed=3).T  # (sentences, replicates)
    for metric, values in streamed.metrics().items():
        numerator, denominator = RATIOS[metric]
        direct = np.einsum("sr,lsh->rlh", weights, sums[..., STAT_INDEX[numerator]]) / np.einsum(
            "sr,lsh->rlh", weights, sums[..., STAT_INDEX[denominator]]
        )
        np.testing.assert_allclose(values, direct, rtol=1e-12, err_msg=metric)


def test_t_interval_on_known_numbers():
    mean, low, high = t_interval(np.array([1.0, 2.0, 3.0, 4.0]))
    half = 3.182446305284263 * np.std([1, 2, 3, 4], ddof=1) / 2  # t(0.975, 3) s / sqrt(4)
    assert mean == 2.5 and low == pytest.approx(2.5 - half) and high == pytest.approx(2.5 + half)


def test_percentile_intervals_of_a_known_replicate_set():
    replicates = {"entropy": np.arange(1, 1002, dtype=float)[:, None, None]}  # 1..1001
    low, high = head_intervals(replicates)["entropy"]
    assert low[0, 0] == pytest.approx(26.0) and high[0, 0] == pytest.approx(976.0)  # 2.5th and 97.5th


def random_sentences(corpus_lines: list[str], n: int, seed: int) -> list[str]:
    words = [w for line in corpus_lines for w in line.split()]
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=rng.integers(4, 40))) for _ in range(n)]


def test_batching_padding_and_order_change_no_interval(planted_gpt2, corpus_lines):
    sentences = random_sentences(corpus_lines, 60, seed=1)
    options = {"sentence_heads": False, "probes": False}
    base = headscope.analyze(str(planted_gpt2), sentences, **options)
    heads = base.heads
    for variant in ({"batch_size": 1}, {"batch_size": 7, "padding_side": "left"}):
        other = headscope.analyze(str(planted_gpt2), sentences, **options, **variant).heads
        np.testing.assert_allclose(other[INTERVALS], heads[INTERVALS], rtol=0, atol=1e-7, err_msg=str(variant))
    assert (heads["entropy_ci_low"] <= heads["entropy"]).all() and (heads["entropy"] <= heads["entropy_ci_high"]).all()
    layers = base.run["layer_mean_entropy"]
    assert len(layers) == 2


@pytest.mark.slow  # over 1.5 s on two cores
def test_a_corpus_four_times_larger_halves_the_intervals(planted_gpt2, corpus_lines):
    options = {"sentence_heads": False, "probes": False, "bootstrap": 400}
    small = headscope.analyze(str(planted_gpt2), random_sentences(corpus_lines, 100, seed=2), **options).heads
    large = headscope.analyze(str(planted_gpt2), random_sentences(corpus_lines, 400, seed=3), **options).heads
    for metric in ("entropy", "norm_entropy", "sink", "diagonal"):
        width = {name: (h[f"{metric}_ci_high"] - h[f"{metric}_ci_low"]) for name, h in (("s", small), ("l", large))}
        measurable = width["s"] > 1e-6  # heads whose metric does not vary across sentences have no width
        ratio = float(np.median(width["l"][measurable] / width["s"][measurable]))
        assert 0.38 < ratio < 0.65, (metric, ratio)  # 1/sqrt(4) = 0.5


@pytest.mark.slow  # over 1.5 s on two cores
def test_no_bootstrap_leaves_the_intervals_empty(planted_gpt2, corpus_lines, tmp_path):
    result = headscope.analyze(str(planted_gpt2), corpus_lines[:10], bootstrap=0, probes=False, out=tmp_path / "r")
    assert result.heads[INTERVALS].isna().all().all()
    layers = pd.read_parquet(tmp_path / "r" / "layers.parquet")
    assert layers["entropy_ci_low"].isna().all() and layers["entropy"].notna().all()
    assert result.run["bootstrap"] is None


def test_percentile_intervals_equal_numpys_nan_aware_ones():
    """Columns without NaN take a vectorised path; NaN-holding ones (a head no replicate saw) the nan-aware one."""
    import warnings

    from headscope.estimates import percentile_interval

    replicates = np.random.default_rng(0).normal(size=(200, 3, 5))
    replicates[5, 1, 2] = np.nan  # one replicate without rows for this head
    replicates[:, 0, 0] = np.nan  # a head no replicate saw
    low, high = percentile_interval(replicates)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected_low, expected_high = np.nanpercentile(replicates, [2.5, 97.5], axis=0)
    np.testing.assert_allclose(low, expected_low, rtol=0, atol=1e-12)
    np.testing.assert_allclose(high, expected_high, rtol=0, atol=1e-12)
    assert np.isnan(low[0, 0]) and np.isnan(low).sum() == 1
    one_low, one_high = percentile_interval(replicates[:, 1, 2])  # one column (a single group's delta, say)
    assert np.isclose(one_low, expected_low[1, 2], rtol=0, atol=1e-12) and np.ndim(one_high) == 0


def test_replicate_ratios_are_ratios_of_weighted_sums_with_signed_denominators():
    """ablate's and patch's one bootstrap step: sum_i w_ri x_i / sum_i w_ri y_i per replicate, against a plain loop
    over the Poisson weights; a negative denominator (patch's gap) is a ratio like any other, a zero one NaN."""
    ids = np.array([3, 8, 1, 5])
    numerator = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0], [-1.0, 4.0]])  # (sentences, columns)
    denominator = np.array([2.0, -3.0, 1.0, 0.5])
    got = replicate_ratios(ids, 40, 11, numerator, denominator)
    weights = replicate_weights(ids, 40, 11).T  # (sentences, replicates)
    for r in range(40):
        bottom = sum(weights[i, r] * denominator[i] for i in range(4))
        for c in range(2):
            top = sum(weights[i, r] * numerator[i, c] for i in range(4))
            assert np.isnan(got[r, c]) if bottom == 0 else got[r, c] == pytest.approx(top / bottom, rel=1e-12)
    assert (got < 0).any()  # signed denominators kept their sign
    assert np.isnan(replicate_ratios(ids, 5, 0, np.ones(4), np.zeros(4))).all()
