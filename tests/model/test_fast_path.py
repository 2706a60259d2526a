"""The block-wise path, layer selection, memory-budgeted batching, and models with their own attention maths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headscope
from headscope.arguments import parse_batch_size, parse_bytes, parse_layers
from headscope.errors import ConfigError
from headscope.model.batch import plan_batches

from helpers import METRICS, assert_same_heads, tiny_model_folder
from reference import corpus_means

TINY_BLOCKS = 4096  # bytes: forces the block-wise path, with several blocks, even on short sentences
SMALL_BLOCKS = 65536  # bytes: the block-wise path on SmolLM2 with a few rows per block (one row per block is slow)


@pytest.mark.slow
def test_fused_path_matches_eager_path_on_smollm2(smollm2, shipped_corpus):
    eager = headscope.analyze(smollm2, shipped_corpus, sentence_heads=False, charts=None)
    fused = headscope.analyze(smollm2, shipped_corpus, sentence_heads=False, block_bytes=SMALL_BLOCKS)
    assert "eager" in eager.run["attention_implementation"]["LlamaAttention"]
    assert "fused" in fused.run["attention_implementation"]["LlamaAttention"]
    assert_same_heads(fused.heads, eager.heads, names=[name for name in METRICS if name != "active_rows"])
    # active_rows counts rows whose first-token mass is at most the sink threshold: a row within float32 rounding
    # of it may fall on either side on the two paths (on one machine, one row of one head of 270). At most one row.
    got, expected = fused.heads.sort_values(["layer", "head"]), eager.heads.sort_values(["layer", "head"])
    counted = expected["n_rows"].to_numpy() - eager.run["corpus"]["sentences"]  # rows that see a key besides the first
    flipped = np.abs(got["active_rows"].to_numpy() - expected["active_rows"].to_numpy()) * counted
    assert flipped.max() <= 1 + 1e-6 and (flipped > 1e-6).sum() <= 2


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_fused_path_on_gpt2_with_either_padding(planted_gpt2, corpus_lines, padding_side):
    eager = headscope.analyze(str(planted_gpt2), corpus_lines[:30], sentence_heads=False)
    fused = headscope.analyze(
        str(planted_gpt2), corpus_lines[:30], block_bytes=TINY_BLOCKS, padding_side=padding_side, batch_size=7
    )
    assert "fused" in fused.run["attention_implementation"]["GPT2Attention"]
    assert_same_heads(fused.heads, eager.heads)


def test_layer_selection_measures_only_those_layers(planted_gpt2, corpus_lines):
    everything = headscope.analyze(str(planted_gpt2), corpus_lines[:20])
    first_only = headscope.analyze(str(planted_gpt2), corpus_lines[:20], layers=(0,))
    assert first_only.heads["layer"].unique().tolist() == [0]
    assert first_only.sentence_heads["layer"].unique().tolist() == [0]
    assert_same_heads(first_only.heads, everything.heads[everything.heads["layer"] == 0])
    second_only = headscope.analyze(str(planted_gpt2), corpus_lines[:20], layers=(1,))
    assert_same_heads(second_only.heads, everything.heads[everything.heads["layer"] == 1])


def test_layer_beyond_the_model_is_refused(planted_gpt2):
    with pytest.raises(ConfigError, match="--layers names layer 5, but the model has layers 0-1"):
        headscope.analyze(str(planted_gpt2), ["A short sentence."], layers=(0, 5))


def test_batches_respect_sentence_and_token_limits():
    lengths = {0: 5, 1: 3, 2: 9, 3: 3, 4: 100, 5: 9}
    assert plan_batches(lengths, max_sentences=2, max_padding=1.0) == [[1, 3], [0, 2], [5, 4]]
    assert plan_batches(lengths, max_sentences=10, max_tokens=20, max_padding=1.0) == [[1, 3, 0], [2, 5], [4]]
    for batch in plan_batches(lengths, max_sentences=10, max_tokens=20, max_padding=1.0):
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 20


def test_batches_keep_padding_small():
    lengths = dict(enumerate([3, 3, 3, 4, 4, 10, 10, 11, 30]))
    batches = plan_batches(lengths, max_sentences=100, max_padding=0.2)
    assert batches == [[0, 1, 2, 3, 4], [5, 6, 7], [8]]  # 3,3,3,4,4: 20 padded, 17 real (15% padding)
    for batch in batches:
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded - sum(lengths[i] for i in batch) <= 0.2 * padded


@pytest.mark.slow  # over 1.5 s on two cores
def test_memory_budget_limits_padded_tokens(planted_gpt2, corpus_lines):
    small = headscope.analyze(str(planted_gpt2), corpus_lines, max_memory=2**20 * 8, sentence_heads=False)
    batching = small.run["batching"]
    assert batching["max_sentences"] == 256 and batching["memory_budget_bytes"] == 8 * 2**20
    assert batching["batches"] > 1
    default = headscope.analyze(str(planted_gpt2), corpus_lines, sentence_heads=False)
    assert_same_heads(small.heads, default.heads)


def test_size_and_layer_parsers():
    assert parse_layers("0-2, 5") == (0, 1, 2, 5)
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30) and parse_bytes("64MB") == 64 * 2**20
    assert parse_batch_size("auto") is None and parse_batch_size("8") == 8
    for bad in ("3-1", "a", ""):
        with pytest.raises(ConfigError, match="--layers"):
            parse_layers(bad)
    with pytest.raises(ConfigError, match="--max-memory"):
        parse_bytes("lots")
    with pytest.raises(ConfigError, match="--batch-size"):
        parse_batch_size("0")


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory, corpus_lines):
    """A tiny random Gemma2: logit softcapping and sliding windows live in its own eager function and mask."""
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        query_pre_attn_scalar=16,
        max_position_embeddings=128,
    )

    def sharpen(model):  # larger logits, so that softcapping changes them
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)

    return tiny_model_folder(tmp_path_factory.mktemp("gemma2"), config, Gemma2Model, corpus_lines, sharpen)


def test_softcapped_sliding_window_model_takes_the_fused_path(gemma2_folder, corpus_lines):
    """Gemma 2's eager function softcaps the logits and its mask slides: the fused pass equals the model's own
    attention weights, and headscope's eager path, on every statistic (grouped KV heads too: 4 on 2)."""
    from transformers import AutoModel, AutoTokenizer

    sentences = corpus_lines[:25]
    result = headscope.analyze(str(gemma2_folder), sentences, block_bytes=TINY_BLOCKS, sentence_heads=False)
    assert "fused" in result.run["attention_implementation"]["Gemma2Attention"]
    eager = headscope.analyze(str(gemma2_folder), sentences, sentence_heads=False, charts=None)
    assert "eager" in eager.run["attention_implementation"]["Gemma2Attention"]
    assert_same_heads(result.heads, eager.heads)
    tokenizer = AutoTokenizer.from_pretrained(gemma2_folder)
    model = AutoModel.from_pretrained(gemma2_folder, attn_implementation="eager").eval()
    per_layer: list[list[np.ndarray]] = [[], []]
    with torch.no_grad():
        for line in sentences:
            ids = torch.tensor([tokenizer(line)["input_ids"]])
            for layer, attn in enumerate(model(ids, output_attentions=True).attentions):
                per_layer[layer].append(attn[0].double().numpy())
    # The reference assumes full causal visibility, so compare the metrics that do not depend on it.
    for layer, attention in enumerate(per_layer):
        expected = corpus_means(attention)
        got = result.heads[result.heads["layer"] == layer].sort_values("head")
        for name in ("entropy", "diagonal", "sink", "prev_token", "max_weight"):
            np.testing.assert_allclose(got[name], expected[name], atol=1e-5, err_msg=f"{layer} {name}")


def test_a_model_with_its_own_attention_maths_stays_on_its_eager_function(tmp_path, corpus_lines):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64
    )
    folder = tiny_model_folder(tmp_path / "neox", config, GPTNeoXForCausalLM, corpus_lines)
    result = headscope.analyze(str(folder), corpus_lines[:10], block_bytes=TINY_BLOCKS, sentence_heads=False)
    path = result.run["attention_implementation"]["GPTNeoXAttention"]
    assert path.startswith("eager (the model's own attention function")  # its own weights, whoever reduces them


def test_the_example_attention_stays_small_when_every_sentence_is_long(planted_gpt2, corpus_lines):
    long_sentences = [" ".join(corpus_lines[i : i + 8]) for i in range(0, 40, 8)]  # 60-90 words each
    result = headscope.analyze(str(planted_gpt2), long_sentences, sentence_heads=False)
    assert result.sentences["n_tokens"].min() == 64  # cut to the model's 64 positions
    corpus = result.examples.query("source == 'corpus'")
    assert corpus["sentence_id"].nunique() == 1  # every sentence has one length: one example of it
    assert corpus["query"].max() == 31  # the example sentence is cut to 32 tokens
    assert len(corpus) == 2 * 3 * 32 * 33 // 2  # every visible pair of every head
