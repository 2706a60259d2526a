"""End to end through the CLI on a GPT-2 whose layer-0 heads have known attention."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from headscope.cli import app

from planted import BETA, FIRST, N_POSITIONS, PREVIOUS, UNIFORM, expected_attention
from reference import corpus_means, sentence_rows
from tolerances import UNIT, row_statistic

# How far the planted layer's numbers may be from the float64 hand computation (tests/support/tolerances.py). Each
# planted logit is one product of one-hot keys and a query scale through GPT-2's LayerNorm (2 non-zero inputs: exact
# sums), so it is within a few roundings of BETA: 8 u BETA bounds it. A logit error d moves each probability by at most
# 2 d p, so a mass by 2 d and an entropy by 2 d (H + 1); the row's float32 sums add row_statistic.
LOGIT = 8 * UNIT * BETA
PLANTED = 2 * LOGIT * (np.log(N_POSITIONS) + 1) + row_statistic(N_POSITIONS, np.log(N_POSITIONS) + 1)

runner = CliRunner()


@pytest.fixture(scope="module")
def planted_report(planted_gpt2, shipped_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "planted"
    result = runner.invoke(app, ["analyze", str(planted_gpt2), "--corpus", str(shipped_corpus), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_planted_heads_match_hand_computation(planted_report):
    heads = pd.read_parquet(planted_report / "heads.parquet")
    sentences = pd.read_parquet(planted_report / "sentences.parquet")
    lengths = sentences["n_tokens"].tolist()
    expected = corpus_means([np.stack([expected_attention(h, n) for h in (UNIFORM, PREVIOUS, FIRST)]) for n in lengths])
    layer0 = heads[heads["layer"] == 0].set_index("head").sort_index()
    for name, values in expected.items():
        np.testing.assert_allclose(layer0[name].to_numpy(), values, rtol=0, atol=PLANTED / np.log(2), err_msg=name)
    # The planted patterns themselves, stated plainly: the previous-token head puts most of its mass on t-1
    # and the first-token head on position 0, while the uniform head is exactly ln(t+1) per row.
    assert layer0.loc[PREVIOUS, "prev_token"] > 0.99
    assert layer0.loc[FIRST, "sink"] > 0.99
    assert layer0.loc[UNIFORM, "norm_entropy"] == pytest.approx(1.0, abs=PLANTED / np.log(2))  # / ln(t + 1) >= ln 2


def test_per_sentence_rows_match_hand_computation(planted_report):
    per_sentence = pd.read_parquet(planted_report / "sentence_heads.parquet")
    sentences = pd.read_parquet(planted_report / "sentences.parquet")
    assert len(per_sentence) == len(sentences) * 2 * 3  # every sentence x 2 layers x 3 heads
    assert per_sentence["sentence_id"].is_monotonic_increasing
    for sentence in sentences.itertuples():
        attn = np.stack([expected_attention(h, sentence.n_tokens) for h in (UNIFORM, PREVIOUS, FIRST)])
        rows = sentence_rows(attn)
        got = per_sentence[(per_sentence["sentence_id"] == sentence.sentence_id) & (per_sentence["layer"] == 0)]
        got = got.set_index("head").sort_index()
        assert (got["n_tokens"] == sentence.n_tokens).all()
        np.testing.assert_allclose(got["entropy"], np.mean(rows["entropy"], axis=0), rtol=0, atol=PLANTED)
        np.testing.assert_allclose(got["diagonal"], np.mean(rows["diagonal"], axis=0), rtol=0, atol=PLANTED)


def test_sentences_table_and_run_record(planted_report, planted_gpt2, corpus_lines):
    from transformers import AutoTokenizer

    sentences = pd.read_parquet(planted_report / "sentences.parquet")
    tokenizer = AutoTokenizer.from_pretrained(planted_gpt2)
    assert sentences["text"].tolist() == corpus_lines
    assert sentences["line"].tolist() == list(range(1, len(corpus_lines) + 1))
    assert sentences["n_tokens"].tolist() == [len(tokenizer(line)["input_ids"]) for line in corpus_lines]
    assert not sentences["truncated"].any()

    run = json.loads((planted_report / "run.json").read_text())
    assert run["model"]["architecture"] == {
        "model_type": "gpt2",
        "layers": 2,
        "heads": 3,
        "kv_heads": 3,
        "head_dim": 64,
    }
    assert run["corpus"]["sentences"] == len(corpus_lines)
    assert run["corpus"]["tokens"] == int(sentences["n_tokens"].sum())
    assert len(run["corpus"]["sha256"]) == 64
    assert run["timings"]["tokens_per_second"] > 0
    assert not [p.name for p in planted_report.parent.iterdir() if p.name.startswith(".")]  # no leftovers


@pytest.mark.slow  # over 1.5 s on two cores
def test_max_length_truncates_and_counts(planted_gpt2, tmp_path):
    out = tmp_path / "cut"
    result = runner.invoke(app, ["analyze", str(planted_gpt2), "--max-length", "6", "--out", str(out)])
    assert result.exit_code == 0, result.output
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert sentences["n_tokens"].max() == 6
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["truncated_sentences"] == int(sentences["truncated"].sum()) > 0
    assert "truncated" in result.output


def test_random_layer_matches_output_attentions(planted_gpt2, corpus_lines):
    """Layer 1 has random weights: compare with transformers' own returned attention, sentence by sentence."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    import headscope

    result = headscope.analyze(str(planted_gpt2), corpus_lines[:40], batch_size=7)
    tokenizer = AutoTokenizer.from_pretrained(planted_gpt2)
    model = AutoModel.from_pretrained(planted_gpt2, attn_implementation="eager").eval()
    per_layer: dict[int, list[np.ndarray]] = {0: [], 1: []}
    with torch.no_grad():
        for line in corpus_lines[:40]:
            ids = torch.tensor([tokenizer(line)["input_ids"]])
            for layer, attn in enumerate(model(ids, output_attentions=True).attentions):
                per_layer[layer].append(attn[0].double().numpy())
    for layer, sentences in per_layer.items():
        expected = corpus_means(sentences)
        got = result.heads[result.heads["layer"] == layer].sort_values("head")
        for name, values in expected.items():
            np.testing.assert_allclose(got[name].to_numpy(), values, atol=1e-5, err_msg=f"layer {layer} {name}")
