"""The C++ kernel's sums over rows (attention.cpu_kernel.row_sums and write_sums) against torch's operations
(headscope.measures.row_sums.side_by_side_sums, headscope.measures.writes), on hand-built rows that hold every case a
sum must get right, and when a capture takes them (TileKernel.sums)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import headscope
from headscope.columns import MAX_OFFSET, STAT_INDEX
from headscope.measures.row_sums import COUNT_NAMES, SIDE_BY_SIDE, VALUE_NAMES, head_row_sums_from_values, value_rows
from headscope.measures.writes import head_write_sums, sink_value_ratios
from headscope.model.attention import cpu_kernel
from headscope.model.attention.dispatch import TileKernel
from headscope.model.attention.finish_rows import RowValues
from headscope.model.batch import collate
from headscope.model.capture import attached
from headscope.run.feed import tokenize_sentences

from helpers import statistics
from tolerances import row_statistic

BATCH, HEADS, ROWS = 3, 4, 17
# The kernel and torch differ where they round a row's float32 division or logarithm apart (an ulp each, so at most
# 2 ulp of a row's value), and in the order of float64 additions (ROWS x float64's unit roundoff): every value
# summed is >= 0, so a sum differs by at most the same share of itself.
SUMS = 2 * torch.finfo(torch.float32).eps + ROWS * torch.finfo(torch.float64).eps


def hostile_rows(seed: int = 0, *, per_head_counts: bool = False, with_mass: bool = True):
    """RowValues of a block of rows 5.. of three sentences (the second starting at 2, the third at 9), holding: rows
    that hold NaN and inf, padding rows holding NaN (they must add exactly 0), ties, rows whose largest weight sits on
    the first key or further back than MAX_OFFSET, rows with no mass off the sink, an unnormalised row; with the
    counts each row sees per sentence or per head."""
    generator = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, ROWS)
    row_offset = 5
    seq_start = torch.tensor([0, 2, 9])
    position = torch.arange(row_offset, row_offset + ROWS)

    def uniform(low=0.0, high=1.0):
        return low + (high - low) * torch.rand(shape, generator=generator)

    counts_shape = (1, HEADS, ROWS) if per_head_counts else (BATCH, 1, ROWS)
    n_visible = (position - seq_start[:, None] + 1).clamp(min=0)[:, None, :].expand(BATCH, 1, ROWS)
    n_visible = n_visible[:1].expand(counts_shape) if per_head_counts else n_visible
    n_visible = (n_visible - torch.randint(0, 2, counts_shape, generator=generator)).clamp(min=0).contiguous()
    entropy = uniform(0, 3)
    entropy[0, 1, 3], entropy[1, 2, 7] = float("nan"), float("inf")
    mass = torch.ones(shape)
    mass[2, 0, 12] = 1.05  # off 1 by more than the tolerance
    top_key = position - torch.randint(-1, MAX_OFFSET + 4, shape, generator=generator)
    top_key[:, :, ::4] = seq_start[:, None, None]  # on the first key
    rest_top_key = position - torch.randint(0, MAX_OFFSET + 3, shape, generator=generator)
    rest_mass = uniform().double()
    rest_mass[:, 3, ::3] = 0.0  # nothing off the sink
    values = RowValues(
        entropy=entropy,
        max_weight=uniform(),
        top_key=top_key,
        top_tied=torch.rand(shape, generator=generator) < 0.2,
        diagonal=uniform(),
        sink=uniform(),
        prev_token=uniform(),
        n_visible=n_visible,
        band_visible=torch.minimum(n_visible, torch.full(counts_shape, 5)).float(),
        first_visible=torch.rand((BATCH, 1, ROWS), generator=generator) < 0.9,
        rest_mass=rest_mass,
        rest_entropy=uniform(0, 2).double(),
        rest_top_key=rest_top_key,
        rest_top_tied=torch.rand(shape, generator=generator) < 0.2,
        logit_std=uniform(0, 4),
        mass=mass if with_mass else None,
    )
    query_valid = (position[None, :] >= seq_start[:, None]) & (torch.rand(BATCH, ROWS, generator=generator) < 0.9)
    query_valid[0, 3] = query_valid[1, 7] = query_valid[2, 12] = True  # the non-finite rows and the unnormalised one
    values.entropy[~query_valid[:, None, :].expand(shape)] = float("nan")  # padding rows may hold anything
    return values, query_valid, seq_start, row_offset


def by_torch(values, query_valid, seq_start, row_offset, tolerance=1e-3):
    return head_row_sums_from_values(
        values, query_valid=query_valid, seq_start=seq_start, row_offset=row_offset, mass_tolerance=tolerance
    )


def by_kernel(module, values, query_valid, seq_start, row_offset, tolerance=1e-3):
    def kernel(*inputs, reference, **settings):
        return cpu_kernel.row_sums(module, *inputs, **settings)

    return head_row_sums_from_values(
        values,
        query_valid=query_valid,
        seq_start=seq_start,
        row_offset=row_offset,
        mass_tolerance=tolerance,
        kernel=kernel,
    )


@pytest.mark.parametrize("per_head_counts", [False, True])
@pytest.mark.parametrize("with_mass", [True, False])
def test_the_kernels_row_sums_equal_torchs_on_hostile_rows(kernel_module, per_head_counts, with_mass):
    """Every slot of STATS: the value sums within SUMS of themselves, every count (rows, offsets, categories)
    exactly; the hostile rows are there (NaN rows counted as non-finite, padding adding nothing)."""
    block = hostile_rows(per_head_counts=per_head_counts, with_mass=with_mass)
    got, want = by_kernel(kernel_module, *block), by_torch(*block)
    assert got.dtype == want.dtype == torch.float64 and got.shape == want.shape
    assert torch.isfinite(want).all()  # NaN rows and padding rows left out, on both sides
    torch.testing.assert_close(got, want, rtol=SUMS, atol=0)
    counts = [STAT_INDEX[name] for name in SIDE_BY_SIDE if name not in VALUE_NAMES and name in STAT_INDEX]
    assert torch.equal(got[..., counts], want[..., counts])
    assert want[..., STAT_INDEX["nonfinite_rows"]].sum() == 2
    assert want[..., STAT_INDEX["unnormalised_rows"]].sum() == (1 if with_mass else 0)
    for name in ("top_first", "top_other", f"top_{MAX_OFFSET}", "offsink_top_other", "offsink_norm_rows"):
        assert want[..., STAT_INDEX[name]].sum() > 0, name  # the block reaches every kind of slot


def test_a_sum_is_where_its_denominator_counts():
    """value_rows pairs each summed value with its denominator's rows (columns.RATIOS): sinks over every valid row,
    the off-sink previous token over rows past the second."""
    assert COUNT_NAMES[value_rows()[VALUE_NAMES.index("sink")]] == "n_rows"
    assert COUNT_NAMES[value_rows()[VALUE_NAMES.index("offsink_prev_token")]] == "offsink_prev_rows"
    assert COUNT_NAMES[value_rows()[VALUE_NAMES.index("entropy_sq")]] == "n_rows"


def written_rows(seed: int = 0, *, heads: int = 6, kv_heads: int = 2, t: int = 15):
    """What a layer's heads write, for write_sums: norms, the residual stream's norms, the values, and the real rows
    of three sentences (the second left-padded from 4, the third right-padded after 10), holding a NaN write norm in
    a padding row and in a real one, and a real row whose residual stream is 0 (no ratio)."""
    generator = torch.Generator().manual_seed(seed)
    norms = torch.rand(3, heads, t, generator=generator) * 5
    residual = torch.rand(3, t, generator=generator) + 0.5
    value = torch.randn(3, kv_heads, t, 4, generator=generator)
    positions = torch.arange(t)
    seq_start = torch.tensor([0, 4, 0])
    query_valid = (positions[None, :] >= seq_start[:, None]) & ~((positions >= 11) & (torch.arange(3) == 2)[:, None])
    norms[1, 2, 1] = norms[0, 3, 6] = float("nan")  # a padding row (left of sentence 1's start) and a real one
    residual[2, 5] = 0.0
    return norms, residual, value, query_valid, seq_start


def sliding(query_valid: torch.Tensor, window: int):
    """(batch, 1, t, t) visibility: causal over the real keys, within `window` positions back."""
    t = query_valid.shape[-1]
    positions = torch.arange(t)
    near = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    return near[None, None] & query_valid[:, None, None, :]


@pytest.mark.parametrize("visibility", ["causal", "sliding window"])
def test_the_kernels_write_sums_equal_torchs(kernel_module, visibility):
    """write_norm, write_ratio and sink_value_ratio sums with their row counts (query heads sharing KV heads), within
    float32's rounding of each row's ratio; the NaN rows and the zero residual stream left out on both sides."""
    norms, residual, value, query_valid, seq_start = written_rows()
    heads = norms.shape[1]
    visible = None if visibility == "causal" else sliding(query_valid, 4)
    masked = None if visible is None else (lambda rows: visible[:, :, rows])
    ratio, defined = sink_value_ratios(value, query_valid, seq_start, heads, masked)
    want = head_write_sums(norms, residual, ratio, defined, query_valid, torch.float64)
    value_norms = torch.linalg.vector_norm(value, dim=-1)
    got = cpu_kernel.write_sums(kernel_module, norms, residual, value_norms, query_valid, seq_start, visible)
    torch.testing.assert_close(got, want, rtol=SUMS, atol=0)
    assert torch.equal(got[..., 1::2], want[..., 1::2])  # the counts
    real = int(query_valid.sum())
    assert got[..., 1].sum() == real * heads - 1  # every real row but the NaN one
    assert got[..., 3].sum() == real * heads - 1 - heads  # ... and the row with nothing in its residual stream
    if visibility == "sliding window":  # rows past the window see no first key: no sink value ratio
        assert got[0, 0, 5] < got[0, 0, 1]


def fake_kernel(row_sums) -> TileKernel:
    return TileKernel(native_loader=lambda: SimpleNamespace(row_sums=row_sums), native_built=lambda: True)


@pytest.mark.parametrize("fault", ["disagrees", "raises"])
def test_a_kernel_whose_sums_disagree_or_raise_leaves_torch_with_a_warning(kernel_module, fault, caplog):
    """A kernel whose first sums are off (+1 on every slot), or that raises, is dropped with one warning; the
    block's sums are torch's, and no later block is offered the kernel's sums."""
    block = hostile_rows(seed=2)

    def off(*args):
        if fault == "raises":
            raise RuntimeError("a (batch or 1, heads or 1, rows) row value")
        return kernel_module.row_sums(*args) + 1.0

    faulty = fake_kernel(off)
    with caplog.at_level("WARNING", logger="headscope.model.attention.dispatch"):
        sums = head_row_sums_from_values(
            block[0], query_valid=block[1], seq_start=block[2], row_offset=block[3], mass_tolerance=1e-3,
            kernel=faulty.sums("row_sums"),
        )  # fmt: skip
    assert torch.equal(sums, by_torch(*block))
    why = "its first row_sums disagreed with torch's" if fault == "disagrees" else "failed (RuntimeError: a (batch"
    assert faulty.sums_failed.startswith(why) and why in caplog.text
    assert faulty.sums("row_sums") is None and faulty.sums("write_sums") is None
    good = fake_kernel(kernel_module.row_sums)
    for _ in range(2):
        sums = head_row_sums_from_values(
            block[0], query_valid=block[1], seq_start=block[2], row_offset=block[3], mass_tolerance=1e-3,
            kernel=good.sums("row_sums"),
        )  # fmt: skip
    assert good.sums_failed is None and good.sums("row_sums") is not None


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_capture_sums_each_eager_layer_with_the_kernel(planted_gpt2, corpus_lines, kernel_module, padding_side):
    """A padded batch of the planted GPT-2 through the eager path with the kernel: each layer's rows and what its
    heads wrote are summed by the kernel (once per layer each), and the sums equal torch's."""
    loaded = headscope.load_model(str(planted_gpt2), device="cpu")
    ids, _ = tokenize_sentences(loaded.tokenizer, corpus_lines[:6], None)
    batch = collate(list(range(len(ids))), ids, padding_side=padding_side)
    calls = {"row_sums": 0, "write_sums": 0}

    def counted(name):
        def call(*args):
            calls[name] += 1
            return getattr(kernel_module, name)(*args)

        return call

    recording = SimpleNamespace(weight_rows=kernel_module.weight_rows, **{name: counted(name) for name in calls})
    sums = {}
    for name, module in (("kernel", recording), ("torch", "no kernel here")):
        measure = statistics()
        with attached(
            loaded.model, kernel=TileKernel(native_loader=lambda m=module: m, native_built=lambda: True)
        ) as c:
            c.run(batch, measures=[measure])
        sums[name] = measure.finish()
    layers = loaded.architecture["layers"]
    assert calls == {"row_sums": layers, "write_sums": layers}
    # The kernel's and torch's per-row values of the same probabilities, each within row_statistic of float64's
    # (tests/support/tolerances.py), summed over a sentence's rows; the sums' own rounding within SUMS of themselves.
    t = max(len(row) for row in ids)
    torch.testing.assert_close(sums["kernel"], sums["torch"], rtol=SUMS, atol=t * 2 * row_statistic(t, math.log(t) + 1))
