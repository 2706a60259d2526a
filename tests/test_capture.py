"""The attention router: per-model state, and measures that ride on a forward pass as peers."""

from __future__ import annotations

import pytest
import torch

import headscope
from headscope.capture import Capture, RowBlock, forward, measuring
from headscope.feed import collate, tokenize_sentences
from headscope.measures.statistics import AttentionStatistics

TINY_BLOCKS = 4096  # bytes: forces the block-wise path, with several blocks, even on short sentences


@pytest.fixture(scope="module")
def two_loads(planted_gpt2):
    """The same planted GPT-2 loaded twice: two models of one class, as in a notebook."""
    return [headscope.load_model(str(planted_gpt2), device="cpu") for _ in range(2)]


def test_every_model_is_checked_by_its_own_capture(two_loads, corpus_lines, monkeypatch):
    """The first-call checks (causal? do our logits reproduce the eager weights?) run for each model, not
    once per process: a second model of the same class must not inherit the first one's verdict."""
    checked = []
    real = Capture._inspect_standard

    def spy(self, eager, name, module, *args, **kwargs):
        checked.append((id(self), id(module)))
        return real(self, eager, name, module, *args, **kwargs)

    monkeypatch.setattr(Capture, "_inspect_standard", spy)
    for loaded in two_loads:
        headscope.analyze(loaded, corpus_lines[:5], block_bytes=TINY_BLOCKS, sentence_heads=False)
    # Each analyze opens three measuring contexts (the corpus, the probes, the example sentence): six checks.
    assert len(checked) == 6
    for loaded in two_loads:
        modules = {id(module) for module in loaded.model.modules()}
        assert sum(module in modules for _, module in checked) == 3


def test_measuring_leaves_the_model_as_it_found_it(two_loads, corpus_lines):
    loaded = two_loads[0]
    before = loaded.model.config._attn_implementation
    headscope.analyze(loaded, corpus_lines[:3], sentence_heads=False)
    assert loaded.model.config._attn_implementation == before
    assert not [m for m in loaded.model.modules() if hasattr(m, "_headscope_capture")]


class RowMass:
    """A new measure, written as a peer of the statistics: total probability mass per (layer, sentence)."""

    def __init__(self) -> None:
        self.mass: dict[int, torch.Tensor] = {}
        self.blocks = 0

    def start(self, batch) -> None:
        self.mass = {}

    def wants(self, layer: int) -> bool:
        return True

    def last_layer(self) -> int | None:
        return None

    def attention(self, layer: int, block: RowBlock) -> None:
        self.blocks += 1
        rows = block.probabilities().sum(-1) * block.query_valid[:, None, :]  # (batch, heads, rows)
        self.mass[layer] = self.mass.get(layer, 0) + rows.sum((1, 2))


@pytest.mark.parametrize("block_bytes", [TINY_BLOCKS, 2**30])  # block-wise logits, then the eager weights
def test_a_new_measure_rides_beside_the_statistics(two_loads, corpus_lines, block_bytes):
    loaded = two_loads[0]
    texts = corpus_lines[:6]
    ids, _ = tokenize_sentences(loaded.tokenizer, texts, None)
    alone = AttentionStatistics(window=2, accum_dtype=torch.float64)
    statistics, peer = AttentionStatistics(window=2, accum_dtype=torch.float64), RowMass()
    batch = collate(list(range(len(ids))), ids)  # one padded batch of all six
    with measuring(loaded.model, [alone], block_bytes=block_bytes) as capture:
        forward(loaded.model, capture, batch)
    with measuring(loaded.model, [statistics, peer], block_bytes=block_bytes) as capture:
        forward(loaded.model, capture, batch)
        paths = set(capture.paths.values())
    assert ("blockwise" in " ".join(paths)) == (block_bytes == TINY_BLOCKS)
    torch.testing.assert_close(statistics.finish(), alone.finish(), rtol=0, atol=0)  # the peer changes nothing
    heads = loaded.architecture["heads"]
    tokens = torch.tensor([len(row) for row in ids], dtype=torch.float32)
    for layer in range(loaded.architecture["layers"]):  # every real row's probabilities sum to 1
        torch.testing.assert_close(peer.mass[layer].float(), heads * tokens, rtol=1e-5, atol=1e-4)
    assert peer.blocks >= loaded.architecture["layers"]
