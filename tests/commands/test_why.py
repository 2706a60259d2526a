"""inspect --why: a head's attention logit split into (query sender, key sender) pairs. The maths on hand-built
tensors, a planted induction circuit whose answer is known, a plain float64 computation by module name on GPT-2, a
grouped-KV Llama and a Gemma 2 (post-attention norms, softcap, sliding window), the real SmolLM2 against the model's
own attention, and the refusals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import headscope
from headscope.commands import why_rows
from headscope.errors import ConfigError
from headscope.interventions.qk_terms import row_terms, strongest_key

from helpers import assert_one_line_error, refuse_to_load, run_cli, tiny_lm_config, tiny_model_folder
from planted import build_planted_induction
from reference_qk import split_by_hand

SPLIT = 1e-5  # the terms against the float64 computation, relative to the largest: float32 passes against float64


def test_the_terms_add_up_to_the_logit_and_the_contrasts_to_its_lead_over_the_other_keys():
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(4, 8, generator=generator, dtype=torch.float64)  # 4 senders, head_dim 8
    keys = torch.randn(4, 5, 8, generator=generator, dtype=torch.float64)  # 4 senders, 5 visible keys
    scaling = 8**-0.5
    logits = scaling * queries.sum(0) @ keys.sum(0).T
    attention = torch.softmax(logits, -1)
    found = row_terms(queries, keys, attention, 3, scaling=scaling, row=7, key=9)
    assert (found.row, found.key) == (7, 9) and found.term.shape == found.contrast.shape == (4, 4)
    assert found.term.sum() == pytest.approx(float(logits[3])) and found.logit == pytest.approx(float(logits[3]))
    others = attention.clone()
    others[3] = 0
    lead = float(logits[3] - (others / others.sum()) @ logits)
    assert found.contrast.sum() == pytest.approx(lead) and found.worst_error < 1e-15
    # one pair by hand: sender 1's query against sender 2's key
    assert found.term[1, 2] == pytest.approx(scaling * float(queries[1] @ keys[2, 3]))
    assert found.weight == pytest.approx(float(attention[3]))


def test_a_softcap_scales_every_term_of_a_key_by_its_secant():
    generator = torch.Generator().manual_seed(1)
    queries = 3 * torch.randn(3, 4, generator=generator, dtype=torch.float64)
    keys = 3 * torch.randn(3, 6, 4, generator=generator, dtype=torch.float64)
    raw = queries.sum(0) @ keys.sum(0).T
    capped = 2.0 * torch.tanh(raw / 2.0)
    found = row_terms(queries, keys, torch.softmax(capped, -1), 2, scaling=1.0, softcap=2.0)
    assert found.term.sum() == pytest.approx(float(capped[2])) and found.worst_error < 1e-12
    unscaled = row_terms(queries, keys, torch.softmax(raw, -1), 2, scaling=1.0)
    assert np.allclose(found.term, unscaled.term * float(capped[2] / raw[2]))


def test_a_row_that_sees_one_key_contrasts_with_nothing_and_the_first_token_is_passed_over():
    queries, keys = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 1, 3, dtype=torch.float64)
    alone = row_terms(queries, keys, torch.ones(1), 0, scaling=1.0)
    assert np.array_equal(alone.contrast, alone.term)
    weights, positions = torch.tensor([0.7, 0.1, 0.2]), torch.tensor([0, 1, 2])
    assert strongest_key(weights, positions) == 2  # the sink at position 0 is not the key a row is explained by
    assert strongest_key(torch.tensor([1.0]), torch.tensor([0])) == 0
    assert strongest_key(torch.tensor([0.5, 0.5]), torch.tensor([3, 4])) == 0  # a window past the first token


def test_the_planted_induction_head_matches_through_the_previous_token_head(tmp_path):
    """Layer 1's induction head: its query is the current token (embed), its key the token before each key, which
    layer 0's previous-token head (0.0) writes. The whole contrast of a repeat's row sits on (embed, 0.0)."""
    folder = build_planted_induction(tmp_path / "induction")
    # no BOS: row 0's previous-token head sees only itself, so the first token must not repeat. Row 5 repeats w5:
    # it attends to row 2, the token after the first w5; row 6 repeats w9 and attends to row 3
    text = "w3 w5 w9 w12 w20 w5 w9"
    found = headscope.inspect(str(folder), texts=[text], heads=[(1, 0)], why=["5", "6"], page=False, device="cpu")
    for row, key in ((5, 2), (6, 3)):
        pairs = found.why(row)
        assert (pairs["key"] == key).all()
        top = pairs.iloc[0]
        assert (top.query_sender, top.key_sender) == ("embed", "0.0"), pairs.head(3)
        assert top.contrast > 0.99 * pairs["contrast"].sum() and top.contrast > 5
    entry = found.record["why"]["rows"][0]
    assert entry["query_side"][0][0] == "embed" and entry["key_side"][0][0] == "0.0" and entry["weight"] > 0.99
    assert found.why_heads["k_composition_prev"].isna().all()  # no report, no probes: no roles to read


def test_the_means_over_rows_and_k_composition_read_the_roles(tmp_path):
    """--role induction picks the planted induction head by the probes, which also name 0.0 previous-token: its
    whole key side comes through 0.0 (k_composition_prev 1). The means per pair and per side are the rows'
    contrasts averaged, as inspect.json's head entry and the library's mean_contrast both give them."""
    folder = build_planted_induction(tmp_path / "induction")
    text = "w3 w5 w9 w12 w20 w5 w9"
    found = headscope.inspect(str(folder), texts=[text], roles=["induction"], why=["5-6"], page=False,
                              device="cpu")  # fmt: skip
    assert found.roles == {"1.0": "induction"}
    (head,) = found.why_heads.to_dict("records")
    assert (head["layer"], head["head"], head["role"], head["rows"]) == (1, 0, "induction", 2)
    assert head["k_composition_prev"] == pytest.approx(1.0, abs=1e-6)
    rows = [found.why(row) for row in (5, 6)]
    by_pair = found.mean_contrast("pair")
    top = by_pair.iloc[0]
    assert (top.query_sender, top.key_sender, top.rows) == ("embed", "0.0", 2)
    want = np.mean([r.set_index(["query_sender", "key_sender"]).loc[("embed", "0.0"), "contrast"] for r in rows])
    assert top.contrast == pytest.approx(want, rel=1e-12) and head["pairs"][0][2] == pytest.approx(want, abs=1e-6)
    by_key = found.mean_contrast("key", head="1.0").set_index("key_sender")["contrast"]
    assert by_key["0.0"] == pytest.approx(want, rel=1e-12)
    assert by_key.sum() == pytest.approx(head["contrast"], rel=1e-9)  # the sides add up to the mean contrast
    assert found.mean_contrast("query", text_id=0)["contrast"].sum() == pytest.approx(head["contrast"], rel=1e-9)
    with pytest.raises(ConfigError, match="by takes pair, query, key"):
        found.mean_contrast("sender")


def test_k_composition_is_the_key_sides_share_from_previous_token_heads():
    contrast = np.array([[1.0, 3.0, 0.0], [0.5, 1.0, -0.5], [0.0, 0.0, 0.0]])  # query senders x key senders
    names = ["embed", "0.0", "0.1"]  # key sides 1.5, 4, -0.5: the pushes for the key 1.5 + 4
    assert why_rows.k_composition(contrast, names, {"0.0"}) == pytest.approx(4.0 / 5.5)
    assert why_rows.k_composition(contrast, names, {"0.0", "0.1"}) == pytest.approx(4.0 / 5.5)  # 0.1 pushes against
    assert why_rows.k_composition(contrast, names, {"embed", "0.0"}) == pytest.approx(1.0)
    assert why_rows.k_composition(contrast, names, set()) == 0.0
    assert why_rows.k_composition(-np.abs(contrast), names, {"0.0"}) is None  # nothing pushes the key up


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2"])
def tiny_lm(request, tmp_path_factory, corpus_lines):
    """GPT-2 (biases, a fused q|k|v projection, learned positions), a grouped-KV Llama (RoPE, 8 query heads on 4 KV
    heads) or a grouped-KV Gemma 2 (post-attention norms, (1 + w) RMS norms, a softcap, a sliding window of 4)."""
    config, model_class = tiny_lm_config(request.param, 3, attn_logit_softcapping=3.0)
    folder = tiny_model_folder(tmp_path_factory.mktemp(request.param), config, model_class, corpus_lines)
    return request.param, headscope.load_model(str(folder), device="cpu", lm_head=True)


@pytest.mark.first_case_fast
def test_every_term_equals_the_plain_computation_by_module_name(tiny_lm, corpus_lines):
    name, loaded = tiny_lm
    text = " ".join(corpus_lines[:3])
    ids = loaded.tokenizer(text)["input_ids"][:12]
    text = loaded.tokenizer.decode(ids)
    ids = loaded.tokenizer(text)["input_ids"]
    # layer 2, a head reading the second KV head; layer 0 (Gemma 2's sliding layer): a row past the window
    asked = [(2, 5 if name != "gpt2" else 3, len(ids) - 1), (0, 1, len(ids) - 1)]
    for layer, head, row in asked:
        found = headscope.inspect(loaded, texts=[text], heads=[(layer, head)], why=[str(row)], page=False)
        pairs = found.why(row)
        key = int(pairs["key"].iloc[0])
        want = split_by_hand(loaded.lm, ids, layer, head, row, key)
        index = {sender: i for i, sender in enumerate(want["names"])}
        assert set(pairs["query_sender"]) == set(index)
        at = (pairs["query_sender"].map(index).to_numpy(), pairs["key_sender"].map(index).to_numpy())
        scale = float(want["term"].abs().max())
        assert np.abs(pairs["term"].to_numpy() - want["term"].numpy()[at]).max() < SPLIT * scale, (name, layer)
        assert np.abs(pairs["contrast"].to_numpy() - want["contrast"].numpy()[at]).max() < SPLIT * scale
        entry = found.record["why"]["rows"][0]
        assert entry["logit"] == pytest.approx(float(want["logits"][want["keys"].index(key)]), abs=SPLIT * scale)
        assert entry["softmax_error"] < 1e-5 and scale > 0.05  # terms large enough for an error to show
        if name == "gemma2" and layer == 0:
            assert min(want["keys"]) == row - 3  # the window: the row sees its last 4 keys


@pytest.mark.slow
def test_smollm2_rows_add_up_to_its_own_attention(smollm2):
    """SmolLM2 (RoPE, 9 query heads on 3 KV heads, RMS norms): for every row of a text, the split logits' softmax is
    the model's attention (each row's check), and the terms add up to the logit."""
    text = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat again."
    found = headscope.inspect(smollm2, texts=[text], heads=[(18, 3)], why=["all"], page=False)
    rows = found.record["why"]["rows"]
    assert len(rows) == len(found.tokens) and max(entry["softmax_error"] for entry in rows) < 1e-5
    sums = found.qk.groupby("row")["term"].sum()
    logits = {entry["row"]: entry["logit"] for entry in rows}
    assert max(abs(sums[row] - logits[row]) for row in logits) < 1e-9
    assert found.qk.groupby("row").size().unique().tolist() == [182**2]  # embed, 18 x 9 heads, 18 MLPs, bias


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--why", "5"], ["--why explains chosen heads"]),
        (["--heads", "1.0", "--why", "5:9"], ["key 9 comes after row 5"]),
        (["--heads", "1.0", "--why", "five"], ["--why takes ROW, FIRST-LAST, ROW:KEY", "'five'"]),
        (["--heads", "1.0", "--why", "9-3"], ["FIRST-LAST", "'9-3'"]),
        (["--heads", "1.0", "--why", "exemplars"], ["--why exemplars", "--exemplars"]),
    ],
    ids=["no-heads", "key-after-row", "not-a-row", "backward-range", "exemplars-alone"],
)
def test_a_bad_why_is_refused_in_one_line_before_the_model_loads(tmp_path, extra, fragments):
    result = run_cli("inspect", "gpt2", "--text", "a b c", *extra, "--out", tmp_path / "out", loader=refuse_to_load)
    assert_one_line_error(result, *fragments, code=2)


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--heads", "1.0", "--why", "7"], ["--why 7", "3 tokens", "rows 0-2"]),
        (["--heads", "2.0", "--why", "1"], ["--heads names 2.0", "layers 0-1"]),
        (["--heads", "1.5", "--why", "1"], ["--heads names 1.5", "heads 0-"]),
    ],
    ids=["row-past-the-text", "layer-out-of-range", "head-out-of-range"],
)
def test_what_the_tokenizer_and_config_refuse_comes_before_the_weights(tmp_path, extra, fragments):
    folder = build_planted_induction(tmp_path / "induction")
    result = run_cli("inspect", str(folder), "--text", "w5 w9 w12", *extra, "--out", tmp_path / "out",
                     loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(result, *fragments, code=2)
    assert not (tmp_path / "out").exists()


def test_a_key_outside_the_layers_sliding_window_is_refused_before_the_weights(tmp_path, corpus_lines):
    """Gemma 2's layer 0 slides over 4 keys: row 7 sees keys 4-7, so 7:3 is refused before loading, 7:4 is not
    (that run goes on to the refusing loader), and layer 1 (full attention) sees 7:0."""
    config, model_class = tiny_lm_config("gemma2", 2)
    folder = tiny_model_folder(tmp_path / "gemma2", config, model_class, corpus_lines)
    text = " ".join(" ".join(corpus_lines).split()[:16])

    def run(head: str, why: str):
        return run_cli("inspect", str(folder), "--text", text, "--heads", head, "--why", why, "--out",
                       tmp_path / "out", loader=refuse_to_load)  # fmt: skip

    assert_one_line_error(run("0.1", "7:3"), "--why 7:3", "layer 0", "sliding window of 4", "key 3", code=2)
    for head, why in (("0.1", "7:4"), ("1.1", "7:0")):
        assert isinstance(run(head, why).exception, AssertionError)  # got as far as loading the weights


def test_a_chunk_and_a_window_bound_the_keys_a_row_sees():
    why_rows.check_windows(why_rows.as_why("9:8"), [(0, 0)], (("chunked", 8),))  # 8 and 9 share the chunk 8-15
    with pytest.raises(ConfigError, match="chunks of 8"):
        why_rows.check_windows(why_rows.as_why("9:7"), [(0, 0)], (("chunked", 8),))
    why_rows.check_windows(why_rows.as_why("9:0"), [(0, 0)], (("full", None),))


def test_a_split_beyond_the_memory_budget_is_refused_before_any_pass(tmp_path):
    """--why keeps the pass's tensors up to the head's layer and each sender's query and key parts: a budget that
    holds the attention but not the split refuses --why in one line, and the same run without it goes through."""
    from transformers import AutoConfig

    from headscope.commands.why_rows import split_bytes
    from headscope.model.architecture import architecture_of

    folder = build_planted_induction(tmp_path / "induction")
    text = " ".join(f"w{2 + i % 38}" for i in range(70))
    config = AutoConfig.from_pretrained(folder)
    needed = split_bytes([(1, 0)], 70, architecture_of(config), config.hidden_size, 4)
    budget = f"{needed // 2}B"
    options = ("inspect", str(folder), "--text", text, "--heads", "1.0", "--max-memory", budget)
    result = run_cli(*options, "--why", "69", "--out", tmp_path / "why")
    assert_one_line_error(result, "--why on a text of 70 tokens", "budget", "--max-memory")
    assert not (tmp_path / "why").exists()
    assert run_cli(*options, "--out", tmp_path / "plain").exit_code == 0


def test_the_pages_matrix_keeps_the_strongest_senders_and_sums_the_rest_exactly():
    from headscope.report.inspect_page import why_matrix

    rng = np.random.default_rng(0)
    contrast = rng.normal(size=(7, 7))
    contrast[2, 5] = 40.0  # query sender c, key sender f: the strongest on both sides
    names = list("abcdefg")
    shown = why_matrix(names, contrast, shown=3)
    assert shown["query"][0] == "c" and shown["keys"][0] == "f" and shown["contrast"][0][0] > 39
    assert shown["query"][-1] == "others (4)" and shown["keys"][-1] == "others (4)" and len(shown["query"]) == 4
    np.testing.assert_allclose(shown["total"], contrast.sum(), rtol=1e-12)
    np.testing.assert_allclose(sum(shown["query_side"]), contrast.sum(), rtol=1e-4)  # the margins stay exact
    by_name = dict(zip(shown["keys"], shown["key_side"], strict=True))
    np.testing.assert_allclose(by_name["f"], contrast[:, 5].sum(), rtol=1e-4)
    whole = why_matrix(names, contrast, shown=7)  # every sender by name: nothing summed
    np.testing.assert_allclose(
        whole["contrast"],
        contrast[np.ix_([names.index(n) for n in whole["query"]], [names.index(n) for n in whole["keys"]])],
        rtol=1e-4,
    )


def test_the_heads_a_k_edge_feeds_are_every_query_head_of_its_kv_head():
    from headscope.commands.circuit_why import explained_heads

    edges = pd.DataFrame({"receiver": ["logits", "1.kv1", "0.3", "1.2", "0.kv0"], "channel": [None, "k", "q", "v", "k"],
                          "score": [9.0, -5.0, 4.0, 3.0, 0.1]})  # fmt: skip
    assert explained_heads(edges, 2, heads=8, kv_heads=4) == [(0, 3), (1, 2), (1, 3)]  # kv1 of 4: heads 2 and 3
    assert explained_heads(edges, 3, heads=8, kv_heads=4) == [(0, 0), (0, 1), (0, 3), (1, 2), (1, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_circuit_why_is_inspect_why_at_end_averaged_over_pairs(tmp_path, corpus_lines, kind):
    """circuit --why on a grouped-KV Llama and a Gemma 2 (post-attention norms, softcap, a sliding window of 4 that
    END's keys stay within): for each explained head and role, the clean and corrupt figures are the mean over pairs
    of what inspect --why END:ROLE gives on each prompt alone (weights, and each sender's side of the contrast), and
    change is clean - corrupt."""
    config, model_class = tiny_lm_config(kind, 2, attn_logit_softcapping=3.0)
    folder = tiny_model_folder(tmp_path / kind, config, model_class, corpus_lines)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    w = [word for word in loaded.tokenizer.get_vocab() if word.isalpha()][:9]
    records = [{"clean": f"{w[i]} [[A:{w[3]}]] {w[4 + i]} [[B:{w[i]}]] {w[5]}", "answer": w[6], "distractor": w[7],
                "corrupt": f"{w[8]} {w[3]} {w[4 + i]} {w[2]} {w[5]}"} for i in range(3)]  # fmt: skip
    found = headscope.circuit(loaded, records, method="eap", verify=0, curve=False, why=2, bootstrap=0, charts=None)
    heads = [tuple(map(int, name.split("."))) for name in found.record["why"]["heads"]]
    assert heads and set(found.why["role"]) == {"A", "B"}
    for layer, head in heads:
        for role in ("A", "B"):
            want = {"clean": [], "corrupt": []}
            weights = {"clean": [], "corrupt": []}
            for record in records:
                for run in ("clean", "corrupt"):
                    text = record[run].replace("[[A:", "").replace("[[B:", "").replace("]]", "")
                    end = len(loaded.tokenizer(text)["input_ids"]) - 1
                    at = end - (3 if role == "A" else 1)
                    seen = headscope.inspect(loaded, texts=[text], heads=[(layer, head)], why=[f"{end}:{at}"],
                                             page=False)  # fmt: skip
                    want[run].append(seen.mean_contrast("key").set_index("key_sender")["contrast"])
                    weights[run].append(seen.record["why"]["rows"][0]["weight"])
            got = found.why[(found.why["layer"] == layer) & (found.why["head"] == head) & (found.why["role"] == role)
                            & (found.why["side"] == "key")].set_index("sender")  # fmt: skip
            for run in ("clean", "corrupt"):
                # each run's float32 pass (MKL's sgemm rounds alike only for alike memory): SPLIT of the largest
                mean = pd.concat(want[run], axis=1).mean(axis=1)
                np.testing.assert_allclose(got.loc[mean.index, run], mean, atol=SPLIT * mean.abs().max())
            np.testing.assert_allclose(got["change"], got["clean"] - got["corrupt"])
            rows = found.record["why"]["rows"]
            (entry,) = [e for e in rows if (e["layer"], e["head"], e["role"]) == (layer, head, role)]
            for run in ("clean", "corrupt"):  # float32 weights of ~1: a few units of its 6e-8 apart from pass to pass
                assert entry["weight"][run] == pytest.approx(np.mean(weights[run]), abs=1e-6)


def test_circuit_why_needs_pairs_that_mark_roles(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"clean": "w5 w9 w12", "corrupt": "w5 w9 w20", "answer": "w3", "distractor": "w4"}\n')
    folder = build_planted_induction(tmp_path / "induction")
    result = run_cli("circuit", str(folder), "--pairs", pairs, "--why", "3", "--out", tmp_path / "out",
                     loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(result, "--why", "mark roles", "[[IO:Mary]]", code=2)
    result = run_cli("circuit", str(folder), "--pairs", pairs, "--why", "-1", loader=refuse_to_load)
    assert_one_line_error(result, "--why", "0 or more", code=2)
