"""headscope inspect: chosen heads' whole attention on chosen texts, against the model's own numbers."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

import headscope
from headscope.config import RoleThresholds
from headscope.errors import ConfigError
from headscope.layout import ATTENTION_FILE, INSPECT_PAGE, INSPECT_RECORD, TOKENS_FILE
from headscope.measures.probes import ProbeSpec, probe_inputs

from helpers import assert_one_line_error, run_cli, run_measuring_script, tiny_llama
from planted import FIRST, PREVIOUS, UNIFORM, build_planted_induction, expected_attention
from reference import probe_scores


def matrix(attention: pd.DataFrame, text_id: int, layer: int, head: int) -> np.ndarray:
    """One head's (t, t) attention on one text from attention.parquet's rows (0 where a key is not visible)."""
    rows = attention[(attention["text_id"] == text_id) & (attention["layer"] == layer) & (attention["head"] == head)]
    t = int(rows["query"].max()) + 1
    out = np.zeros((t, t))
    out[rows["query"], rows["key"]] = rows["weight"]
    return out


# ---------------------------------------------------------------- the real model


SMOL_HEADS = [(0, 0), (17, 4), (18, 6), (29, 8)]
SMOL_TEXT = "The cat sat on the mat because the cat was tired, and the mat was warm."


@pytest.fixture(scope="module")
def smol_inspection(smollm2):
    return headscope.inspect(smollm2, texts=[SMOL_TEXT], probes=["induction"], heads=SMOL_HEADS)


@pytest.mark.slow
def test_every_weight_equals_output_attentions_on_smollm2(smollm2, smol_inspection):
    """Any head on any text: the weights are those transformers' eager output_attentions gives, to 1e-5, and
    every visible (query, key) pair (a causal t(t+1)/2 per head) is there."""
    tokens, attention = smol_inspection.tokens, smol_inspection.attention
    assert smollm2.model.config._attn_implementation == "eager"
    for text_id in (0, 1):
        ids = tokens[tokens["text_id"] == text_id].sort_values("position")["token_id"].tolist()
        with torch.inference_mode():
            expected = smollm2.model(torch.tensor([ids]), output_attentions=True).attentions
        t = len(ids)
        for layer, head in SMOL_HEADS:
            got = matrix(attention, text_id, layer, head)
            assert got.shape == (t, t)
            np.testing.assert_allclose(got, expected[layer][0, head].double().numpy(), atol=1e-5)
        assert len(attention[attention["text_id"] == text_id]) == len(SMOL_HEADS) * t * (t + 1) // 2
    assert tokens[tokens["text_id"] == 0]["token_id"].tolist() == smollm2.tokenizer(SMOL_TEXT)["input_ids"]


@pytest.mark.slow
def test_the_induction_stripe_of_l18h6_and_its_probe_score(smollm2, smol_inspection):
    """On the repeated random tokens, SmolLM2's strongest induction head looks 31 tokens back (the token after
    the earlier copy) from nearly every row of the second repeat; its score equals the battery's seed 0."""
    spec = ProbeSpec(seeds=2, length=32)
    (sequence, _), prefix = probe_inputs(smollm2.tokenizer, spec)
    probe = smol_inspection.tokens[smol_inspection.tokens["text_id"] == 1]["token_id"].tolist()
    assert probe == sequence  # the battery's own sequence for seed 0
    weights = matrix(smol_inspection.attention, 1, 18, 6)
    t = len(probe)
    second = np.arange(t - spec.length, t)
    assert (weights[second].argmax(axis=1) == second - (spec.length - 1)).mean() >= 0.9

    with torch.inference_mode():
        attentions = smollm2.model(torch.tensor([probe]), output_attentions=True).attentions
    summary = smol_inspection.summary.set_index(["text_id", "layer", "head"])
    for layer, head in SMOL_HEADS:
        expected = probe_scores([attentions[layer][0].double().numpy()], prefix, spec.length)
        for pattern in ("induction", "duplicate", "previous"):
            got = summary.loc[(1, layer, head), f"probe_{pattern}"]
            assert got == pytest.approx(expected[pattern][head], abs=1e-5), (layer, head, pattern)
    assert summary.loc[(1, 18, 6), "probe_induction"] > 0.8
    assert summary.loc[(0, 18, 6)].isna()["probe_induction"]  # no probe score on a text that is not the probe
    entry = next(e for e in smol_inspection.record["summary"] if e["head"] == "18.6" and e["text_id"] == 1)
    assert "31 back" in [name for name, _ in entry["largest_at"]]


# ---------------------------------------------------------------- planted models: known answers


def test_planted_heads_give_their_planted_attention(planted_gpt2, corpus_lines, tmp_path):
    """Layer 0's hand-set heads of the planted GPT-2 on corpus sentences (tokenized as analyze does): exactly
    the attention they were built to give, written to the folder with its tokens, record and page."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines) + "\n")
    out = tmp_path / "seen"
    result = run_cli("inspect", planted_gpt2, "--corpus", corpus, "--sentences", "3,0", "--layers", "0", "--out", out)
    assert result.exit_code == 0, result.output
    attention, tokens = pd.read_parquet(out / ATTENTION_FILE), pd.read_parquet(out / TOKENS_FILE)
    record = json.loads((out / INSPECT_RECORD).read_text())
    assert [t["label"] for t in record["texts"]] == ["sentence 3", "sentence 0"]
    assert record["heads"] == ["0.0", "0.1", "0.2"]
    tokenizer = AutoTokenizer.from_pretrained(planted_gpt2)
    for text_id, sentence in enumerate((3, 0)):
        ids = tokens[tokens["text_id"] == text_id]["token_id"].tolist()
        assert ids == tokenizer(corpus_lines[sentence])["input_ids"]
        for head in (UNIFORM, PREVIOUS, FIRST):
            got = matrix(attention, text_id, 0, head)
            np.testing.assert_allclose(got, expected_attention(head, len(ids)), atol=1e-6)
    places = {(e["text_id"], e["head"]): dict(e["largest_at"]) for e in record["summary"]}
    # Over rows 1..n-1 (row 0 sees only itself); row 1's previous token is the first token, named so.
    n = len(tokens[tokens["text_id"] == 0])
    assert places[(0, f"0.{PREVIOUS}")] == {"1 back": pytest.approx((n - 2) / (n - 1)), "first token": 1 / (n - 1)}
    assert places[(0, f"0.{FIRST}")]["first token"] == pytest.approx(1.0)
    assert (out / INSPECT_PAGE).stat().st_size > 100_000
    assert "0.1" in result.output and "1 back" in result.output  # the summary, heads written L.H


def test_role_from_the_probes_finds_the_planted_induction_head(tmp_path):
    """--role induction without a report runs the probe battery first and picks the planted circuit's head."""
    model = build_planted_induction(tmp_path / "induction")
    seen = headscope.inspect(str(model), probes=["induction"], roles=["induction"], probe_seeds=4)
    assert seen.record["heads"] == ["1.0"] and seen.record["roles"] == {"1.0": "induction"}
    assert seen.record["roles_from"].startswith("probes")
    assert seen.summary.set_index("layer").loc[1, "probe_induction"] > 0.9


def test_roles_come_from_a_report_of_the_same_model(planted_gpt2, tmp_path):
    report = tmp_path / "report"
    assert run_cli("analyze", planted_gpt2, "--out", report, "--no-charts", "--no-page").exit_code == 0
    roles = pd.read_parquet(report / "heads.parquet").set_index(["layer", "head"])["role"]
    wanted = roles.loc[(0, FIRST)]
    seen = headscope.inspect(str(planted_gpt2), texts=["the cat sat"], roles=[wanted], report=report)
    assert seen.record["heads"] == [f"{layer}.{head}" for (layer, head), role in roles.items() if role == wanted]
    assert set(seen.record["roles"].values()) == {wanted}


def test_the_result_is_the_same_in_memory_and_on_disk_and_alone(planted_gpt2, tmp_path):
    """Each text runs alone: inspecting a text beside others, or alone, gives the same weights."""
    texts = ["the cat sat on the mat", "a dog", "the mat was warm and the cat sat"]
    together = headscope.inspect(str(planted_gpt2), texts=texts, heads=[(1, 2), (0, 1)])
    alone = headscope.inspect(str(planted_gpt2), texts=texts[2:], heads=[(0, 1)], out=tmp_path / "alone")
    np.testing.assert_array_equal(matrix(together.attention, 2, 0, 1), matrix(alone.attention, 0, 0, 1))
    assert together.record["heads"] == ["0.1", "1.2"]  # ascending, whatever order they were asked in


# ---------------------------------------------------------------- memory


PEAK_SCRIPT = """
import json, resource, sys
import headscope
from headscope.model.loading import load_model
loaded = load_model(sys.argv[1], device="cpu", dtype="float32")
text = " ".join(open(sys.argv[2]).read().split()[:5000])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
seen = headscope.inspect(loaded, texts=[text], heads=[(0, 0), (1, 5)], max_length=4096, out=sys.argv[3])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kib": after - before, "tokens": seen.record["texts"][0]["tokens"]}))
"""


@pytest.mark.slow  # a child process
def test_4096_tokens_stay_within_the_chosen_heads_memory(tmp_path, corpus_lines, shipped_corpus):
    """Two heads of a 4,096-token text keep 2 x 64 MiB of float32 weights and a 16 MiB visibility mask per
    layer (160 MiB); all 16 heads would be 1 GiB. The peak grows by what is kept plus blocks, never all heads."""
    folder = tiny_llama(tmp_path / "llama", corpus_lines)
    words = tmp_path / "words.txt"
    words.write_text(" ".join(shipped_corpus.read_text().split() * 6))
    measured = run_measuring_script(PEAK_SCRIPT, folder, words, tmp_path / "seen")
    assert measured["tokens"] == 4096
    kept = (4 * 2 + 2) * 4096**2
    assert measured["grew_kib"] * 1024 < kept + 192 * 2**20, measured
    rows = pd.read_parquet(tmp_path / "seen" / ATTENTION_FILE, columns=["head"])
    assert len(rows) == 2 * 4096 * 4097 // 2


@pytest.mark.slow  # builds a 4,096-position model
def test_a_request_beyond_the_budget_is_refused_before_any_forward(tmp_path, corpus_lines):
    """All 16 heads of a 4,096-token text would keep 1.1 GB: refused, naming the length that fits."""
    folder = tiny_llama(tmp_path / "llama", corpus_lines)
    text = " ".join(" ".join(corpus_lines).split() * 4)
    options = ("--text", text, "--max-length", "4096", "--out", tmp_path / "seen")
    result = run_cli("inspect", folder, *options, "--max-memory", "256MiB")
    assert_one_line_error(result, "16 heads on a text of 4,096 tokens", "more than the 256.0 MiB budget", "2,0")
    assert not (tmp_path / "seen").exists()
    assert run_cli("inspect", folder, *options, "--max-memory", "256MiB", "--heads", "0.0,1.7").exit_code == 0


# ---------------------------------------------------------------- refusals and the output rule


@pytest.mark.parametrize(
    ("arguments", "fragments"),
    [
        ((), ("nothing to inspect",)),
        (("--text", "the cat", "--heads", "0.1", "--role", "induction"), ("--heads and --role",)),
        (("--text", "the cat", "--heads", "0.x"), ("--heads", "0.x")),
        (("--text", "the cat", "--role", "sink"), ("role sink", "--report")),
        (("--text", "the cat", "--role", "nonsense"), ("--role", "nonsense")),
        (("--text", "   "), ("--text number 1 is empty",)),
        (("--probe", "copying"), ("--probe", "copying")),
    ],
)
def test_requests_that_ask_for_nothing_or_contradict_themselves_are_usage_errors(planted_gpt2, arguments, fragments):
    assert_one_line_error(run_cli("inspect", planted_gpt2, *arguments), *fragments, code=2)


def test_heads_and_sentences_beyond_the_model_or_corpus_are_refused(planted_gpt2, tmp_path):
    assert_one_line_error(
        run_cli("inspect", planted_gpt2, "--text", "the cat", "--heads", "5.0"), "5.0", "layers 0-1", code=2
    )
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat\nthe dog ran\n")
    result = run_cli("inspect", planted_gpt2, "--corpus", corpus, "--sentences", "0,2")
    assert_one_line_error(result, "sentence 2", "has 2", code=2)
    result = run_cli("inspect", planted_gpt2, "--text", "the cat", "--heads", "1.0", "--layers", "0")
    assert_one_line_error(result, "none of the --heads lies in --layers 0", code=2)
    with pytest.raises(ConfigError, match="nothing to inspect"):
        headscope.inspect(str(planted_gpt2))


def test_inspect_writes_only_inspection_folders(planted_gpt2, tmp_path):
    report = tmp_path / "report"
    assert run_cli("analyze", planted_gpt2, "--out", report, "--no-charts", "--no-page").exit_code == 0
    before = sorted(p.name for p in report.iterdir())
    ask = ("inspect", planted_gpt2, "--text", "the cat sat")
    assert_one_line_error(run_cli(*ask, "--heads", "0.1", "--out", report, "--overwrite"), str(report))
    assert sorted(p.name for p in report.iterdir()) == before  # a report is never replaced by an inspection
    out = tmp_path / "seen"
    assert run_cli(*ask, "--heads", "0.1", "--out", out).exit_code == 0
    assert_one_line_error(run_cli(*ask, "--heads", "0.1", "--out", out), "--overwrite")
    assert run_cli(*ask, "--out", out, "--overwrite", "--heads", "1.1").exit_code == 0
    assert json.loads((out / INSPECT_RECORD).read_text())["heads"] == ["1.1"]


def test_each_inspect_option_reaches_what_it_changes(planted_gpt2, tmp_path):
    """--no-page, --max-length, --text-column (with --corpus), --probe-length, --probe-seeds and --role-probe-min,
    each against the run without it."""
    ask = ("inspect", planted_gpt2, "--heads", "0.1")
    assert run_cli(*ask, "--text", "the cat sat on the mat", "--out", tmp_path / "a", "--no-page").exit_code == 0
    assert not (tmp_path / "a" / INSPECT_PAGE).exists() and (tmp_path / "a" / ATTENTION_FILE).exists()

    seen = headscope.inspect(str(planted_gpt2), texts=["the cat sat on the mat"], heads=[(0, 1)], max_length=3)
    assert seen.record["texts"][0]["tokens"] == 3 and seen.record["texts"][0]["truncated"]
    assert seen.record["settings"]["max_length"] == 3

    table = tmp_path / "corpus.csv"
    table.write_text("id,words\n1,the cat sat\n2,the dog ran on the mat\n")
    result = run_cli(*ask, "--corpus", table, "--text-column", "words", "--sentences", "1", "--out", tmp_path / "b")
    assert result.exit_code == 0, result.output
    tokens = pd.read_parquet(tmp_path / "b" / TOKENS_FILE)
    assert tokens["token"].str.strip().tolist() == ["the", "dog", "ran", "on", "the", "mat"]

    for length in (8, 16):
        seen = headscope.inspect(str(planted_gpt2), probes=["previous"], heads=[(0, 1)], probe_length=length)
        assert seen.record["texts"][0]["tokens"] == 2 * length and seen.record["probe_length"] == length


def test_the_role_options_reach_the_probes(tmp_path):
    model = str(build_planted_induction(tmp_path / "induction"))
    seen = headscope.inspect(model, probes=["induction"], roles=["induction"], probe_seeds=3)
    assert seen.record["roles_from"].startswith("probes (3 seeds") and seen.record["heads"] == ["1.0"]
    with pytest.raises(ConfigError, match="no head has role induction"):
        headscope.inspect(
            model, probes=["induction"], roles=["induction"], role_thresholds=RoleThresholds(probe_min=0.999)
        )
    result = run_cli("inspect", model, "--probe", "induction", "--role", "induction", "--role-probe-min", "0.999")
    assert_one_line_error(result, "no head has role induction", code=2)
