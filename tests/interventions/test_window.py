"""Window removal: a head's attention cut to the keys a streaming KV cache keeps (the sentence's first --sink and the
last --window), against an independent float64 computation per module (tests/support/reference_window.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import headscope
from headscope.errors import ConfigError
from headscope.interventions.kv_policy import cache_bytes, kv_heads_freed, kv_policy
from headscope.interventions.removal import OutputSums, Removal, Window
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


@pytest.mark.first_case_fast
def test_window_removal_does_not_depend_on_batching_or_padding(tiny_lm, corpus_lines):
    _, loaded = tiny_lm
    texts = sentences(loaded, corpus_lines)
    options = {"heads": [[(0, 0), (1, 1)]], "mode": "window", "sink": 1, "window": 3, "bootstrap": 0}
    one = headscope.ablate(loaded, texts, batch_size=1, **options).effects[0]
    padded = headscope.ablate(loaded, texts[::-1], batch_size=4, padding_side="left", **options).effects[0]
    assert padded.ablated_loss == pytest.approx(one.ablated_loss, abs=CLOSE)


@pytest.mark.first_case_fast
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
    assert "heads windowed together (the first 1 keys and the last 2)" in " ".join(result.output.split())
    refused = run_cli("ablate", str(planted_gpt2), "--corpus", str(corpus), "--heads", "0.0", "--window", "2",
                      loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(refused, "--window", "--mode window", code=2)
    refused = run_cli("ablate", str(planted_gpt2), "--corpus", str(corpus), "--heads", "0.0", "--mode", "window",
                      "--window", "0", loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(refused, "--window takes", code=2)


def test_the_window_estimate_sums_the_change_to_the_windowed_output_along_the_gradient():
    """OutputSums(window=...) asks the capture for each head's windowed output w (attend_within, under the window's
    keys) and sums (w - o) . dL/do over real positions, and ((w - o) . dL/do)^2 for the curvature. A loss linear in
    the outputs, L = sum c . o, has dL/do = c: a known gradient."""
    rng = np.random.default_rng(5)
    outputs = torch.tensor(rng.normal(size=(2, 3, 2, 4)), requires_grad=True)  # (batch, t, heads, head_dim)
    windowed = torch.tensor(rng.normal(size=(2, 3, 2, 4)))
    c = torch.tensor(rng.normal(size=(2, 3, 2, 4)))
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # the second sentence padded on the left
    window = Window(sink=1, size=1)
    removal = Removal("window", window=window)
    sums = OutputSums([0], 2, 4, grad=True, curvature_of=removal, window=window)
    sums.start(SimpleNamespace(attention_mask=mask))
    asked = []

    def attend_within(sink, size):
        asked.append((sink, size))
        return windowed

    kept = sums.masked_output(0, outputs.clone(), attend_within)
    (kept * c).sum().backward()
    sums.collect()
    assert asked == [(window.sink, window.size)]  # the window reached the capture
    o, w, g = outputs.detach().numpy(), windowed.numpy(), c.numpy()
    real = list(zip(*np.nonzero(mask.numpy()), strict=True))
    change = sum(((w[b, t] - o[b, t]) * g[b, t]).sum(-1) for b, t in real)
    squared = sum((((w[b, t] - o[b, t]) * g[b, t]).sum(-1)) ** 2 for b, t in real)
    np.testing.assert_allclose(removal.estimate(sums, 4)[0], change / 4, rtol=1e-12)
    np.testing.assert_allclose(removal.curvature(sums, 4)[0], squared / 8, rtol=1e-12)
    with pytest.raises(ValueError, match="did not record"):
        Removal("window", window=Window(2, 1)).estimate(sums, 4)  # another window's change


@pytest.mark.slow  # a search: a gradient pass and verifications on three models
def test_prune_in_window_mode_verifies_what_the_masked_computation_gives(tiny_lm, corpus_lines, tmp_path):
    _, loaded = tiny_lm
    texts = sentences(loaded, corpus_lines, count=8)
    ids = [loaded.tokenizer(text)["input_ids"] for text in texts]
    found = headscope.prune(loaded, texts, budget=0.02, mode="window", sink=1, window=3, out=tmp_path / "pruned",
                            charts=None)  # fmt: skip
    heads = found.result.heads
    assert heads, "a budget of 0.02 nats windows some head of a random model"
    assert found.result.loss == pytest.approx(windowed_loss(loaded.lm, ids, heads, sink=1, window=3), abs=CLOSE)
    assert found.result.clean_loss == pytest.approx(windowed_loss(loaded.lm, ids, [], sink=1, window=3), abs=CLOSE)
    record = json.loads((tmp_path / "pruned" / "prune.json").read_text())
    assert record["mode"] == "window" and record["window"] == {"sink": 1, "size": 3}
    policy = json.loads((tmp_path / "pruned" / "kv-policy.json").read_text())
    in_policy = {(entry["layer"], head) for entry in policy["layers"] for head, kept in enumerate(entry["heads"])
                 if kept != "full"}  # fmt: skip
    assert in_policy == set(heads) and policy["loss"]["verified"] == found.result.loss
    assert policy["memory"]["longest_text"]["tokens"] == max(map(len, ids))


def test_prune_refuses_to_save_windowed_heads_into_weights(planted_gpt2, corpus, tmp_path):
    refused = run_cli("prune", str(planted_gpt2), "--corpus", str(corpus), "--budget", "0.1", "--mode", "window",
                      "--save-model", str(tmp_path / "saved"), loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(refused, "--save-model", "KV-cache policy", code=2)
    assert not (tmp_path / "saved").exists()


def test_a_kv_head_is_freed_only_when_every_query_head_reading_it_is_windowed():
    windowed = [(0, 0), (0, 1), (0, 2), (1, 3)]  # 4 query heads on 2 KV heads: KV head k serves 2k and 2k + 1
    assert kv_heads_freed(windowed, depth=2, heads=4, kv_heads=2) == [[True, False], [False, False]]
    window, per_token = Window(sink=4, size=8), 2 * 2 * 4  # key and value, head_dim 2, float32
    freed = [[True, False], [False, False]]
    # full: 4 KV heads x 100 tokens; the policy: the freed head keeps 4 + 8
    assert cache_bytes(freed, 100, window, [None, None], per_token) == (400 * 16, (12 + 300) * 16)
    # layer 1 windowed by the model itself at 50 keys: both count it at 50
    assert cache_bytes(freed, 100, window, [None, 50], per_token) == (300 * 16, (12 + 100 + 100) * 16)
    assert cache_bytes(freed, 10, window, [None, None], per_token) == (40 * 16, 40 * 16)  # shorter than the window
    policy = kv_policy(windowed, depth=2, heads=4, kv_heads=2, head_dim=2, dtype_bytes=4, own_windows=[None, None],
                       window=window, lengths={"longest_text": 100})  # fmt: skip
    assert policy["layers"][0]["heads"] == [{"sink": 4, "window": 8}] * 3 + ["full"]
    assert policy["layers"][0]["kv_heads"] == ["windowed", "full"] and policy["layers"][1]["kv_heads"] == ["full"] * 2
    assert policy["query_heads"] == {"windowed": 4, "total": 8, "share": 0.5}
    assert policy["kv_heads"] == {"windowed": 1, "total": 4, "share": 0.25}
    assert policy["memory"]["longest_text"]["freed_share"] == pytest.approx(1 - 312 / 400)


@pytest.mark.slow  # a whole CLI search
def test_prune_in_window_mode_says_what_the_policy_frees(planted_gpt2, corpus, tmp_path):
    out = tmp_path / "pruned"
    result = run_cli("prune", str(planted_gpt2), "--corpus", str(corpus), "--budget", "0.5", "--mode", "window",
                     "--window", "2", "--sink", "1", "--max-rounds", "1", "--out", str(out))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (out / "prune_curve.png").is_file() and (out / "streaming_heads.png").is_file()
    said = " ".join(result.output.split())
    policy = json.loads((out / "kv-policy.json").read_text())
    kv = policy["kv_heads"]
    assert f"KV heads whose cache can shrink: {kv['windowed']} of {kv['total']}" in said
    assert "to the first 1 keys and the last 2" in said and "kv-policy.json" in said


def test_window_removal_on_smollm2_and_long_texts_equals_the_masked_computation(smollm2, shipped_corpus):
    """The real grouped-KV model (9 query heads on 3 KV heads) on two shipped long texts, cut to 192 tokens so that a
    window of 16 after 2 sinks drops most keys: a whole KV group windowed, and two induction heads."""
    long_texts = shipped_corpus.parent / "long-texts.txt"
    texts = long_texts.read_text(encoding="utf-8").splitlines()[:2]
    ids = [smollm2.tokenizer(text, truncation=True, max_length=192)["input_ids"] for text in texts]
    groups = [[(0, 0), (0, 1), (0, 2)], [(17, 3), (18, 6)]]
    found = headscope.ablate(smollm2, texts, heads=groups, mode="window", sink=2, window=16, max_length=192,
                             bootstrap=0)  # fmt: skip
    clean = windowed_loss(smollm2.lm, ids, [], sink=2, window=16)
    for group, effect in zip(groups, found.effects, strict=True):
        assert effect.tokens == sum(len(row) - 1 for row in ids)
        assert effect.clean_loss == pytest.approx(clean, abs=CLOSE)
        assert effect.ablated_loss == pytest.approx(windowed_loss(smollm2.lm, ids, group, sink=2, window=16), abs=CLOSE)
    assert found.effects[1].delta > 10 * CLOSE  # induction heads read far back: windowing them costs


@pytest.mark.parametrize("block_bytes", [None, 1024])  # the model's own probabilities; the fused pass's row blocks
@pytest.mark.first_case_fast
def test_far_mass_is_the_mass_a_window_drops_in_the_models_own_attention(tiny_lm, corpus_lines, block_bytes):
    """analyze's far_mass on GPT-2, the grouped-KV Llama and Gemma 2 (layer 0 in a sliding window of 4 keys, softcapped)
    against the model's own eager attention, one sentence at a time in float64: over the rows t >= S + W that see a
    key s >= S with t - s >= W, the mean of their mass there. On Gemma's sliding layer a row sees far keys only inside
    its own window, and a row that sees none is not counted. far_mass is read from the keys it keeps (1 less their
    mass): float32's bound for a row's sum of at most n probabilities is n * 2^-24 each way."""
    _, loaded = tiny_lm
    texts = sentences(loaded, corpus_lines)
    sink, window = 1, 3
    sized = {} if block_bytes is None else {"block_bytes": block_bytes}
    report = headscope.analyze(loaded, texts, stream_sink=sink, stream_window=window, bootstrap=0, probes=False,
                               charts=None, page=False, **sized)  # fmt: skip
    paths = " ".join(report.run["attention_implementation"].values())
    assert ("fused" in paths) == (block_bytes is not None), paths
    far_sum, rows, longest = None, None, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([loaded.tokenizer(text)["input_ids"]])
            n = ids.shape[1]
            longest = max(longest, n)
            t, s = torch.arange(n)[:, None], torch.arange(n)[None, :]
            far = (s >= sink) & (t - s >= window)  # (n, n)
            attention = torch.stack(loaded.model(ids, output_attentions=True).attentions)[:, 0].double()
            seen = far & (attention > 0)  # (layers, heads, n, n): softcapped or small scores never underflow
            counted = seen.any(-1)  # (layers, heads, n)
            mass = torch.where(counted, (attention * far).sum(-1), 0.0).sum(-1)
            far_sum = mass if far_sum is None else far_sum + mass
            rows = counted.sum(-1) if rows is None else rows + counted.sum(-1)
    expected = (far_sum / rows).numpy()
    got = report.heads.pivot(index="layer", columns="head", values="far_mass").to_numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=2 * longest * 2**-24)
    assert np.ptp(expected) > 0.05  # heads differ: a far_mass of any constant would fail
