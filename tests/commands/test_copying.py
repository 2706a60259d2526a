"""headscope.copying: the OV copying score from the weights alone, against heads planted to copy (1) and to
suppress (-1), and against a dense float64 computation of the (tokens, tokens) OV circuit, spelled out by module
name, on GPT-2 (LayerNorm gains), Gemma 2 (1 + w gains, post-attention norms, scaled embeddings) and SmolLM2."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import headscope
from headscope.commands.copying import copying

from helpers import tiny_model_folder

WORDS = [f"w{i}" for i in range(2, 12)]  # with [UNK] and [PAD]: 12 tokens, fewer than the width
TOKENS = list(range(40))


def planted_copier(folder, sign: float):
    """One layer, one head as wide as the residual stream; token embeddings one-hot (orthonormal rows) and tied; the
    value and output projections +-identity: the OV circuit is +-identity on the vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)  # fmt: skip

    def plant(model):
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, : len(embed)] = torch.eye(len(embed))
        attention = model.model.layers[0].self_attn
        attention.v_proj.weight.copy_(torch.eye(16))
        attention.o_proj.weight.copy_(sign * torch.eye(16))

    return tiny_model_folder(folder, config, LlamaForCausalLM, [" ".join(WORDS)], plant)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_head_planted_to_copy_scores_one_and_to_suppress_minus_one(tmp_path, sign):
    found = copying(str(planted_copier(tmp_path / "copier", sign)), device="cpu")
    assert found.heads["ov_copying"].tolist() == pytest.approx([sign], abs=1e-12)
    assert found.record["unembedding"].startswith("the LM head")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_model_in_half_precision_scores_as_in_float32(tmp_path, dtype):
    """Its norms round their outputs to bfloat16 (or float16), which the gains are read through."""
    found = copying(str(planted_copier(tmp_path / "copier", -1.0)), device="cpu", dtype=dtype)
    assert found.heads["ov_copying"].tolist() == pytest.approx([-1.0], abs=1e-12)


def test_analyze_writes_the_score_as_a_column_cached_per_model(tmp_path, monkeypatch):
    """analyze's ov_copying is `copying`'s score, computed once per model: the same weights read it back from the
    cache, other weights (the head planted the other way) miss it, and a damaged cache file is computed again."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HEADSCOPE_CACHE", str(cache))
    copier, suppressor = (planted_copier(tmp_path / name, sign) for name, sign in (("up", 1.0), ("down", -1.0)))
    texts = [" ".join(WORDS), " ".join(reversed(WORDS))]

    def analyze(folder):
        return headscope.analyze(str(folder), texts, probes=False, bootstrap=0, device="cpu")

    first = analyze(copier)
    assert first.heads["ov_copying"].tolist() == pytest.approx([1.0], abs=1e-12)
    assert first.run["copying"]["from"] == "the LM head"
    [stored] = (cache / "ov_copying").glob("*.json")
    again = analyze(copier)
    assert again.run["copying"]["from"] == f"the LM head, cached ({stored})"
    assert again.heads["ov_copying"].tolist() == first.heads["ov_copying"].tolist()
    other = analyze(suppressor)
    assert other.heads["ov_copying"].tolist() == pytest.approx([-1.0], abs=1e-12)
    assert other.run["copying"]["from"] == "the LM head" and len(list((cache / "ov_copying").glob("*.json"))) == 2
    stored.write_text('{"scores": [[0.5, ')  # cut short
    mended = analyze(copier)
    assert mended.run["copying"]["from"] == "the LM head"
    assert mended.heads["ov_copying"].tolist() == pytest.approx([1.0], abs=1e-12)
    assert json.loads(stored.read_text())["scores"] == [[pytest.approx(1.0, abs=1e-12)]]
    monkeypatch.setenv("HEADSCOPE_CACHE", str(stored))  # a file, where the cache folder should be: not written
    assert analyze(copier).heads["ov_copying"].tolist() == pytest.approx([1.0], abs=1e-12)


@torch.no_grad()
def dense_scores(lm, tokens: list[int]) -> np.ndarray:
    """(layers, heads): sum(lambda) / sum(|lambda|) of the dense (tokens, tokens) OV circuit in float64, the
    modules spelled by name: W_U diag(g_final) [diag(g_post)] W_O^h W_V^h diag(g_in) (s W_E)^T."""
    lm = copy.deepcopy(lm).double()
    gpt2 = hasattr(lm, "transformer")
    gemma = type(lm).__name__.startswith("Gemma")
    base = lm.transformer if gpt2 else lm.model
    config = lm.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embed = (base.wte if gpt2 else base.embed_tokens).weight[tokens]
    if gemma:
        embed = embed * config.hidden_size**0.5
    unembed = lm.lm_head.weight[tokens]

    def gain(norm):
        return 1 + norm.weight if gemma else norm.weight

    final = gain(base.ln_f if gpt2 else base.norm)
    found = []
    for layer in base.h if gpt2 else base.layers:
        if gpt2:
            width = heads * head_dim
            value, output, g_in = layer.attn.c_attn.weight.T[2 * width :], layer.attn.c_proj.weight.T, layer.ln_1.weight
            g_post = torch.ones_like(final)
        else:
            value, output = layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight
            g_in = gain(layer.input_layernorm)
            g_post = gain(layer.post_attention_layernorm) if gemma else torch.ones_like(final)
        row = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            v = value[kv * head_dim : (kv + 1) * head_dim]
            o = output[:, head * head_dim : (head + 1) * head_dim]
            circuit = unembed @ torch.diag(final * g_post) @ o @ v @ torch.diag(g_in) @ embed.T
            eigenvalues = torch.linalg.eigvals(circuit)
            row.append(float(eigenvalues.sum().real / eigenvalues.abs().sum()))
        found.append(row)
    return np.array(found)


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def random_lm(request, tmp_path_factory, corpus_lines):
    from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel

    if request.param == "gpt2":
        config, model_class = GPT2Config(n_layer=2, n_embd=32, n_head=4), GPT2LMHeadModel
    else:
        config = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, sliding_window=8)  # fmt: skip
        model_class = Gemma2ForCausalLM

    def spread(model):  # gains away from 1, so that a gain left out shows
        for name, parameter in model.named_parameters():
            if "norm" in name or "ln_" in name:
                parameter.uniform_(-0.5, 0.5) if request.param == "gemma2" else parameter.uniform_(0.5, 1.5)

    return tiny_model_folder(tmp_path_factory.mktemp(request.param), config, model_class, corpus_lines, spread)


def test_every_head_equals_the_dense_computation_on_a_few_tokens(random_lm):
    """On the first 40 tokens: the scores from the (head_dim, head_dim) map equal the dense (40, 40) circuit's."""
    loaded = headscope.load_model(str(random_lm), device="cpu", lm_head=True)
    found = copying(loaded, tokens=TOKENS)
    want = dense_scores(loaded.lm, TOKENS)
    got = found.heads.pivot(index="layer", columns="head", values="ov_copying").to_numpy()
    # float32 weights and products (a few hundred terms of size ~1 each) against float64: 1e-5 of a score of ~1
    np.testing.assert_allclose(got, want, atol=1e-5)
    # the base model alone (tied embeddings): the final norm is what makes its output, the same scores
    base = copying(headscope.load_model(str(random_lm), device="cpu"), tokens=TOKENS)
    np.testing.assert_array_equal(base.heads["ov_copying"], found.heads["ov_copying"])
    assert np.abs(want).max() > 0.2 and len(np.unique(np.round(want, 3))) > 1  # scores that differ and can fail


def test_tokens_out_of_range_are_refused(random_lm):
    with pytest.raises(headscope.HeadscopeError, match="tokens must be ids"):
        copying(str(random_lm), tokens=[10**6], device="cpu")


@pytest.mark.slow
def test_smollm2_equals_the_dense_computation_on_a_few_tokens(smollm2):
    """The real SmolLM2 (RMS norm gains, tied embeddings) on its first 300 tokens."""
    tokens = list(range(300))
    found = copying(smollm2, tokens=tokens)
    got = found.heads.pivot(index="layer", columns="head", values="ov_copying").to_numpy()
    want = dense_scores(smollm2.lm, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_command_prints_the_heads_that_copy_and_suppress_most(tmp_path):
    from helpers import run_cli

    done = run_cli("copying", planted_copier(tmp_path / "copier", -1.0), "--count", "1", "--device", "cpu")
    assert done.exit_code == 0, done.output
    assert "suppressing most" in done.output and "0.0" in done.output and "-1.000" in done.output


def test_count_says_how_many_heads_each_table_shows(random_lm):
    """8 heads: --count 2 shows 2 that copy most and 2 that suppress most, --count 3 three of each."""
    import re

    from helpers import run_cli

    for count in (2, 3):
        done = run_cli("copying", random_lm, "--count", str(count), "--device", "cpu")
        assert done.exit_code == 0, done.output
        assert len(re.findall(r"^\s+\d+\.\d+\s+[+-]\d\.\d{3}\s*$", done.output, re.MULTILINE)) == 2 * count
