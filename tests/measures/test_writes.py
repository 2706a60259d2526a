"""What heads write (write_norm, write_ratio, sink_value_ratio), their logit scale and what they do off the sink:
the maths on hand-built tensors, a planted GPT-2 whose answers are known, and the real SmolLM2 against a plain
float64 computation (tests/support/reference_writes.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from transformers.pytorch_utils import Conv1D

import headscope
from headscope.columns import STAT_INDEX
from headscope.config import RoleThresholds, Thresholds
from headscope.labels import assign_roles, full_label, off_sink_behaviour
from headscope.measures.row_sums import head_row_sums, head_row_sums_from_logits
from headscope.measures.rows import masked_std
from headscope.measures.writes import sink_value_ratios, write_norms
from headscope.model.masks import causal_visible_keys
from headscope.model.projection import head_grams

from helpers import tiny_model_folder
from planted import (
    FIRST,
    HEAD_DIM,
    LOUD,
    N_HEAD,
    POST_GAIN,
    POST_HIDDEN,
    PREVIOUS,
    UNIFORM,
    build_planted_gpt2,
    build_planted_post_norm,
)
from reference_writes import ROW_METRICS, corpus_means
from tolerances import UNIT, gamma


class SelfAttention(torch.nn.Module):
    """An attention module holding only an output projection, as headscope finds it in a model."""

    def __init__(self, projection: torch.nn.Module) -> None:
        super().__init__()
        self.o_proj = projection


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_write_norms_equal_each_heads_columns_times_its_output(kind):
    heads, head_dim, hidden = 3, 4, 10
    generator = torch.Generator().manual_seed(0)
    if kind == "linear":
        projection = torch.nn.Linear(heads * head_dim, hidden, bias=True)
        columns = projection.weight.detach()  # (hidden, heads * head_dim)
    else:  # GPT-2's: weight (in, out)
        projection = Conv1D(hidden, heads * head_dim)
        columns = projection.weight.detach().T
    output = torch.randn(2, 5, heads, head_dim, generator=generator)
    got = write_norms(output, head_grams(SelfAttention(projection), heads, head_dim))  # (batch, heads, t)
    for h in range(heads):
        block = columns[:, h * head_dim : (h + 1) * head_dim].double()
        want = torch.linalg.vector_norm(output[:, :, h].double() @ block.T, dim=-1)  # no bias: (batch, t)
        torch.testing.assert_close(got[:, h].double(), want, rtol=1e-5, atol=0)
    silent = write_norms(torch.zeros_like(output), head_grams(SelfAttention(projection), heads, head_dim))
    assert torch.equal(silent, torch.zeros(2, heads, 5))


@pytest.mark.parametrize("visibility", ["causal", "mask"])
def test_sink_value_ratio_divides_the_first_value_norm_by_the_mean_the_row_sees(visibility):
    value = torch.zeros(3, 1, 4, 2)  # (batch, kv_heads, t, head_dim); norms 1, 2, 3, 4 along each sentence
    value[..., 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # sentence 1 starts at position 1 (left padding), sentence 2 ends at position 2 (right padding)
    query_valid = torch.tensor([[True] * 4, [False, True, True, True], [True, True, True, False]])
    seq_start = torch.tensor([0, 1, 0])
    # Plain causal attention (no mask: running sums) and the same visibility given as a mask (a product) agree.
    masked = None if visibility == "causal" else lambda rows: causal_visible_keys(query_valid, rows)
    ratio, defined = sink_value_ratios(value, query_valid, seq_start, heads=2, visible_rows=masked)
    assert ratio.shape == (3, 2, 4)  # both query heads read the one KV head
    torch.testing.assert_close(ratio[0, 0, 1:], torch.tensor([1 / 1.5, 1 / 2.0, 1 / 2.5]))
    torch.testing.assert_close(ratio[1, 1, 2:], torch.tensor([2 / 2.5, 2 / 3.0]))
    torch.testing.assert_close(ratio[2, 0, 1:3], torch.tensor([1 / 1.5, 1 / 2.0]))
    assert defined[0, 0].tolist() == [False, True, True, True]  # row 0 sees only the first key
    assert defined[1, 0].tolist() == [False, False, True, True]  # padding, then the sentence's own first row
    assert defined[2, 0, :3].tolist() == [False, True, True]  # (the padding row after it is never counted)


def test_spreads_are_over_the_visible_keys_and_the_log_probabilities_give_the_logits_spread():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 6, 6, generator=generator) * 4 + 50  # a large mean costs no digits
    visible = torch.ones(6, 6).tril().bool()[None, None]
    want = np.array([[[np.std(logits[b, h, t, : t + 1].double().numpy()) for t in range(6)] for h in range(3)]
                     for b in range(2)])  # fmt: skip
    # float32: each deviation from the row's mean is off by at most the mean's error, gamma_n of the largest |logit|
    # (tests/support/tolerances.py), and its square and the sum round a few times more
    bound = (gamma(6) + 4 * UNIT) * float(logits.abs().max())
    np.testing.assert_allclose(masked_std(logits, visible).numpy(), want, rtol=0, atol=bound)
    # The eager path has only the probabilities; ln A differs from the logits by one number per row.
    masked = logits.masked_fill(~visible, torch.finfo(torch.float32).min)
    where = {"key_visible": visible, "query_valid": torch.ones(2, 6, dtype=torch.bool),
             "seq_start": torch.zeros(2, dtype=torch.long), "window": 1}  # fmt: skip
    from_probabilities = head_row_sums(torch.softmax(masked, -1), **where)[..., STAT_INDEX["logit_std"]]
    from_logits = head_row_sums_from_logits(masked, **where)[..., STAT_INDEX["logit_std"]]
    expected = torch.from_numpy(want[..., 1:].sum(-1))  # rows seeing >= 2 keys
    torch.testing.assert_close(from_logits, expected, rtol=0, atol=5 * bound)  # five rows summed
    # ln A: the float32 softmax's A within gamma_n + 3u of itself (its exponentials, sum and division), so ln A within
    # that, absolute; on top of the spread's own rounding of the largest |ln A|
    logs = torch.log(torch.softmax(masked, -1).clamp(min=torch.finfo(torch.float32).tiny))
    largest = float(logs.masked_fill(~visible, 0.0).abs().max())  # over the keys a row sees
    from_weights = 2 * (gamma(6) + 3 * UNIT) + (gamma(6) + 4 * UNIT) * largest
    torch.testing.assert_close(from_probabilities, expected, rtol=0, atol=5 * from_weights)


def test_off_sink_behaviour_follows_the_role_rules_order():
    roles, thresholds = RoleThresholds(), Thresholds()
    row = pd.Series({"offsink_prev_token": 0.71, "offsink_top_offset": "1", "offsink_top_offset_share": 0.9,
                     "offsink_norm_entropy": 0.2, "active_rows": 0.1})  # fmt: skip
    assert off_sink_behaviour(row, roles, thresholds) == ("previous-token", "0.71")
    row["offsink_prev_token"] = 0.1
    assert off_sink_behaviour(row, roles, thresholds)[0] == "positional"
    row["offsink_top_offset"], row["offsink_norm_entropy"] = "other", 0.8
    assert off_sink_behaviour(row, roles, thresholds) == ("broad", "norm entropy 0.80")
    row["offsink_norm_entropy"] = 0.5
    assert off_sink_behaviour(row, roles, thresholds)[0] == "mixed"


def test_dormant_comes_after_the_probe_roles_and_before_sink():
    heads = pd.DataFrame(
        {
            "probe_induction": [0.9, 0.0, 0.0, 0.0],
            "probe_induction_chance": 0.01,
            "probe_duplicate": 0.0,
            "probe_duplicate_chance": 0.01,
            "probe_previous": 0.0,
            "probe_previous_chance": 0.01,
            "prev_token": 0.0,
            "write_ratio": [0.001, 0.001, 0.5, np.nan],  # NaN (an old report): no evidence, not dormant
            "sink_rate": [1.0, 1.0, 1.0, 1.0],
            "top_offset": "first",
            "top_offset_share": 1.0,
            "norm_entropy": 0.1,
            "active_rows": 0.2,
            "offsink_prev_token": 0.8,
            "offsink_top_offset": "1",
            "offsink_top_offset_share": 0.8,
            "offsink_norm_entropy": 0.3,
        }
    )
    labelled = assign_roles(heads, RoleThresholds(), Thresholds())
    assert labelled["role"].tolist() == ["induction", "dormant", "sink", "sink"]
    assert labelled["role_reason"][1] == "write_ratio 0.0010 < 0.025; removal not verified"  # no removal check
    assert labelled["role_detail"][2] == "sink; off the sink: previous-token (0.80); active in 0.20 of rows"
    assert labelled["role_detail"][:2].isna().all()
    assert full_label(labelled).tolist() == ["induction", "dormant", "sink: previous-token", "sink: previous-token"]


@pytest.fixture(scope="module")
def writer(tmp_path_factory, corpus_lines):
    """The planted GPT-2 with its uniform head silent (zero value weights) and its first-token head looking, less
    strongly, at the previous token too (score 0.6 BETA there)."""
    return build_planted_gpt2(tmp_path_factory.mktemp("writer"), corpus_lines, silent=UNIFORM, then_previous=0.6)


@pytest.fixture(scope="module")
def writer_report(writer, corpus_lines):
    return headscope.analyze(str(writer), corpus_lines[:40], batch_size=7, probe_seeds=2, bootstrap=20)


def test_a_head_that_writes_nothing_is_dormant(writer_report):
    heads = writer_report.heads.set_index(["layer", "head"])
    silent = heads.loc[(0, UNIFORM)]
    assert silent["write_norm"] == 0.0 and silent["write_ratio"] == 0.0
    assert silent["role"] == "dormant" and silent["role_reason"] == "write_ratio 0.0000 < 0.025; removal verified"
    assert heads.loc[(0, PREVIOUS), "write_ratio"] > 0.1  # the others write


def test_a_sink_head_that_is_a_previous_token_head_off_the_sink_says_so(writer_report, writer, corpus_lines):
    head = writer_report.heads.set_index(["layer", "head"]).loc[(0, FIRST)]
    assert head["role"] == "sink"
    assert head["role_detail"].startswith("sink; off the sink: previous-token")
    assert head["offsink_top_offset"] == "1" and head["offsink_top_offset_share"] == 1.0
    # Off the sink, row t >= 2 gives e^(0.6 BETA) / (e^(0.6 BETA) + t - 1) to the previous token.
    lengths = writer_report.sentences["n_tokens"].tolist()
    rows = [math.exp(4.8) / (math.exp(4.8) + t - 1) for n in lengths for t in range(2, n)]
    assert head["offsink_prev_token"] == pytest.approx(np.mean(rows), rel=1e-5)


def test_off_sink_probe_scores_of_the_planted_sink_head(writer_report):
    """On the probe sequences (64 tokens, no prefix) the first-token head's previous-token score off the sink is
    the mean over rows t = 2..63 of e^(0.6 BETA) / (e^(0.6 BETA) + t - 1): row 1's previous token is the first."""
    head = writer_report.heads.set_index(["layer", "head"]).loc[(0, FIRST)]
    expected = np.mean([math.exp(4.8) / (math.exp(4.8) + t - 1) for t in range(2, 64)])
    assert head["probe_previous_offsink"] == pytest.approx(expected, rel=1e-5)
    assert head["probe_previous"] < 0.1  # with the sink, it hardly looks at the previous token


def test_planted_columns_equal_the_plain_computation(writer_report, writer, corpus_lines):
    from transformers import AutoTokenizer, GPT2Model

    model = GPT2Model.from_pretrained(writer, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(writer)
    sentences = [tokenizer(line)["input_ids"] for line in corpus_lines[:40]]
    expected = corpus_means(model, model.h, sentences, N_HEAD, N_HEAD, HEAD_DIM)
    assert_columns_equal(writer_report.heads, expected)


def assert_columns_equal(heads: pd.DataFrame, expected: dict, rows_apart: int = 0) -> None:
    """Every new column within 1e-5 (relative); the off-sink top-offset share within `rows_apart` rows (float32
    near ties: two keys off the sink within a rounding of each other)."""
    heads = heads.sort_values(["layer", "head"])
    for layer, columns in expected.items():
        got = heads[heads["layer"] == layer]
        for name in ROW_METRICS:
            np.testing.assert_allclose(got[name].to_numpy(float), columns[name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"layer {layer} {name}")  # fmt: skip
        share, want = got["offsink_top_offset_share"].to_numpy(float), columns["offsink_top_offset_share"]
        np.testing.assert_allclose(share, want, rtol=0, atol=(rows_apart + 1e-6) / columns["evidence_rows"])
        assert got["offsink_top_offset"].tolist() == columns["offsink_top_offset"].tolist(), layer


@pytest.mark.slow
def test_smollm2_columns_equal_the_plain_computation(smollm2, corpus_lines):
    """Five layers across the depth (the plain computation takes about 8 s a layer over the corpus)."""
    report = headscope.analyze(smollm2, corpus_lines, batch_size=16, probes=False, sentence_heads=False)
    model, tokenizer = smollm2.model, smollm2.tokenizer
    sentences = [tokenizer(line)["input_ids"] for line in corpus_lines]
    expected = corpus_means(model, model.layers, sentences, 9, 3, 64, only={0, 7, 17, 26, 29})
    assert_columns_equal(report.heads, expected, rows_apart=1)


@pytest.fixture(scope="module")
def post_norm_report(tmp_path_factory, corpus_lines):
    folder = build_planted_post_norm(tmp_path_factory.mktemp("post-norm"), corpus_lines)
    return headscope.analyze(str(folder), corpus_lines[:30], probe_seeds=2, bootstrap=0, charts=None)


def test_a_head_behind_a_post_attention_norm_writes_what_the_norm_adds(post_norm_report):
    """Before the norm head LOUD writes 1e-3 of a usual head; what the layer adds is POST_GAIN * o / rms(o), norm
    POST_GAIN * sqrt(hidden) = 16 on every row, all of it LOUD's. Measured before the norm it would be dormant."""
    heads = post_norm_report.heads.set_index(["layer", "head"])
    loud = heads.loc[(0, LOUD)]
    assert loud["write_norm"] == pytest.approx(POST_GAIN * math.sqrt(POST_HIDDEN), rel=1e-5)
    assert loud["write_ratio"] > 0.5 and loud["role"] != "dormant"
    quiet = heads.loc[0].drop(index=LOUD)
    assert (quiet["write_norm"] == 0).all() and (quiet["role"] == "dormant").all()
    path = post_norm_report.run["write_path"]
    assert list(path) == ["post-norm Gemma2RMSNorm, x 1 (seen in the residual stream)"] and path[next(iter(path))] == [
        0,
        1,
    ]


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3", "olmo2", "granite", "llama"])
@pytest.mark.first_case_fast
def test_what_reaches_the_residual_stream_equals_the_plain_computation(architecture, tmp_path, corpus_lines):
    """Post-attention norms (Gemma 2 and 3, OLMo 2), a scaled residual add (Granite's residual_multiplier) and the
    plain add (Llama): every column against tests/support/reference_writes.py, which writes each path out by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_class, config = tiny_architectures()[architecture]
    folder = tiny_model_folder(tmp_path, config, model_class, corpus_lines)
    report = headscope.analyze(str(folder), corpus_lines[:24], probes=False, bootstrap=0, charts=None)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sentences = [tokenizer(line)["input_ids"] for line in corpus_lines[:24]]
    expected = corpus_means(model, model.model.layers, sentences, 4, 2, 16)
    assert_columns_equal(report.heads, expected)


def tiny_architectures() -> dict:
    """name -> (model class, config): 2 layers of 4 heads on 2 KV heads, head_dim 16."""
    import transformers as t

    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 128}  # fmt: skip
    return {
        "gemma2": (t.Gemma2ForCausalLM, t.Gemma2Config(**shape, head_dim=16, sliding_window=64)),
        "gemma3": (t.Gemma3ForCausalLM, t.Gemma3TextConfig(**shape, head_dim=16, sliding_window=64)),
        "olmo2": (t.Olmo2ForCausalLM, t.Olmo2Config(**shape)),
        "granite": (t.GraniteForCausalLM, t.GraniteConfig(**shape, residual_multiplier=0.22)),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**shape)),
    }
