"""The one way headscope touches a model: measures ride on a pass as peers, layers are known by their module,
layers can be skipped, and the model is left exactly as the caller gave it."""

from __future__ import annotations

import pytest
import torch

import headscope
from headscope.model.batch import collate
from headscope.model.capture import RowBlock, attached
from headscope.run.feed import tokenize_sentences

from helpers import statistics

TINY_BLOCKS = 4096  # bytes: forces the block-wise path, with several blocks, even on short sentences


@pytest.fixture(scope="module")
def two_loads(planted_gpt2):
    """The same planted GPT-2 loaded twice: two models of one class, as in a notebook."""
    return [headscope.load_model(str(planted_gpt2), device="cpu") for _ in range(2)]


def one_batch(loaded, texts):
    ids, _ = tokenize_sentences(loaded.tokenizer, texts, None)
    return ids, collate(list(range(len(ids))), ids)  # one padded batch of all of them


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
    ids, batch = one_batch(loaded, corpus_lines[:6])
    alone, beside, peer = statistics(), statistics(), RowMass()
    with attached(loaded.model, block_bytes=block_bytes) as capture:
        capture.run(batch, measures=[alone])
        capture.run(batch, measures=[beside, peer])
        paths = set(capture.paths.values())
    assert ("fused" in " ".join(paths)) == (block_bytes == TINY_BLOCKS)
    torch.testing.assert_close(beside.finish(), alone.finish(), rtol=0, atol=0)  # the peer changes nothing
    heads = loaded.architecture["heads"]
    tokens = torch.tensor([len(row) for row in ids], dtype=torch.float32)
    for layer in range(loaded.architecture["layers"]):  # every real row's probabilities sum to 1
        torch.testing.assert_close(peer.mass[layer].float(), heads * tokens, rtol=1e-5, atol=1e-4)
    assert peer.blocks >= loaded.architecture["layers"]


def test_every_attach_checks_its_model_afresh(two_loads, corpus_lines):
    """What a capture learns on its first calls (causal? do our logits reproduce the eager weights?) is its
    own: a second model of the same class, or the same model attached again, is checked again."""
    _, batch = one_batch(two_loads[0], corpus_lines[:4])
    results = []
    for loaded in (*two_loads, two_loads[0]):
        measure = statistics()
        with attached(loaded.model, block_bytes=TINY_BLOCKS) as capture:
            assert capture.paths == {}  # nothing known yet
            capture.run(batch, measures=[measure])
            assert set(capture.paths.values()) == {
                "fused (row statistics in one pass over tiles of keys; output from sdpa)"
            }
        results.append(measure.finish())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    torch.testing.assert_close(results[2], results[0], rtol=0, atol=0)


def test_layers_are_known_by_their_module_and_can_be_skipped(two_loads, corpus_lines):
    """A pass that starts at layer 1 (layer 0 hands on its clean output) reports layer 1 as layer 1, not as the
    first layer it saw, and computes what the whole pass computes."""
    loaded = two_loads[0]
    _, batch = one_batch(loaded, corpus_lines[:3])
    whole, late = RowMass(), RowMass()
    with attached(loaded.model) as capture:
        clean, outputs = capture.run_keeping_layers(batch)
        capture.run(batch, measures=[whole])
        skipped = capture.run(batch, measures=[late], start_at=1, handed_on=outputs[0])
    assert sorted(whole.mass) == [0, 1] and sorted(late.mass) == [1]
    torch.testing.assert_close(late.mass[1], whole.mass[1])
    # The clean pass computed its outputs with sdpa (nothing read them), the others with the eager weights.
    torch.testing.assert_close(skipped.last_hidden_state, clean.last_hidden_state, rtol=1e-5, atol=1e-5)


def model_state(model: torch.nn.Module) -> dict:
    """Everything about a model a run could change and forget to put back."""
    return {
        "attention": model.config._attn_implementation,
        "modules": [
            (name, id(module), module.training, sorted(vars(module))) for name, module in model.named_modules()
        ],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "parameters": [(name, id(p), p.requires_grad, p.detach().clone()) for name, p in model.named_parameters()],
    }


def test_a_run_leaves_the_callers_model_exactly_as_it_was(planted_gpt2, corpus_lines):
    """Exact importance uses every way of touching a model (attention read, head outputs replaced, gradients,
    layers skipped); the caller's model, in training mode with trainable weights, comes back unchanged."""
    loaded = headscope.load_model(str(planted_gpt2), device="cpu", lm_head=True)
    loaded.lm.train()
    for parameter in loaded.lm.parameters():
        parameter.requires_grad_(True)
    before = model_state(loaded.lm)
    headscope.analyze(loaded, corpus_lines[:4], importance="exact", sentence_heads=False, probe_seeds=2)
    after = model_state(loaded.lm)
    for key in ("attention", "modules", "hooks"):
        assert after[key] == before[key], key
    for (name, ident, grad, value), (_, ident_after, grad_after, value_after) in zip(
        before["parameters"], after["parameters"], strict=True
    ):
        assert (ident_after, grad_after) == (ident, grad), name
        assert torch.equal(value_after, value), name
