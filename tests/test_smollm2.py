"""The real SmolLM2-135M (Llama architecture, 9 query heads on 3 KV heads) against a plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headscope

from reference import METRIC_NAMES, corpus_means, sentence_rows

pytestmark = pytest.mark.slow
ALL_METRICS = (*METRIC_NAMES, "entropy_std")


@pytest.fixture(scope="module")
def reference_attention(smollm2, corpus_lines):
    """Per layer, each sentence's (9, n, n) attention from output_attentions=True, one sentence at a time."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    assert model.config._attn_implementation == "eager"
    layers: list[list[np.ndarray]] = [[] for _ in range(model.config.num_hidden_layers)]
    with torch.inference_mode():
        for line in corpus_lines:
            ids = torch.tensor([tokenizer(line)["input_ids"]])
            for layer, attn in enumerate(model(ids, output_attentions=True).attentions):
                layers[layer].append(attn[0].double().numpy())
    return layers


@pytest.fixture(scope="module")
def batched(smollm2, shipped_corpus):
    return headscope.analyze(smollm2, shipped_corpus, batch_size=16)


def test_all_270_heads_match_output_attentions(batched, reference_attention):
    heads = batched.heads.sort_values(["layer", "head"])
    assert len(heads) == 30 * 9
    for layer, sentences in enumerate(reference_attention):
        expected = corpus_means(sentences)
        got = heads[heads["layer"] == layer]
        for name in ALL_METRICS:
            np.testing.assert_allclose(got[name].to_numpy(), expected[name], atol=1e-5, err_msg=f"{layer} {name}")
        assert (got["n_rows"] == expected["n_rows"]).all()


def test_per_sentence_metrics_match_output_attentions(batched, reference_attention):
    table = batched.sentence_heads
    for sentence_id in (0, 42, 86, 99):  # includes the two-token "Stop!" and a 20+ token sentence
        for layer in (0, 15, 29):
            rows = sentence_rows(reference_attention[layer][sentence_id])
            got = table[(table["sentence_id"] == sentence_id) & (table["layer"] == layer)].sort_values("head")
            for name in ("entropy", "diagonal", "sink", "max_weight"):
                np.testing.assert_allclose(got[name], np.mean(rows[name], axis=0), atol=1e-5, err_msg=name)


def test_batch_size_does_not_change_results(smollm2, shipped_corpus, batched):
    one_at_a_time = headscope.analyze(smollm2, shipped_corpus, batch_size=1, sentence_heads=False)
    for name in ALL_METRICS:
        np.testing.assert_allclose(one_at_a_time.heads[name], batched.heads[name], atol=1e-5, err_msg=name)


def test_grouped_query_heads_are_reported_per_query_head(batched):
    layer0 = batched.heads[batched.heads["layer"] == 0]
    assert layer0["head"].tolist() == list(range(9))
    assert layer0.groupby("kv_head")["head"].apply(list).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batched.run["model"]["architecture"]["kv_heads"] == 3
