"""Head importance: exact ablation and first-order attribution on the model's own loss."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

import headscope
from headscope.errors import ConfigError
from headscope.interventions.loss import token_losses
from headscope.model.batch import collate

from helpers import QUICK, assert_one_line_error, hidden_leftovers, run_cli, tiny_model_folder
from planted import COPY_LOGIT, COPY_VOCAB, build_planted_copier, copy_scales, copy_words
from reference_importance import straightforward_importance

IMPORTANCE = ["ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean"]


def test_token_losses_count_only_predicted_real_tokens():
    logits = torch.zeros(2, 4, 3)
    logits[:, :, 1] = math.log(2.0)  # p(token 1) = 2/4, p(0) = p(2) = 1/4 at every position
    batch = collate([0, 1], [[1, 1, 0, 2], [0, 1]], padding_side="left")  # the second: 2 tokens, left-padded
    sums, counts = token_losses(logits, batch)
    assert counts.tolist() == [3, 1]  # T tokens predict T - 1; padding predicts and is predicted nothing
    assert sums[0].item() == pytest.approx(-math.log(0.5) - math.log(0.25) - math.log(0.25))
    assert sums[1].item() == pytest.approx(-math.log(0.5))  # position 3 predicts token 1 of [0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [1, 2, 5])
def test_the_loss_and_its_gradient_match_float64_autograd_in_every_chunking(monkeypatch, dtype, rows_per_chunk):
    """token_nll's own backward (softmax - one-hot into one buffer, chunk by chunk) against autograd through a plain
    float64 log_softmax, over padding on both sides; the chunk size (LOSS_CHUNK_BYTES) changes no number."""
    from headscope.interventions import loss

    vocab, t = 7, 5
    monkeypatch.setattr(loss, "LOSS_CHUNK_BYTES", rows_per_chunk * 4 * t * vocab)
    batch = collate([0, 1, 2, 3, 4], [[1, 2, 3, 4, 5], [6, 1], [2, 2, 2], [3], [0, 6, 5, 4]], padding_side="left")
    generator = torch.Generator().manual_seed(0)
    start = (3 * torch.randn(5, t, vocab, generator=generator)).to(dtype)
    weights = torch.randn(5, t - 1, generator=generator, dtype=torch.float64)  # a gradient that is not all ones
    logits = start.clone().requires_grad_()
    (loss.token_nll(logits, batch) * weights).sum().backward()
    reference = start.double().requires_grad_()
    log_p = torch.log_softmax(reference[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    predicted = batch.attention_mask[:, :-1].bool() & batch.attention_mask[:, 1:].bool()
    expected = torch.where(predicted, -log_p, 0.0)
    (expected * weights).sum().backward()
    unit = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23  # the gradient's rounding, in the logits' dtype
    assert torch.allclose(loss.token_nll(start, batch), expected.detach(), rtol=0, atol=1e-5)
    assert logits.grad.dtype == dtype and torch.allclose(logits.grad.double(), reference.grad, rtol=2 * unit, atol=1e-6)
    assert logits.grad[:, -1].abs().max() == 0 and logits.grad[3].abs().max() == 0  # nothing predicted there


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    folder = build_planted_copier(tmp_path_factory.mktemp("copier") / "model")
    words = copy_words()
    sentences = [" ".join([words[i % 7]] * (3 + i % 6)) for i in range(40)]  # one word, repeated
    return folder, sentences


def hand_losses(sentences: list[str]) -> tuple[float, float, float]:
    """Clean, zero-ablated and mean-ablated loss per predicted token, computed from the planted weights."""
    vocab = COPY_VOCAB
    c0, alpha, dim = copy_scales()
    clean = math.log(1 + (vocab - 1) * math.exp(-COPY_LOGIT))
    zero = math.log(vocab)  # the copy code is gone: every logit is 0
    tokens = [s.split() for s in sentences]
    ids = {word: 2 + i for i, word in enumerate(copy_words())}
    frequency = np.zeros(vocab)  # over every real position, the last included
    for sentence in tokens:
        for word in sentence:
            frequency[ids[word]] += 1
    frequency /= frequency.sum()
    # The mean output writes c0 * sum_v f_v (e_C+v - e_C'+v): the final LayerNorm's scale changes with it.
    c_final = 1.0 / math.sqrt((4.0 + 2.0 * c0**2 * (frequency**2).sum()) / dim + 1e-5)
    logits = 2 * alpha * c_final * c0 * frequency
    log_partition = np.log(np.exp(logits).sum())
    mean = np.mean([log_partition - logits[ids[w]] for sentence in tokens for w in sentence[:-1]])
    return clean, zero, float(mean)


def test_a_planted_head_is_the_only_one_the_loss_needs(copier):
    folder, sentences = copier
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    result = headscope.analyze(loaded, sentences, importance="exact", probes=False, sentence_heads=False)
    clean, zero, mean = hand_losses(sentences)
    assert result.run["importance"]["clean_loss"] == pytest.approx(clean, abs=1e-6)
    assert result.run["importance"]["predicted_tokens"] == sum(len(s.split()) - 1 for s in sentences)
    heads = result.heads.set_index(["layer", "head"])
    carrier = heads.loc[(0, 0)]
    assert carrier["ablation_zero"] == pytest.approx(zero - clean, abs=1e-5)
    assert carrier["ablation_mean"] == pytest.approx(mean - clean, abs=1e-5)
    assert carrier["attribution_zero"] > 0 and carrier["attribution_mean"] > 0  # the right sign...
    assert carrier["attribution_zero"] < carrier["ablation_zero"]  # ...but far short: the effect saturates
    others = heads.drop((0, 0))
    np.testing.assert_allclose(others[IMPORTANCE], 0.0, atol=1e-6)
    layers = pd.DataFrame(result.heads).groupby("layer")["ablation_zero"].sum()
    assert layers.loc[0] == pytest.approx(zero - clean, abs=1e-5)


@pytest.mark.slow  # over 1.5 s on two cores
def test_batching_and_padding_do_not_change_importance(copier):
    folder, sentences = copier
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    options = {"importance": "exact", "probes": False, "sentence_heads": False, "bootstrap": 0}
    base = headscope.analyze(loaded, sentences, **options).heads
    for variant in ({"batch_size": 1}, {"batch_size": 6, "padding_side": "left"}):
        other = headscope.analyze(loaded, sentences, **options, **variant).heads
        np.testing.assert_allclose(other[IMPORTANCE], base[IMPORTANCE], atol=1e-6, err_msg=str(variant))


@pytest.mark.slow  # two runs through the CLI
def test_importance_through_the_cli(copier, tmp_path):
    folder, sentences = copier
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences) + "\n")
    out = tmp_path / "report"
    result = run_cli("analyze", folder, "--corpus", corpus, "--out", out, "--importance", "fast", "--no-probes")
    assert result.exit_code == 0, result.output
    assert "the 10 heads the loss needs most, by estimate_mean, a second-order estimate" in result.output
    heads = pd.read_parquet(out / "heads.parquet")
    assert heads[["attribution_zero", "attribution_mean", "estimate_zero", "estimate_mean"]].notna().all().all()
    assert heads[["ablation_zero", "ablation_mean"]].isna().all().all()  # fast: no ablation
    run = json.loads((out / "run.json").read_text())
    assert run["importance"]["mode"] == "fast" and run["importance"]["ablated_layers"] == []
    layers = pd.read_parquet(out / "layers.parquet")
    assert layers["estimate_mean_total"].notna().all() and layers["ablation_mean_total"].isna().all()
    for chart in ("importance_heatmap", "importance_entropy"):
        assert (out / f"{chart}.png").stat().st_size > 10_000
    plain = run_cli("analyze", folder, "--corpus", corpus, "--out", tmp_path / "plain", "--no-probes")
    assert plain.exit_code == 0 and "loss needs most" not in plain.output

    # stderr is not a terminal here (as under nohup or in CI): each stage and each tenth of a pass is a log line.
    log = result.stderr.splitlines()
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d loading .*", line) for line in log), log
    for what in ("measuring", "importance \\(fast\\)"):
        steps = [
            re.fullmatch(
                rf"\d\d:\d\d:\d\d {what}: (\d+)% \((\d+)/(\d+) sentences\), [\d,]+ tokens/s, "
                r"\S+ elapsed, about \S+ left",
                line,
            )
            for line in log
        ]
        done = [int(m[1]) for m in steps if m]
        assert done and done == sorted(set(done)) and done[-1] == 100, (what, log)


def test_importance_needs_the_lm_head(copier):
    folder, sentences = copier
    base_only = headscope.load_model(str(folder), device="cpu")
    with pytest.raises(ConfigError, match="--importance needs the model's LM head"):
        headscope.analyze(base_only, sentences, importance="fast", probes=False)


def test_importance_refuses_a_checkpoint_without_lm_head_weights(tmp_path, corpus_lines):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, max_position_embeddings=64,
    )  # fmt: skip
    model = tiny_model_folder(tmp_path / "base-llama", config, LlamaModel, corpus_lines)
    result = run_cli("analyze", model, "--out", tmp_path / "o", "--importance", "fast", *QUICK)
    assert_one_line_error(result, "holds no weights for its LM head (lm_head.weight", "drop --importance")
    assert run_cli("analyze", model, "--out", tmp_path / "o", *QUICK, "--no-charts").exit_code == 0  # fine without


@pytest.mark.slow  # over 1.5 s on two cores: out of the fast loop (docs/tests.md)
def test_importance_of_one_token_sentences_is_not_measured(planted_gpt2, tmp_path):
    corpus = tmp_path / "words.txt"
    corpus.write_text("cat\ndog\nbird\n")
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--importance", "fast", *QUICK)
    assert result.exit_code == 0, result.output
    assert "no sentence has a token to predict" in result.output
    assert "clean loss" not in result.output and "the heads the loss needs most" not in result.output
    run = json.loads((out / "run.json").read_text())
    assert run["importance"]["clean_loss"] is None and run["importance"]["predicted_tokens"] == 0
    assert pd.read_parquet(out / "heads.parquet")["attribution_mean"].isna().all()


def test_importance_refuses_a_sentence_beyond_its_memory_budget_before_measuring(planted_gpt2, tmp_path, corpus_lines):
    """A sentence is never split: one too long for a gradient pass within --max-memory is refused up front (it
    used to run past the budget: 3.1 GB for 2 GiB on SmolLM2), not after hours of measuring."""
    corpus = tmp_path / "long.txt"
    corpus.write_text(" ".join(" ".join(corpus_lines).split()[:40]) + "\n" + corpus_lines[0] + "\n")
    out = tmp_path / "o"
    options = ("--importance", "fast", "--max-memory", "1MiB", *QUICK)
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, *options)
    assert_one_line_error(
        result, "tokens in one gradient pass with 1.0 MiB", "the longest sentence has 44", "--max-length"
    )
    assert not out.exists() and hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("architecture", ["gemma2", "olmo2"])
def test_importance_behind_a_post_attention_norm_equals_the_plain_computation(architecture, tmp_path, corpus_lines):
    """Gemma 2 and OLMo 2 normalise the attention output before adding it: a removal's exact cost, its first-order
    estimate and the curvature term (estimate_*) act on the head's output before the output projection, through
    the norm, and must equal hooks on o_proj with autograd (tests/support/reference_importance.py), head by head."""
    import transformers as t

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 128}  # fmt: skip
    model_class, config = {
        "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(**shape, head_dim=16, sliding_window=64)),
        "olmo2": (t.Olmo2ForCausalLM, t.Olmo2Config(**shape)),
    }[architecture]
    folder = tiny_model_folder(tmp_path, config, model_class, corpus_lines)
    loaded = headscope.load_model(str(folder), device="cpu", dtype="float32", lm_head=True)
    sentences = corpus_lines[:6]
    heads = headscope.analyze(loaded, sentences, importance="exact", probes=False, bootstrap=0, charts=None,
                              page=False, check_dormant=False).heads.set_index(["layer", "head"])  # fmt: skip
    assert any(
        "post-norm" in path
        for path in headscope.analyze(
            loaded, sentences[:1], probes=False, bootstrap=0, charts=None, page=False, check_dormant=False
        ).run["write_path"]
    )  # the model's path is the one under test
    for layer, head in ((0, 1), (1, 2)):
        zero, mean, first_zero, first_mean, curvature_mean, curvature_zero = straightforward_importance(
            loaded, sentences, layer, head
        )
        got = heads.loc[(layer, head)]
        assert abs(zero) > 1e-3 and abs(curvature_mean) > 1e-7  # the head and the curvature term both matter here
        np.testing.assert_allclose(got[["ablation_zero", "ablation_mean"]].to_numpy(float), [zero, mean], atol=1e-5)
        np.testing.assert_allclose(
            got[["attribution_zero", "attribution_mean", "estimate_zero", "estimate_mean"]].to_numpy(float),
            [first_zero, first_mean, first_zero + curvature_zero, first_mean + curvature_mean],
            rtol=1e-4,
            atol=1e-6,
            err_msg=f"{architecture} {layer}.{head}",
        )
