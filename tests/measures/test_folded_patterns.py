"""The exemplars' and detectors' patterns read inside the fused pass (headscope.model.attention.key_patterns): each
family's classes are exactly its targets; what the C++ kernel folds of them equals float64 probabilities within
float32's bound; and every path (the eager probabilities, blocks of recomputed logits, the kernel's fold) gives the
same detector sums and exemplars."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import headscope
from headscope.detector_specs import detector_of
from headscope.measures.detectors import kept_classes, target_classes, targets
from headscope.measures.exemplars import PROBE_KINDS, TopRows, exemplar_frame
from headscope.measures.pattern_scores import PatternScores
from headscope.model.attention.dispatch import TileKernel
from headscope.model.attention.key_patterns import NO_REACH, KeyPatterns
from headscope.model.batch import collate
from headscope.model.capture import attached
from headscope.run.feed import tokenize_sentences

from attention_cases import HEAD_DIM, HEADS, KV_HEADS, bounds, fused, hand_built, masks
from helpers import assert_same_exemplars

SPECS = {"prev": "offset:1", "three": "offset:3", "dup": "same-token", "ind": "after-same-token",
         "even": "token:[02468]$", "start": "first", "far": "far:2,3"}  # fmt: skip
DETECTORS = [detector_of(name, spec) for name, spec in SPECS.items()]


def token_text(token_id: int) -> str:
    return str(token_id)


def patterns_of(ids: torch.Tensor, real: torch.Tensor, seq_start: torch.Tensor) -> KeyPatterns:
    """Every family's pattern, then far's two runs of kept keys (kept_classes: with a reach)."""
    classes = [(*target_classes(detector, ids, real, seq_start, token_text), NO_REACH) for detector in DETECTORS]
    classes += kept_classes(DETECTORS[list(SPECS).index("far")], ids, real, seq_start)
    key_class, row_class, lag, reach = zip(*classes, strict=True)
    return KeyPatterns.of(torch.stack(key_class), torch.stack(row_class), torch.tensor(lag), seq_start,
                          reach=torch.tensor(reach))  # fmt: skip


def test_each_familys_classes_are_exactly_its_targets():
    """On a batch with left and right padding and many repeated tokens: the targets the classes say, each row's run
    of sorted keys, and whether the first key is a target, all equal `targets`' (the eager path's) matrices."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (3, 14), generator=generator)
    real = torch.ones(3, 14, dtype=torch.bool)
    real[1, :4] = False  # left padding: the sentence starts at 4
    real[2, 10:] = False  # right padding
    seq_start = torch.tensor([0, 4, 0])
    patterns = patterns_of(ids, real, seq_start)
    every = patterns.targets(slice(None), 14)  # (detectors, batch, rows, keys)
    for i, detector in enumerate(DETECTORS):
        expected = targets(detector, ids, real, seq_start, slice(0, 14), 14, token_text) > 0
        assert torch.equal(every[i], expected), detector.spec
        assert torch.equal(patterns.first_target[i], expected[torch.arange(3), :, seq_start]), detector.spec
        for b in range(3):
            for row in range(14):
                run = patterns.sorted_keys[i, b, patterns.run_begin[i, b, row] : patterns.run_end[i, b, row]]
                assert run.tolist() == expected[b, row].nonzero().flatten().tolist(), (detector.spec, b, row)
    assert every.sum() > 100  # repeated tokens: every family has targets to find


@pytest.mark.parametrize(("sink", "window"), [(2, 3), (0, 1), (4, 6)])
def test_far_and_the_keys_it_leaves_out_are_every_key_of_its_rows(sink, window):
    """kept_classes: on far:S,W's rows, its two runs (the first S keys; the last W up to the row, a reach of W - 1)
    and far's own targets are disjoint and together every key of the sentence up to the row; each run, and whether
    the first key is a target, is exactly what the classes and the reach say. Left and right padding."""
    ids = torch.randint(0, 5, (3, 14), generator=torch.Generator().manual_seed(4))
    real = torch.ones(3, 14, dtype=torch.bool)
    real[1, :4] = False
    real[2, 10:] = False
    seq_start = torch.tensor([0, 4, 0])
    far = detector_of("far", f"far:{sink},{window}")
    key_class, row_class, lag, reach = zip(*kept_classes(far, ids, real, seq_start), strict=True)
    kept = KeyPatterns.of(torch.stack(key_class), torch.stack(row_class), torch.tensor(lag), seq_start,
                          reach=torch.tensor(reach))  # fmt: skip
    first, recent = kept.targets(slice(None), 14)
    far_targets = targets(far, ids, real, seq_start, slice(0, 14), 14, token_text) > 0
    position = torch.arange(14)
    rows = real & (position >= seq_start[:, None] + sink + window)  # (batch, rows)
    sentence = real[:, None, :] & real[:, :, None] & (position[None, None, :] <= position[None, :, None])
    assert not (first & recent).any() and not ((first | recent) & far_targets).any()
    assert torch.equal((first | recent | far_targets) & rows[..., None], sentence & rows[..., None])
    assert not (first | recent)[~rows].any()  # rows without far keys have no kept keys either
    assert torch.equal(recent.sum(-1)[rows], torch.full_like(recent.sum(-1)[rows], window))
    for i, part in enumerate((first, recent)):
        assert torch.equal(kept.first_target[i], part[torch.arange(3), :, seq_start])
        for b in range(3):
            for row in range(14):
                run = kept.sorted_keys[i, b, kept.run_begin[i, b, row] : kept.run_end[i, b, row]]
                assert run.tolist() == part[b, row].nonzero().flatten().tolist(), (i, b, row)


def float64_readings(query, key, visible, patterns: KeyPatterns, softcap):
    """match, targets, the best target's float64 probability, and each row's targets' probabilities, from the whole
    float64 probabilities: (detectors, batch, heads, rows[, keys])."""
    scores = query.double() @ key.double().repeat_interleave(HEADS // KV_HEADS, 1).transpose(-1, -2) * HEAD_DIM**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~visible[:, None], -math.inf), -1).nan_to_num()
    hits = patterns.targets(slice(None), query.shape[2])[:, :, None] & visible[None, :, None]
    on_targets = torch.where(hits, probs[None], 0.0)
    return on_targets.sum(-1), hits.sum(-1).expand(-1, -1, HEADS, -1), on_targets.amax(-1), on_targets


@pytest.mark.slow
@pytest.mark.parametrize("with_values", [True, False])  # the output folded in the same pass, or the statistics alone
@pytest.mark.parametrize("softcap", [None, 10.0])
@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
def test_the_kernels_readings_equal_float64_probabilities(kernel_module, mask_name, softcap, with_values):
    """Over 700 keys (two of the kernel's key blocks, many row blocks): each row's attention on its targets, how many
    it sees, the target it attends to most and that weight, each within float32's bound of float64 probabilities
    (attention_cases.bounds: any sum of a row's probabilities); the key exactly, or one the row weighs as much within
    that bound (a tie)."""
    t = 700
    query, key, value = hand_built(seed=5, t=t)
    mask, visible, seq_start = masks(t=t, window=300)[mask_name]
    real = visible.any(-1)
    ids = torch.randint(0, 40, (2, t), generator=torch.Generator().manual_seed(1))
    patterns = patterns_of(ids, real, seq_start)
    kernel = TileKernel(compile_from=0, native_loader=lambda: kernel_module, native_from=0)
    _, _, read = fused(query, key, value if with_values else None, mask, seq_start, softcap,
                       row_state=kernel.row_state(query, mask), patterns=patterns)  # fmt: skip
    assert not kernel.failed_kernels and read is not None
    match, count, best, on_targets = float64_readings(query, key, visible, patterns, softcap)
    bound = bounds(query, key, value, visible, seq_start, softcap)["max_weight"][None]
    rows = real[None, :, None].expand_as(match)
    assert torch.equal(read.targets[rows], count[rows])
    assert ((read.match.double() - match).abs() <= bound)[rows].all()
    found = rows & (count > 0)
    assert ((read.weight.double() - best).abs() <= bound)[found].all()
    at_key = on_targets.gather(-1, read.key.clamp(min=0)[..., None])[..., 0]  # float64's weight at the key chosen
    assert ((at_key - best).abs() <= 2 * bound)[found].all()
    assert (read.key[rows & (count == 0)] == -1).all()
    assert (read.key == on_targets.argmax(-1))[found].float().mean() > 0.99  # ties are rare on random logits


@pytest.fixture(scope="module")
def planted(planted_gpt2):
    return headscope.load_model(str(planted_gpt2), device="cpu")


def every_third(tokens: list[str]) -> np.ndarray:
    """A callable detector's pattern (read block by block on every path): keys 0, 3, 6, ... weighed 1."""
    n = len(tokens)
    pattern = np.zeros((n, n))
    pattern[:, ::3] = 1.0
    return pattern


# far:2,3 again, scored but no exemplar kind: read from the keys it leaves out (PatternScores._complemented), as
# far_mass is
FAR_UNREAD = detector_of("far_unread", SPECS["far"])


def read_patterns(model, batch, layers, block_bytes: int, kernel: TileKernel | None):
    detectors = [*DETECTORS, detector_of("third", every_third), FAR_UNREAD]
    probes = [detector_of(kind, spec) for kind, spec in PROBE_KINDS.items()]
    kinds = [detector.name for detector in [*detectors, *probes] if detector is not FAR_UNREAD]
    top = TopRows(6, kinds, layers, model.config.n_head)
    measure = PatternScores([*detectors, *probes], layers, token_text=str, token_strings=list, exemplars=top,
                            scored=len(detectors))  # fmt: skip
    with attached(model, block_bytes=block_bytes, kernel=kernel) as capture:
        capture.run(batch, measures=[measure])
    sums, chance = measure.finish()
    return sums, chance, exemplar_frame(top.state, kinds, layers)


@pytest.mark.slow
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_every_path_gives_the_same_detector_sums_and_exemplars(planted, corpus_lines, kernel_module, padding_side):
    """A padded batch of the planted GPT-2, read four ways: the model's eager probabilities, by torch and by the C++
    kernel's look-ups (`pattern_rows`); the fused path with its logits recomputed block by block (no kernel); and the
    fused path whose C++ kernel folds the built-in families in its pass (only the callable read block by block). The
    detector sums and chance levels agree within float32 rounding, and so do the exemplars (as across batchings:
    tests/support/helpers.py)."""
    ids, _ = tokenize_sentences(planted.tokenizer, corpus_lines[:8], None)
    batch = collate(list(range(len(ids))), ids, padding_side=padding_side)
    layers = list(range(planted.architecture["layers"]))
    folded, looked_up = [], []

    def recording(*args, **kwargs):
        folded.append("pattern_keys" in kwargs)
        return kernel_module.row_state(*args, **kwargs)

    def looking_up(*args):
        looked_up.append(args[2].shape[0])  # the patterns read
        return kernel_module.pattern_rows(*args)

    module = SimpleNamespace(row_state=recording, folds_patterns=True)
    eager = SimpleNamespace(weight_rows=kernel_module.weight_rows, row_sums=kernel_module.row_sums,
                            write_sums=kernel_module.write_sums, pattern_rows=looking_up)  # fmt: skip
    paths = {
        "eager": (2**30, TileKernel(native_loader=lambda: "no kernel here")),
        "eager, kernel": (2**30, TileKernel(native_loader=lambda: eager, native_built=lambda: True)),
        "blocks": (4096, TileKernel(native_loader=lambda: "no kernel here")),
        "kernel": (4096, TileKernel(compile_from=0, native_loader=lambda: module, native_from=0)),
    }
    read = {name: read_patterns(planted.model, batch, layers, *options) for name, options in paths.items()}
    assert folded and all(folded)  # the kernel ran on every layer, folding the patterns
    # and looked them up on every eager layer: FAR_UNREAD as its two runs of kept keys
    assert looked_up == [len(DETECTORS) + 2 + len(PROBE_KINDS)] * len(layers)
    sums, chance, exemplars = read["eager"]
    # far:2,3 read from its own run and from the keys it leaves out: the same sums, rows and chance
    far, unread = list(SPECS).index("far"), len(DETECTORS) + 1
    assert sums[..., unread, 1].sum() > 0
    torch.testing.assert_close(sums[..., unread, :], sums[..., far, :], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chance[:, unread], chance[:, far], rtol=1e-6, atol=1e-9)
    for name in ("eager, kernel", "blocks", "kernel"):
        other_sums, other_chance, other_exemplars = read[name]
        torch.testing.assert_close(other_sums, sums, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(other_chance, chance, rtol=1e-6, atol=1e-9)
        assert_same_exemplars(exemplars, other_exemplars)


@pytest.mark.slow
def test_a_kernel_whose_readings_disagree_is_dropped_and_the_blocks_read_them(planted, corpus_lines, kernel_module,
                                                                             caplog):  # fmt: skip
    """The first readings a kernel folds are checked against torch's on its last rows: a kernel that misreads them
    is dropped with one warning, and the layer's patterns come from blocks, the same numbers."""
    ids, _ = tokenize_sentences(planted.tokenizer, corpus_lines[:4], None)
    batch = collate(list(range(len(ids))), ids)
    layers = list(range(planted.architecture["layers"]))

    def misreading(*args, **kwargs):
        result = kernel_module.row_state(*args, **kwargs)
        result[-4] = result[-4] * 1.01  # every row's attention on its targets, 1% off
        return result

    module = SimpleNamespace(row_state=misreading, folds_patterns=True)
    kernel = TileKernel(compile_from=0, native_loader=lambda: module, native_from=0)
    dropped = read_patterns(planted.model, batch, layers, 4096, kernel)
    assert "disagreed with torch's" in kernel.failed_kernels["cpu"]
    assert "exemplars' patterns disagreed" in caplog.text
    eager = read_patterns(planted.model, batch, layers, 2**30, None)
    torch.testing.assert_close(dropped[0], eager[0], rtol=1e-5, atol=1e-6)
    assert_same_exemplars(eager[2], dropped[2])


@pytest.mark.slow
def test_a_kernel_whose_look_ups_disagree_is_dropped_and_torch_reads_them(planted, corpus_lines, kernel_module, caplog):
    """The kernel's first readings of the eager probabilities are checked against torch's: one that misreads them is
    dropped with one warning, and torch reads that layer and the rest, the same numbers."""
    ids, _ = tokenize_sentences(planted.tokenizer, corpus_lines[:4], None)
    batch = collate(list(range(len(ids))), ids)
    layers = list(range(planted.architecture["layers"]))

    def misreading(*args):
        match, count, key, weight = kernel_module.pattern_rows(*args)
        return match, count, torch.where(key >= 0, key + 1, key), weight  # every key one off

    module = SimpleNamespace(weight_rows=kernel_module.weight_rows, row_sums=kernel_module.row_sums,
                             write_sums=kernel_module.write_sums, pattern_rows=misreading)  # fmt: skip
    kernel = TileKernel(native_loader=lambda: module, native_built=lambda: True)
    dropped = read_patterns(planted.model, batch, layers, 2**30, kernel)
    assert kernel.patterns_failed == "its first readings disagreed with torch's"
    assert "no longer reads the exemplars' patterns" in caplog.text
    by_torch = read_patterns(planted.model, batch, layers, 2**30, TileKernel(native_loader=lambda: "no kernel here"))
    torch.testing.assert_close(dropped[0], by_torch[0], rtol=0, atol=0)
    assert_same_exemplars(by_torch[2], dropped[2], rtol=0, atol=0)
