"""Window removal: a head's attention cut to the keys a streaming KV cache keeps (the sentence's first --sink and the
last --window), against an independent float64 computation per module (tests/support/reference_window.py)."""

from __future__ import annotations

import json

import pytest
import torch

import headscope
from headscope.errors import ConfigError
from headscope.interventions.removal import Window
from headscope.model.masks import streaming_keys

from helpers import assert_one_line_error, refuse_to_load, run_cli, tiny_lm_config, tiny_model_folder
from reference_window import windowed_loss

# float32 forward passes of two or three layers against float64 attention: rounding is ~1e-6 of a loss of ~5
CLOSE = 1e-4


def test_the_streaming_keys_are_the_first_sink_and_the_last_window_of_each_sentence():
    seq_start = torch.tensor([0, 2])  # the second sentence is left-padded by two
    keys = streaming_keys(seq_start, 6, sink=1, window=2)[:, 0]
    first = keys[0].int().tolist()
    # row t keeps key 0 (the sink) and t - 1, t; the causal part is the model's mask's job, not this one's
    assert first[5] == [1, 0, 0, 0, 1, 1] and first[2] == [1, 1, 1, 1, 1, 1]
    assert keys[1, 5].int().tolist() == [1, 1, 1, 0, 1, 1]  # the sink is the sentence's first real token, 2
    # no sink, a window of 1: each row keeps itself (and the later keys, which the causal mask hides)
    assert streaming_keys(seq_start, 4, sink=0, window=1)[0, 0].int().tolist() == torch.ones(4, 4).triu().int().tolist()


def test_a_window_is_whole_numbers_of_keys():
    with pytest.raises(ConfigError, match="--window takes"):
        Window(4, 0)
    with pytest.raises(ConfigError, match="--sink takes"):
        Window(-1, 8)


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2"])
def tiny_lm(request, tmp_path_factory, corpus_lines):
    """GPT-2, a grouped-KV Llama (8 query heads on 4 KV heads) and a grouped-KV Gemma 2 whose layer 0 attends in a
    sliding window of 4 keys (layer 1 fully), softcapped."""
    config, model_class = tiny_lm_config(request.param, 2, attn_logit_softcapping=3.0)
    folder = tiny_model_folder(tmp_path_factory.mktemp(request.param), config, model_class, corpus_lines)
    return request.param, headscope.load_model(str(folder), device="cpu", lm_head=True)


def sentences(loaded, corpus_lines, count: int = 6) -> list[str]:
    """Sentences of 10 tokens or more (where a window of 3 after a sink of 1 drops keys), of several lengths."""
    texts = [line for line in corpus_lines if len(loaded.tokenizer(line)["input_ids"]) >= 10]
    return texts[:count]


# (sink, window): a policy window narrower than Gemma 2's own (4), one wider (its sliding layer then keeps its own),
# and one without sinks
CASES = [(1, 3), (2, 6), (0, 2)]


@pytest.mark.parametrize(("sink", "window"), CASES)
@pytest.mark.first_case_fast
def test_window_removal_equals_the_masked_computation(tiny_lm, corpus_lines, sink, window):
    kind, loaded = tiny_lm
    texts = sentences(loaded, corpus_lines)
    ids = [loaded.tokenizer(text)["input_ids"] for text in texts]
    heads = 8 if kind != "gpt2" else 4
    # groups sharing each batch's clean pass: heads of both layers, a query head whose KV head is shared, and every
    # head (whose change is far beyond rounding: a windowing that did nothing would fail)
    groups = [[(0, 1), (1, 2), (1, heads - 1)], [(1, 0)], [(layer, head) for layer in (0, 1) for head in range(heads)]]
    found = headscope.ablate(loaded, texts, heads=groups, mode="window", sink=sink, window=window, bootstrap=0,
                             batch_size=4, padding_side="left")  # fmt: skip
    clean = windowed_loss(loaded.lm, ids, [], sink=sink, window=window)
    for group, effect in zip(groups, found.effects, strict=True):
        expected = windowed_loss(loaded.lm, ids, group, sink=sink, window=window)
        assert effect.clean_loss == pytest.approx(clean, abs=CLOSE)
        assert effect.ablated_loss == pytest.approx(expected, abs=CLOSE)
    assert abs(expected - clean) > 10 * CLOSE  # the window drops keys the heads attend to
    assert found.record["window"] == {"sink": sink, "size": window}


def test_window_removal_does_not_depend_on_batching_or_padding(tiny_lm, corpus_lines):
    _, loaded = tiny_lm
    texts = sentences(loaded, corpus_lines)
    options = {"heads": [[(0, 0), (1, 1)]], "mode": "window", "sink": 1, "window": 3, "bootstrap": 0}
    one = headscope.ablate(loaded, texts, batch_size=1, **options).effects[0]
    padded = headscope.ablate(loaded, texts[::-1], batch_size=4, padding_side="left", **options).effects[0]
    assert padded.ablated_loss == pytest.approx(one.ablated_loss, abs=CLOSE)


def test_a_window_wider_than_every_sentence_changes_nothing(tiny_lm, corpus_lines):
    _, loaded = tiny_lm
    texts = sentences(loaded, corpus_lines)
    found = headscope.ablate(loaded, texts, heads=[[(0, 0), (1, 1)]], mode="window", sink=0, window=10_000,
                             bootstrap=0)  # fmt: skip
    assert found.effects[0].delta == pytest.approx(0.0, abs=1e-6)


def test_the_window_options_reach_the_run_and_are_refused_with_another_mode(tmp_path, planted_gpt2, corpus):
    out = tmp_path / "ablated"
    result = run_cli("ablate", str(planted_gpt2), "--corpus", str(corpus), "--heads", "0.0", "--mode", "window",
                     "--window", "2", "--sink", "1", "--out", str(out), "--bootstrap", "0")  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((out / "ablation.json").read_text())
    assert record["mode"] == "window" and record["window"] == {"sink": 1, "size": 2}
    refused = run_cli("ablate", str(planted_gpt2), "--corpus", str(corpus), "--heads", "0.0", "--window", "2",
                      loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(refused, "--window", "--mode window", code=2)
    refused = run_cli("ablate", str(planted_gpt2), "--corpus", str(corpus), "--heads", "0.0", "--mode", "window",
                      "--window", "0", loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(refused, "--window takes", code=2)
