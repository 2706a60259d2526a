"""The fused pass (attention.tile_loop) against probabilities computed in full, in float64, on hand-built tensors."""

from __future__ import annotations

import math

import pytest
import torch

from headscope.model.attention.dispatch import TileKernel
from headscope.model.attention.tile_loop import _tile_step, tile_shape

from attention_cases import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    T,
    assert_within,
    bounds,
    fused,
    hand_built,
    masks,
    reference,
)
from tolerances import entropy_error, logit_error, row_statistic


def _masked_logits(query, key, visible):
    """(batch, heads, t, t) float64 logits with the invisible keys at -inf."""
    k = key.double().repeat_interleave(HEADS // KV_HEADS, 1)
    scores = query.double() @ k.transpose(-1, -2) * HEAD_DIM**-0.5
    return scores.masked_fill(~visible[:, None], -math.inf)


def assert_same_tiling(got, want, bound, real):
    """Two float32 fused passes of the same inputs, (output, values): each within its bound of the exact numbers
    (attention_cases.bounds), so within twice that of each other; whole numbers (counts, keys, ties) equal."""
    assert_within(got[0], want[0], 2 * bound["output"], real[..., None, None], "output")
    for name, value in got[1].columns().items():
        expected = getattr(want[1], name)
        if value.is_floating_point():
            assert_within(value, expected, 2 * bound[name], real[:, None], name)
        else:
            where = real[:, None].expand(value.shape)
            assert torch.equal(value[where], expected.expand(value.shape)[where]), name


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
def test_fused_rows_equal_the_full_probabilities(mask_name, softcap):
    """Tiles of 5 rows x 7 keys (several per row, the diagonal one first) give every statistic and the output."""
    query, key, value = hand_built()
    mask, visible, seq_start = masks()[mask_name]
    output, values = fused(query, key, value, mask, seq_start, softcap)
    expected = reference(query, key, value, visible, seq_start, softcap)
    bound = bounds(query, key, value, visible, seq_start, softcap)  # float32's, for these inputs
    real = visible.any(-1)  # (batch, t): padding rows see nothing, and may hold anything
    assert_within(output, expected["output"], bound["output"], real[..., None, None], "output")
    assert torch.isfinite(output).all()  # but never NaN: the next layer reads them (its values at padding keys)
    names = ("entropy", "max_weight", "diagonal", "sink", "prev_token", "n_visible", "band_visible", "rest_mass")
    for name in (*names, "logit_std"):
        assert_within(getattr(values, name), expected[name], bound[name], real[:, None], name)
    assert not values.top_tied.transpose(1, 2)[real].any()  # random logits: one largest key per row
    assert torch.equal(values.top_key.transpose(1, 2)[real], expected["top_key"].transpose(1, 2)[real])
    off_sink = (expected["rest_mass"] > 0) & real[:, None]  # rows that see a key but the first
    assert_within(values.rest_entropy, expected["rest_entropy"], bound["rest_entropy"], off_sink, "rest_entropy")
    assert torch.equal(values.rest_top_key[off_sink], expected["rest_top_key"][off_sink])
    assert not values.rest_top_tied[off_sink].any()


def test_tiles_and_blocks_do_not_change_the_numbers():
    query, key, value = hand_built(seed=1)
    mask, visible, seq_start = masks()["left padded"]
    real = visible.any(-1)  # padding rows may hold anything
    one = fused(query, key, value, mask, seq_start, block_rows=T, tile_keys=T)
    many = fused(query, key, value, mask, seq_start, block_rows=3, tile_keys=2)
    assert_same_tiling(many, one, bounds(query, key, value, visible, seq_start), real)


def test_tied_rows_are_uniform_and_marked_tied():
    """A zero query gives every visible key the same logit: entropy ln(n), max weight 1/n, several top keys."""
    _, key, value = hand_built()
    query = torch.zeros(2, HEADS, T, HEAD_DIM)
    mask, visible, seq_start = masks()["sliding window"]
    _, values = fused(query, key, value, mask, seq_start)
    seen = visible.sum(-1)[:, None].expand(-1, HEADS, -1).double()  # (batch, heads, t)
    # Every logit exactly 0: only the float32 sums over the row's keys round (tests/support/tolerances.py).
    n = int(seen.max())
    torch.testing.assert_close(values.entropy.double(), seen.log(), rtol=0, atol=row_statistic(n, math.log(n) + 1))
    torch.testing.assert_close(values.max_weight.double(), 1 / seen, rtol=0, atol=row_statistic(n))
    assert torch.equal(values.top_tied, seen > 1)


def test_huge_logits_neither_overflow_nor_lose_the_entropy():
    """Logits in the hundreds (a saturated head): one key holds nearly everything, entropy near 0, all finite."""
    query, key, value = hand_built(logit_scale=300.0)
    mask, visible, seq_start = masks()["causal"]
    output, values = fused(query, key, value, mask, seq_start)
    expected = reference(query, key, value, visible, seq_start)
    assert torch.isfinite(values.entropy).all() and torch.isfinite(output).all()
    # Logits of some 300 carry float32 rounding of ~2e-5 (tests/support/tolerances.py bounds each): a bound, not what
    # one BLAS gave (1e-5 held on AVX2 and failed under MKL's AVX-512 sgemm by 1.1e-5).
    probs = torch.softmax(_masked_logits(query, key, visible), -1)
    bound = entropy_error(probs, logit_error(query, key, HEAD_DIM**-0.5))
    error = (values.entropy.double() - expected["entropy"]).abs()
    assert (error <= bound).all(), f"{(error - bound).max():.3g} over the bound"
    assert bound.max() < 1e-3  # the bound is tight enough to mean something


def test_selected_rows_equal_the_same_rows_of_the_whole():
    """The first-call check runs the pass on a few spread rows only."""
    query, key, value = hand_built(seed=2)
    mask, visible, seq_start = masks()["left padded"]
    _, whole = fused(query, key, value, mask, seq_start)
    positions = torch.tensor([0, 4, 5, 11, 22])
    _, some = fused(query, key, value, mask, seq_start, positions=positions)
    real = visible.any(-1)[:, positions]  # (batch, 5): sentence 1's rows 0 and 4 are padding
    bound = bounds(query, key, value, visible, seq_start)
    for name, got in some.columns().items():
        want = getattr(whole, name)[..., positions]
        if not got.is_floating_point():
            assert torch.equal(*torch.broadcast_tensors(got, want)), name
            continue
        assert_within(got, want, 2 * bound[name][..., positions], real[:, None], name)


@pytest.mark.slow  # torch.compile
def test_compiled_steps_equal_the_op_by_op_steps():
    """What long sequences run (torch.compile of the tile step) is the same maths as the op-by-op step."""
    query, key, value = hand_built(seed=3)
    mask, visible, seq_start = masks()["left padded"]
    real = visible.any(-1)
    kernel = TileKernel(compile_from=0)
    compiled = fused(query, key, value, mask, seq_start, step=kernel.step(1))
    plain = fused(query, key, value, mask, seq_start)
    assert kernel.failed is None
    assert_same_tiling(compiled, plain, bounds(query, key, value, visible, seq_start), real)


def test_a_capture_compiles_once_it_has_folded_enough_logits():
    kernel = TileKernel(compile_from=1000)
    assert kernel.step(600) is _tile_step
    assert kernel.step(399) is _tile_step
    assert kernel.step(1) is not _tile_step  # 1,000 in all
    assert kernel.step(0) is not _tile_step


def test_tiles_fit_the_block_budget():
    assert tile_shape(1, 9, 32 * 2**20) == (128, 1024)
    for batch, heads, budget in [(16, 12, 32 * 2**20), (7, 3, 4096), (1, 64, 2**20)]:
        rows, keys = tile_shape(batch, heads, budget)
        assert rows >= 1 and keys >= 1
        assert 4 * batch * heads * rows * keys <= max(budget, 4 * batch * heads)
