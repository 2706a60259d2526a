"""The C++ kernel's per-row statistics of the eager probabilities (attention.cpu_kernel.weight_rows) against torch's
(headscope.measures.row_sums.weight_row_values), and when a capture takes it (TileKernel.weight_rows)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import headscope
from headscope.measures.row_sums import head_row_sums, head_row_sums_from_values, weight_row_values
from headscope.measures.statistics import heads_side_by_side
from headscope.model.attention import cpu_kernel
from headscope.model.attention.dispatch import TileKernel
from headscope.model.attention.finish_rows import RowValues
from headscope.model.batch import collate
from headscope.model.capture import attached
from headscope.run.feed import tokenize_sentences

from attention_cases import HEADS
from helpers import statistics
from tolerances import row_statistic

T = 40
# Two float32 reductions of the same probabilities, each within row_statistic of float64's
# (tests/support/tolerances.py): a row's values within twice that, a sum over a sentence's rows within T times more.
ROW = 2 * row_statistic(T, math.log(T) + 1)


def probabilities(seq_start, *, seed=0, rows=T, row_offset=0, per_head=False, dtype=torch.float32, ties=False):
    """(batch, HEADS, rows, T) softmax rows of random logits as an eager function leaves them (hidden keys at
    exactly 0), of query positions row_offset.., and their (batch, 1 or HEADS, rows, T) visibility."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(seq_start)
    logits = torch.randn(batch, HEADS, rows, T, generator=generator) * 3
    if ties:  # whole rows of equal logits, and pairs of keys holding the largest one
        logits[:, :, ::3] = 1.0
        logits[:, :, 1::3, 2:4] = 50.0
    position = torch.arange(row_offset, row_offset + rows)[:, None]
    keys = torch.arange(T)
    visible = (keys <= position)[None, None] & (keys >= torch.tensor(seq_start)[:, None, None, None])
    if per_head:  # holes a mask of its own per head leaves (each head still sees the sentence's first key)
        holes = torch.rand(1, HEADS, rows, T, generator=generator) < 0.3
        visible = visible & ~(holes & (keys != torch.tensor(seq_start)[:, None, None, None]))
    weights = torch.softmax(logits.masked_fill(~visible, torch.finfo(torch.float32).min), dim=-1)
    return weights.to(dtype), visible


CASES = {
    "causal": {"seq_start": [0, 0]},
    "left padded": {"seq_start": [0, 5, 12]},
    "a mask per head": {"seq_start": [0, 3], "per_head": True},
    "rows further on": {"seq_start": [0, 3], "rows": 11, "row_offset": 25},
    "ties": {"seq_start": [0, 4], "ties": True},
    "bfloat16": {"seq_start": [0, 4], "dtype": torch.bfloat16},
    "float16": {"seq_start": [2, 0], "dtype": torch.float16},
}


@pytest.mark.parametrize("window", [2, 7])
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_computes_what_torch_computes(kernel_module, case, window):
    """Every value of every row that counts (real, with mass off the sink) equal within float32 rounding; which key
    holds a row's largest weight, and whether several do, exactly."""
    options = dict(CASES[case])
    seq_start = torch.tensor(options.pop("seq_start"))
    row_offset = options.get("row_offset", 0)
    weights, visible = probabilities(seq_start.tolist(), **options)
    got = cpu_kernel.weight_rows(kernel_module, weights, visible, seq_start, window, row_offset)
    want = weight_row_values(weights, key_visible=visible, seq_start=seq_start, window=window, row_offset=row_offset)
    assert got.columns().keys() == want.columns().keys()
    counted = torch.isfinite(want.entropy) & (want.rest_mass > 0)
    assert counted.float().mean() > 0.5
    for name, expected in want.columns().items():
        value, expected, where = torch.broadcast_tensors(got.columns()[name], expected, counted)
        if expected.is_floating_point():
            torch.testing.assert_close(value[where].double(), expected[where].double(), rtol=0, atol=ROW, msg=name)
        else:
            assert torch.equal(value[where], expected[where]), name
    if case == "ties":
        assert want.top_tied[counted].any() and not want.top_tied[counted].all()


def test_the_kernels_rows_sum_to_torchs_sums(kernel_module):
    """Through the sums (every STATS slot, the mass check included): as head_row_sums of the same probabilities."""
    seq_start = torch.tensor([0, 5, 12])
    weights, visible = probabilities(seq_start.tolist(), seed=3)
    weights[1, 2, 20] *= 1.01  # a row whose mass is off 1: counted as unnormalised on both paths
    query_valid = torch.arange(T)[None, :] >= seq_start[:, None]
    values = cpu_kernel.weight_rows(kernel_module, weights, visible, seq_start, 2, 0)
    got = head_row_sums_from_values(values, query_valid=query_valid, seq_start=seq_start, mass_tolerance=1e-3)
    want = head_row_sums(weights, key_visible=visible, query_valid=query_valid, seq_start=seq_start, window=2)
    torch.testing.assert_close(got, want, rtol=0, atol=T * ROW)


def test_layers_summed_side_by_side_equal_each_alone():
    """Two layers with different head counts summed in one call, split back: each layer's sums as if alone."""
    seq_start = torch.tensor([0, 5])
    query_valid = torch.arange(T)[None, :] >= seq_start[:, None]
    parts, alone = [], []
    for seed, heads in ((1, HEADS), (2, 2)):
        weights, visible = probabilities(seq_start.tolist(), seed=seed)
        weights = weights[:, :heads]
        values = weight_row_values(weights, key_visible=visible, seq_start=seq_start, window=2)
        parts.append(values)
        alone.append(head_row_sums_from_values(values, query_valid=query_valid, seq_start=seq_start))
    together = head_row_sums_from_values(heads_side_by_side(parts), query_valid=query_valid, seq_start=seq_start)
    for got, want in zip(together.split([HEADS, 2], dim=1), alone, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def kernel(module, *, built: bool, weights_from: int = 2**31) -> TileKernel:
    return TileKernel(native_loader=lambda: module, native_built=lambda: built, weights_from=weights_from)


def test_probabilities_take_the_kernel_once_built_or_once_it_pays():
    """A kernel built before is taken from the first layer; one not built yet only once the probabilities reduced
    so far reach `weights_from` (then building it has paid for itself); never off the CPU or for float64."""
    weights, visible = probabilities([0, 0])
    seq_start = torch.zeros(2, dtype=torch.long)
    module = SimpleNamespace()
    assert kernel(module, built=True).weight_rows(weights, visible, seq_start) is not None
    waiting = kernel(module, built=False, weights_from=3 * weights.numel())
    assert waiting.weight_rows(weights, visible, seq_start) is None
    assert waiting.weight_rows(weights, visible, seq_start) is None
    assert waiting.weight_rows(weights, visible, seq_start) is not None  # the third layer reaches it
    assert kernel(module, built=True).weight_rows(weights.double(), visible, seq_start) is None
    unbuildable = TileKernel(native_loader=lambda: "OSError: no C++ compiler", native_built=lambda: True)
    assert unbuildable.weight_rows(weights, visible, seq_start) is None
    assert unbuildable.failed_kernels == {"cpu": "OSError: no C++ compiler"}


def reduce_with(tile_kernel: TileKernel, weights, visible, seq_start) -> RowValues:
    def by_torch():
        return weight_row_values(weights, key_visible=visible, seq_start=seq_start, window=2)

    return tile_kernel.weight_rows(weights, visible, seq_start)(2, 0, by_torch)


@pytest.mark.parametrize("fault", ["disagrees", "raises"])
def test_a_kernel_that_disagrees_or_raises_leaves_torch_with_a_warning(kernel_module, fault, caplog):
    """A kernel whose first reduction is off (entropy + 0.01), or that raises, is dropped with one warning; the
    layer's values are torch's, and later layers are offered no kernel."""
    weights, visible = probabilities([0, 5], seed=4)
    seq_start = torch.tensor([0, 5])

    def off(*args):
        if fault == "raises":
            raise RuntimeError("weights must be float32")
        entropy, *rest = kernel_module.weight_rows(*args)
        return (entropy + 0.01, *rest)

    faulty = kernel(SimpleNamespace(weight_rows=off), built=True)
    with caplog.at_level("WARNING", logger="headscope.model.attention.dispatch"):
        values = reduce_with(faulty, weights, visible, seq_start)
    want = weight_row_values(weights, key_visible=visible, seq_start=seq_start, window=2)
    assert torch.equal(values.entropy, want.entropy)
    why = "its first result disagreed with torch's" if fault == "disagrees" else "failed (RuntimeError: weights must"
    assert faulty.weights_failed.startswith(why) and why in caplog.text
    assert faulty.weight_runs == 0 and faulty.weight_rows(weights, visible, seq_start) is None
    good = kernel(kernel_module, built=True)
    reduce_with(good, weights, visible, seq_start)
    reduce_with(good, weights, visible, seq_start)
    assert good.weight_runs == 2 and good.weights_failed is None


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_capture_with_the_kernel_sums_what_torch_sums(planted_gpt2, corpus_lines, kernel_module, padding_side):
    """A padded batch of the planted GPT-2 (hand-set heads: sinks, previous-token, ties) through the eager path: the
    sums with the kernel reducing every layer equal torch's, and run.json's path says which reduced them."""
    loaded = headscope.load_model(str(planted_gpt2), device="cpu")
    ids, _ = tokenize_sentences(loaded.tokenizer, corpus_lines[:6], None)
    batch = collate(list(range(len(ids))), ids, padding_side=padding_side)
    sums, paths = {}, {}
    for name, built in (("kernel", True), ("torch", False)):
        measure = statistics()
        with attached(loaded.model, kernel=kernel(kernel_module, built=built)) as capture:
            capture.run(batch, measures=[measure])
            paths[name] = set(capture.paths.values())
        sums[name] = measure.finish()
    kernel_path = "eager (the model's own attention function and its row statistics from headscope's C++ kernel)"
    assert paths == {"kernel": {kernel_path}, "torch": {"eager (the model's own attention function)"}}
    torch.testing.assert_close(sums["kernel"], sums["torch"], rtol=0, atol=T * ROW)  # sentences shorter than T
