"""The metric maths on hand-built attention with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headscope.columns import STAT_INDEX
from headscope.estimates import metric_means
from headscope.measures.row_sums import band_row_sums, head_row_sums
from headscope.model.batch import collate
from headscope.model.masks import causal_visible_keys, visible_keys

from reference import corpus_means
from tolerances import row_statistic

# Tolerances: float32 row statistics against float64 sums of the same probabilities (tests/support/tolerances.py), for
# the longest row and the largest magnitude a test's sentences have.


def uniform_causal(n: int) -> torch.Tensor:
    """(n, n): row t spreads its mass evenly over keys 0..t."""
    return torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1, dtype=torch.float32)[:, None]


def one_hot_rows(n: int, target) -> torch.Tensor:
    """(n, n): row t puts all its mass on key target(t)."""
    attn = torch.zeros(n, n)
    for t in range(n):
        attn[t, target(t)] = 1.0
    return attn


def measure(attn_per_sentence: list[torch.Tensor], *, window: int = 2, padding_side: str = "right") -> np.ndarray:
    """Pad (heads, n, n) sentences into one batch the way capture does; return (batch, heads, stats) sums."""
    lengths = [a.shape[-1] for a in attn_per_sentence]
    batch = collate(range(len(lengths)), [[1] * n for n in lengths], padding_side=padding_side)
    width, heads = max(lengths), attn_per_sentence[0].shape[0]
    # Padding rows get NaN: they must not leak into any sum.
    padded = torch.full((len(lengths), heads, width, width), float("nan"))
    for row, attn in enumerate(attn_per_sentence):
        start, stop = int(batch.seq_start[row]), int(batch.seq_start[row]) + lengths[row]
        padded[row, :, start:stop, :] = 0.0
        padded[row, :, start:stop, start:stop] = attn
    visible = causal_visible_keys(batch.attention_mask.bool())
    return head_row_sums(
        padded,
        key_visible=visible,
        query_valid=batch.attention_mask.bool(),
        seq_start=batch.seq_start,
        window=window,
    ).numpy()


def test_uniform_causal_rows_have_entropy_ln_t_plus_1():
    n = 7
    sums = measure([uniform_causal(n)[None]])
    means = metric_means(sums)
    expected_entropy = np.mean([math.log(t + 1) for t in range(n)])
    entropy, mass = row_statistic(n, math.log(n) + 1), row_statistic(n)
    assert means["entropy"][0, 0] == pytest.approx(expected_entropy, abs=entropy)
    assert means["norm_entropy"][0, 0] == pytest.approx(1.0, abs=entropy / math.log(2))  # divided by ln(t + 1) >= ln 2
    # the spread of the rows' entropies: each off by at most `entropy`, so their standard deviation by twice that
    assert means["entropy_std"][0, 0] == pytest.approx(np.std([math.log(t + 1) for t in range(n)]), abs=2 * entropy)
    expected_diagonal = np.mean([min(t + 1, 3) / (t + 1) for t in range(n)])
    assert means["diagonal"][0, 0] == pytest.approx(expected_diagonal, abs=mass)
    assert means["diagonal_uniform"][0, 0] == pytest.approx(expected_diagonal, abs=mass)
    assert means["sink"][0, 0] == pytest.approx(np.mean([1 / (t + 1) for t in range(n)]), abs=mass)
    assert means["prev_token"][0, 0] == pytest.approx(np.mean([1 / (t + 1) for t in range(1, n)]), abs=mass)
    assert means["max_weight"][0, 0] == pytest.approx(np.mean([1 / (t + 1) for t in range(n)]), abs=mass)
    assert means["n_rows"][0, 0] == n


def test_one_hot_rows_have_zero_entropy():
    n = 6
    means = metric_means(measure([one_hot_rows(n, lambda t: t)[None]]))
    assert means["entropy"][0, 0] == 0.0
    assert means["entropy_std"][0, 0] == 0.0
    assert means["norm_entropy"][0, 0] == 0.0
    # Exact inputs (weights of exactly 1 and 0) give exact sums; the mean's one division rounds as 1 / n does.
    assert means["max_weight"][0, 0] == 1.0
    assert means["diagonal"][0, 0] == 1.0
    assert means["sink"][0, 0] == 1 / n  # only row 0 attends to position 0
    assert means["prev_token"][0, 0] == 0.0


def test_previous_token_pattern():
    n = 5
    attn = one_hot_rows(n, lambda t: max(t - 1, 0))[None]
    means = metric_means(measure([attn], window=2))
    # Exact inputs, exact sums: each mean is one float64 division, rounded as the expected value's is.
    assert means["prev_token"][0, 0] == 1.0
    assert means["diagonal"][0, 0] == 1.0
    assert means["sink"][0, 0] == 2 / n  # rows 0 and 1 attend to position 0
    # With window 0 only row 0 (which attends to itself) keeps its mass on the diagonal.
    assert metric_means(measure([attn], window=0))["diagonal"][0, 0] == 1 / n


def test_one_token_sentence_has_no_prev_token_or_norm_entropy():
    means = metric_means(measure([torch.ones(1, 1, 1)]))
    assert np.isnan(means["prev_token"][0, 0])
    assert np.isnan(means["norm_entropy"][0, 0])
    assert means["entropy"][0, 0] == 0.0


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_padding_and_batching_change_nothing(padding_side):
    generator = torch.Generator().manual_seed(0)
    sentences = []
    for n in (3, 8, 5, 1):
        logits = torch.randn(2, n, n, generator=generator)
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        sentences.append(logits.softmax(-1))
    together = measure(sentences, padding_side=padding_side)
    alone = np.concatenate([measure([s]) for s in sentences])
    # Rows are reduced in float32: summing over a wider (padded) key axis may round differently, each of the 8 rows
    # of the longest sentence by up to its bound, on either side.
    np.testing.assert_allclose(together, alone, rtol=0, atol=2 * 8 * row_statistic(8, math.log(8) + 1))


def test_matches_the_plain_reference_implementation():
    generator = torch.Generator().manual_seed(1)
    sentences = []
    for n in (4, 9, 2, 13):
        logits = 3 * torch.randn(3, n, n, generator=generator)
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        sentences.append(logits.softmax(-1))
    means = metric_means(measure(sentences).sum(axis=0))
    expected = corpus_means([s.double().numpy() for s in sentences])
    bound = row_statistic(13, math.log(13) + 1) / math.log(2)  # norm_entropy divides by ln(t + 1) >= ln 2
    for name, values in expected.items():
        np.testing.assert_allclose(means[name], values, rtol=0, atol=bound, err_msg=name)


def test_inputs_are_not_modified():
    attn = uniform_causal(6)[None, None].repeat(1, 2, 1, 1)
    before = attn.clone()
    query_valid = torch.ones(1, 6, dtype=torch.bool)
    head_row_sums(
        attn,
        key_visible=causal_visible_keys(query_valid),
        query_valid=query_valid,
        seq_start=torch.zeros(1, dtype=torch.long),
        window=2,
    )
    assert torch.equal(attn, before)


@pytest.mark.parametrize("window", [0, 1, 2, 5, 20, 10**20])
def test_band_row_sums_equals_a_band_mask(window):
    x = torch.rand(2, 3, 9, 9)
    t = torch.arange(9)
    band = (t[:, None] - t[None, :]).abs() <= min(window, 9)
    torch.testing.assert_close(band_row_sums(x, window), (x * band).sum(-1))


def test_visible_keys_reads_additive_and_boolean_masks():
    additive = torch.tensor([[[[0.0, torch.finfo(torch.float32).min], [0.0, 0.0]]]])
    assert visible_keys(additive).tolist() == [[[[True, False], [True, True]]]]
    boolean = torch.tensor([[[[True, False], [True, True]]]])
    assert visible_keys(boolean) is boolean


def test_metric_means_divides_by_the_right_counts():
    sums = np.zeros(len(STAT_INDEX))
    sums[STAT_INDEX["n_rows"]] = 4
    sums[STAT_INDEX["entropy"]] = 2.0
    sums[STAT_INDEX["entropy_sq"]] = 1.5  # rows 0, 0.5, 0.5, 1 -> variance 0.375 - 0.25
    sums[STAT_INDEX["prev_rows"]] = 3
    sums[STAT_INDEX["prev_token"]] = 1.5
    means = metric_means(sums)
    # Sums of powers of two: every step exact in float64, so the means are the expected values exactly.
    assert means["entropy"] == 0.5
    assert means["entropy_std"] == math.sqrt(0.125)
    assert means["prev_token"] == 0.5
    assert np.isnan(means["norm_entropy"])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=4),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    scale=st.floats(min_value=0.0, max_value=20.0),
    window=st.integers(min_value=0, max_value=4),
)
def test_metric_invariants_on_random_attention(lengths, seed, scale, window):
    generator = torch.Generator().manual_seed(seed)
    sentences = []
    for n in lengths:
        logits = scale * torch.randn(2, n, n, generator=generator)
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        sentences.append(logits.softmax(-1))
    sums = measure(sentences, window=window)
    per_sentence = metric_means(sums)
    for row, n in enumerate(lengths):
        entropy, mass = row_statistic(n, math.log(n) + 1), row_statistic(n)
        assert np.all(per_sentence["entropy"][row] >= -entropy)
        assert np.all(per_sentence["entropy"][row] <= math.log(n) + entropy)
        for name in ("diagonal", "diagonal_uniform", "sink", "max_weight"):
            assert np.all((per_sentence[name][row] >= -mass) & (per_sentence[name][row] <= 1 + mass)), name
    left = measure(sentences, window=window, padding_side="left")
    reversed_order = measure(sentences[::-1], window=window)[::-1]
    longest = max(lengths)  # a sentence's sums: up to `longest` rows, each within its bound on either side
    bound = 2 * longest * row_statistic(longest, math.log(longest) + 1)
    np.testing.assert_allclose(left, sums, rtol=0, atol=bound)
    np.testing.assert_allclose(reversed_order, sums, rtol=0, atol=bound)


@pytest.mark.parametrize("block", [1, 3, 4, 7, 16])
def test_row_blocks_add_up_to_the_whole(block):
    generator = torch.Generator().manual_seed(2)
    n = 11
    logits = 4 * torch.randn(2, 3, n, n, generator=generator)
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = logits.softmax(-1)
    batch = collate([0, 1], [[1] * n, [1] * 6], padding_side="left")
    valid = batch.attention_mask.bool()
    visible = causal_visible_keys(valid)
    common = {"seq_start": batch.seq_start, "window": 2}
    whole = head_row_sums(attn, key_visible=visible, query_valid=valid, **common)
    pieces = sum(
        head_row_sums(
            attn[:, :, r : r + block],
            key_visible=visible[:, :, r : r + block],
            query_valid=valid[:, r : r + block],
            row_offset=r,
            **common,
        )
        for r in range(0, n, block)
    )
    # each row's float32 values are the same whichever block holds it; only the order of the float64 sums of n
    # terms differs: within gamma_n in float64 (n u64 of the sum's magnitude, every term >= 0)
    torch.testing.assert_close(pieces, whole, rtol=n * torch.finfo(torch.float64).eps, atol=0)


@pytest.mark.parametrize("window", [2, 11, 10**20])
@pytest.mark.parametrize("row_offset", [0, 3, 8])
def test_band_row_sums_on_a_block_of_rows(row_offset, window):
    x = torch.rand(2, 4, 12)
    rows = torch.arange(row_offset, row_offset + 4)
    band = (rows[:, None] - torch.arange(12)[None, :]).abs() <= min(window, 12)
    torch.testing.assert_close(band_row_sums(x, window, row_offset), (x * band).sum(-1))


def test_a_window_wider_than_the_sentence_costs_no_more_than_the_sentence():
    """A window of 10**20 once looped over 2 * 10**20 + 1 diagonals; it is the same as the sentence's width."""
    import time

    x = torch.rand(1, 2, 16, 16)
    started = time.perf_counter()
    huge = band_row_sums(x, 10**20)
    assert time.perf_counter() - started < 1.0
    torch.testing.assert_close(huge, band_row_sums(x, 15))
    torch.testing.assert_close(huge, x.sum(-1))
