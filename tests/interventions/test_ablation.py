"""Heads removed together (ablate), the tokens an induction head predicts, and the paired bootstrap."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import headscope
from headscope.errors import ConfigError
from headscope.estimates import replicate_weights
from headscope.interventions.group_losses import GroupLosses, group_effect, repeat_tokens, scored_targets
from headscope.model.batch import collate
from headscope.progress import NullReporter

from helpers import assert_one_line_error, refuse_to_load, run_cli, tiny_model_folder
from planted import copied_sentences
from reference import hooked_losses, repeat_positions


def test_repeat_tokens_are_the_second_token_of_a_bigram_seen_before():
    ids = [5, 6, 7, 5, 6, 7, 8, 5, 6, 6, 6]
    assert repeat_tokens(ids).tolist() == [False, False, False, False, True, True, False, False, True, False, True]
    assert repeat_tokens(ids).tolist() == repeat_positions(ids)
    assert repeat_tokens([4, 4, 4]).tolist() == [False, False, True]  # j = 0 < t - 1 = 1: (4, 4) seen
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, 4, size=int(rng.integers(0, 30))).tolist()
        assert repeat_tokens(ids).tolist() == repeat_positions(ids)


@pytest.mark.parametrize("side", ["right", "left"])
def test_scored_targets_follow_each_sentence_whatever_the_padding(side):
    batch = collate([0, 1], [[3, 4, 3, 4, 9], [7, 7, 7]], padding_side=side)
    repeats = scored_targets(batch, "repeats")
    everything = scored_targets(batch, "all")
    start = batch.seq_start.tolist()
    # sentence 0: position 3 (token 4) repeats (3, 4); sentence 1: position 2 (7 after 7)
    assert everything.sum(-1).tolist() == [4, 2]
    assert [int(i) - start[0] for i in repeats[0].nonzero().flatten() + 1] == [3]
    assert [int(i) - start[1] for i in repeats[1].nonzero().flatten() + 1] == [2]


def test_group_effect_is_a_token_weighted_delta_with_a_paired_bootstrap():
    losses = GroupLosses(sentence_ids=[4, 2, 9])
    tokens = np.array([2.0, 3.0, 5.0])
    clean = np.array([1.0, 3.0, 2.0])
    ablated = np.array([[2.0, 3.0, 4.0], [1.0, 3.0, 2.0]])
    losses.add("all", tokens, clean, ablated)
    effect = group_effect(losses, 0, "all", replicates=400, seed=3)
    assert effect["tokens"] == 10
    assert effect["clean_loss"] == pytest.approx(0.6) and effect["ablated_loss"] == pytest.approx(0.9)
    assert effect["delta"] == pytest.approx(0.3)
    weights = replicate_weights(np.array([4, 2, 9]), 400, 3)
    with np.errstate(invalid="ignore"):  # a replicate that drew no sentence: NaN, skipped as the code skips it
        deltas = (weights @ (ablated[0] - clean)) / (weights @ tokens)
    assert effect["delta_ci_low"] == pytest.approx(np.nanpercentile(deltas, 2.5))
    assert effect["delta_ci_high"] == pytest.approx(np.nanpercentile(deltas, 97.5))
    unchanged = group_effect(losses, 1, "all", replicates=400, seed=3)
    assert unchanged["delta"] == 0.0 and unchanged["delta_ci_low"] == unchanged["delta_ci_high"] == 0.0
    # The same sentences in another order (or batching) draw the same weights: the same interval.
    shuffled = GroupLosses(sentence_ids=[9, 4, 2])
    order = [2, 0, 1]
    shuffled.add("all", tokens[:1][:0], clean[:0], ablated[:, :0])
    shuffled.add("all", tokens[order], clean[order], ablated[:, order])
    assert group_effect(shuffled, 0, "all", replicates=400, seed=3) == effect
    assert group_effect(losses, 0, "all", replicates=0, seed=3)["delta_ci_low"] is None


# ---------------------------------------------------------------- planted: two redundant copiers


@pytest.fixture(scope="module")
def redundant(planted_copier):
    """Heads 0.0 and 0.1 both copy the current token into the stream the LM head reads; either alone suffices."""
    return headscope.load_model(str(planted_copier), device="cpu", lm_head=True), copied_sentences(30)


def test_redundant_heads_each_cost_nothing_alone_and_a_lot_together(redundant):
    loaded, sentences = redundant
    found = headscope.ablate(
        loaded, sentences, heads=[[(0, 0)], [(0, 1)], [(0, 0), (0, 1)]], mode="zero", bootstrap=100
    )
    alone0, alone1, both = found.record["groups"]
    assert alone0["heads"] == ["0.0"] and both["heads"] == ["0.0", "0.1"]
    assert abs(alone0["delta"]) < 1e-4 and abs(alone1["delta"]) < 1e-4
    assert both["delta"] > 2.0  # every logit 0: ln 12 = 2.48 against ~0
    assert both["delta_ci_low"] <= both["delta"] <= both["delta_ci_high"]
    assert both["tokens"] == sum(len(s.split()) - 1 for s in sentences)


@pytest.mark.parametrize("mode", ["zero", "mean"])
@pytest.mark.parametrize("scoring", ["all", "repeats"])
def test_group_ablation_equals_hooks_on_the_output_projection(redundant, mode, scoring):
    loaded, sentences = redundant
    heads = [(0, 0), (0, 1), (1, 2)]
    found = headscope.ablate(loaded, sentences, heads=[heads], mode=mode, loss_on=scoring, bootstrap=0)
    entry = found.record["groups"][0]
    ids = [loaded.tokenizer(s)["input_ids"] for s in sentences]
    clean, ablated, tokens = hooked_losses(loaded.lm, loaded.lm.transformer.h, ids, heads, mode, scoring, 64)
    assert entry["tokens"] == tokens
    assert entry["clean_loss"] == pytest.approx(clean, abs=1e-4)
    assert entry["ablated_loss"] == pytest.approx(ablated, abs=1e-4)


@pytest.fixture(scope="module")
def tiny_llama_lm(tmp_path_factory, corpus_lines):
    """A 2-layer Llama LM (8 heads on 4 KV heads, no attention biases), random weights, word-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4
    )
    folder = tiny_model_folder(tmp_path_factory.mktemp("llama-lm"), config, LlamaForCausalLM, corpus_lines)
    lines = [*corpus_lines[:12], corpus_lines[0] + " " + corpus_lines[0]]  # the last repeats itself
    return folder, lines


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_group_ablation_on_grouped_kv_llama_equals_hooks_whatever_the_batching(tiny_llama_lm, mode):
    folder, lines = tiny_llama_lm
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    heads = [(0, 1), (0, 6), (1, 3)]
    ids = [loaded.tokenizer(s)["input_ids"] for s in lines]
    results = [
        headscope.ablate(loaded, lines, heads=[heads], mode=mode, loss_on=scoring, bootstrap=50, **batching)
        for scoring in ("all", "repeats")
        for batching in ({}, {"batch_size": 1, "padding_side": "left"})
    ]
    for index, scoring in enumerate(("all", "repeats")):
        clean, ablated, tokens = hooked_losses(loaded.lm, loaded.lm.model.layers, ids, heads, mode, scoring, 8)
        batched, one_by_one = (results[2 * index + k].record["groups"][0] for k in (0, 1))
        assert batched["tokens"] == tokens > 0
        assert batched["ablated_loss"] == pytest.approx(ablated, abs=1e-4)
        assert batched["delta"] == pytest.approx(ablated - clean, abs=1e-4)
        assert one_by_one["delta"] == pytest.approx(batched["delta"], abs=1e-6)
        assert one_by_one["delta_ci_low"] == pytest.approx(batched["delta_ci_low"], abs=1e-6)


# ---------------------------------------------------------------- the command


def test_ablate_through_the_cli_writes_ablation_json(redundant, tmp_path):
    loaded, sentences = redundant
    corpus = tmp_path / "repeats.txt"
    corpus.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    out = tmp_path / "ablation"
    args = ["ablate", str(loaded.source.location), "--heads", "0.0", "--heads", "0.1,0.0", "--mode", "zero"]
    result = run_cli(*args, "--corpus", str(corpus), "--out", str(out), "--bootstrap", "50")
    assert result.exit_code == 0, result.output
    record = json.loads((out / "ablation.json").read_text())
    assert [g["heads"] for g in record["groups"]] == [["0.0"], ["0.0", "0.1"]]
    for key in ("mode", "loss_on", "tokens", "clean_loss", "ablated_loss", "delta", "delta_ci_low", "delta_ci_high"):
        assert key in record["groups"][0]
    assert record["mode"] == "zero" and record["bootstrap"]["replicates"] == 50
    assert "0.0,0.1" in result.output and f"{record['groups'][1]['delta']:+.4f}" in result.output
    again = run_cli(*args, "--corpus", str(corpus), "--out", str(out))
    assert_one_line_error(again, "holds a headscope ablation", "--overwrite")
    assert run_cli(*args, "--corpus", str(corpus), "--out", str(out), "--overwrite").exit_code == 0


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        ([], ["nothing to ablate"]),
        (["--heads", "0.x"], ["--heads takes heads written LAYER.HEAD"]),
        (["--role", "induction"], ["--report"]),
        (["--role", "wizard", "--report", "."], ["--role takes"]),
        (["--heads", "0.0", "--mode", "half"], ["--mode"]),
        (["--heads", "0.0", "--loss-on", "some"], ["--loss-on"]),
    ],
)
def test_ablate_refuses_bad_requests_before_loading(args, fragments):
    result = run_cli("ablate", "gpt2", *args, loader=refuse_to_load)
    assert_one_line_error(result, *fragments, code=2)


def test_ablate_names_a_head_the_model_lacks(redundant):
    loaded, sentences = redundant
    with pytest.raises(ConfigError, match=r"--heads names 5\.0; the model has layers 0-1 with heads 0-3"):
        headscope.ablate(loaded, sentences, heads=[[(5, 0)]])


def test_each_role_ablates_every_role_of_a_report(redundant, tmp_path):
    loaded, sentences = redundant
    report = headscope.analyze(loaded, sentences, out=tmp_path / "report", probes=False, charts=None, page=False)
    found = headscope.ablate(loaded, sentences, each_role=True, report=tmp_path / "report", bootstrap=0)
    roles = report.heads.groupby("role").size()
    expected = {role: count for role, count in roles.items() if role != "other"}
    assert {g["name"]: len(g["heads"]) for g in found.record["groups"]} == expected
    assert torch.get_num_threads() > 0  # the run left torch as it was found (threads restored)


def test_analyze_with_importance_removes_each_role_together_as_ablate_does(redundant, tmp_path):
    loaded, sentences = redundant
    report = headscope.analyze(loaded, sentences, importance="fast", probes=False, sentence_heads=False)
    entries = report.run["importance"]["roles"]
    heads = report.heads
    roles = [role for role in heads["role"].unique() if role != "other"]
    assert roles and sorted({e["role"] for e in entries}) == sorted(roles)
    assert sorted({e["mode"] for e in entries}) == ["mean", "zero"]
    for entry in entries:
        members = heads[heads["role"] == entry["role"]]
        assert entry["heads"] == [f"{r.layer}.{r.head}" for r in members.itertuples()]
        chosen = [tuple(map(int, name.split("."))) for name in entry["heads"]]
        for scoring in ("all", "repeats"):
            alone = headscope.ablate(loaded, sentences, heads=[chosen], mode=entry["mode"], loss_on=scoring)
            expected = alone.record["groups"][0]
            assert entry[scoring]["tokens"] == expected["tokens"]
            assert entry[scoring]["delta"] == pytest.approx(expected["delta"], abs=1e-6)
            assert entry[scoring]["delta_ci_low"] == pytest.approx(expected["delta_ci_low"], abs=1e-6)


def test_the_cli_ranks_heads_by_the_second_order_estimate_and_says_it_is_one(redundant, tmp_path):
    loaded, sentences = redundant
    corpus = tmp_path / "repeats.txt"
    corpus.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    args = ["analyze", str(loaded.source.location), "--corpus", str(corpus), "--importance", "fast", "--no-probes"]
    result = run_cli(*args, "--out", str(tmp_path / "r"), "--no-charts", "--no-page")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "by estimate_mean, a second-order estimate" in text and "not ablations" in text
    assert "the 10 heads it needs least alone" in result.output
    assert "each role's heads removed together" in result.output


def test_each_ablate_option_changes_what_it_says(redundant):
    loaded, sentences = redundant
    heads = [[(0, 0), (0, 1)]]

    def entry(**options):
        return headscope.ablate(loaded, sentences, heads=heads, **options).record["groups"][0]

    base = entry(mode="zero", bootstrap=50)
    assert entry(mode="mean", bootstrap=50)["delta"] != pytest.approx(base["delta"], abs=1e-3)
    repeats = entry(mode="zero", bootstrap=50, loss_on="repeats")
    assert 0 < repeats["tokens"] < base["tokens"]
    assert entry(mode="zero", bootstrap=0)["delta_ci_low"] is None
    mean, other_seed = (entry(mode="mean", bootstrap=50, bootstrap_seed=seed) for seed in (0, 7))
    assert other_seed["delta"] == mean["delta"] and other_seed["delta_ci_low"] != mean["delta_ci_low"]
    cut = entry(mode="zero", bootstrap=50, max_length=3)
    assert cut["tokens"] == 2 * len(sentences)
    neutral = entry(mode="zero", bootstrap=50, batch_size=2, padding_side="left", max_memory=2**24)
    assert neutral["delta"] == pytest.approx(base["delta"], abs=1e-6)
    assert neutral["delta_ci_high"] == pytest.approx(base["delta_ci_high"], abs=1e-6)


class Progress(NullReporter):
    def __init__(self) -> None:
        self.started, self.done = [], 0

    def start(self, total_sentences: int, what: str = "measuring") -> None:
        self.started.append((total_sentences, what))

    def advance(self, sentences: int, tokens: int) -> None:
        self.done += sentences


def test_ablate_shows_its_progress(redundant):
    """The progress bar ablate starts is advanced by every sentence of its pass (it once stayed at 0)."""
    loaded, sentences = redundant
    progress = Progress()
    headscope.ablate(loaded, sentences, heads=[[(0, 0)], [(0, 1)]], bootstrap=0, reporter=progress)
    assert progress.started == [(len(sentences), "ablation")] and progress.done == len(sentences)


@pytest.mark.parametrize("mode", ["zero", "mean"])
@pytest.mark.parametrize("batching", [{}, {"batch_size": 4, "max_memory": 2**21}])
def test_the_planned_passes_are_the_passes_run(redundant, mode, batching):
    """ablate says what it will run before it runs (reporter note, ablation.json "planned"): the forward passes
    (counted at the final norm, which every pass reaches) and the decoder-layer runs (counted at each block: a
    replica pass starts at its groups' first removed layer) equal what the model then runs."""
    loaded, sentences = redundant
    calls = {"final": 0, "blocks": 0}

    def count(name):
        def hook(module, args):
            calls[name] += 1

        return hook

    handles = [loaded.lm.transformer.ln_f.register_forward_pre_hook(count("final"))]
    handles += [block.register_forward_pre_hook(count("blocks")) for block in loaded.lm.transformer.h]
    notes = []

    class Notes(NullReporter):
        def note(self, message):
            notes.append(message)

    groups = [[(0, 0)], [(1, 2)], [(0, 1), (1, 0)], [(1, 1)]]
    try:
        found = headscope.ablate(loaded, sentences, heads=groups, mode=mode, bootstrap=0, reporter=Notes(), **batching)
    finally:
        for handle in handles:
            handle.remove()
    planned = found.record["planned"]
    assert planned["forwards"] == calls["final"] and planned["layer_runs"] == calls["blocks"]
    assert planned["forwards"] > len(groups)  # replicas were counted, not only the clean passes
    assert any(note.startswith(f"planned: {planned['forwards']:,} forward passes") for note in notes)


def test_exact_importance_says_what_its_ablations_will_run(redundant):
    """analyze --importance exact notes and records its ablations' passes before they run: the forward passes
    without gradients (the gradient pass has them) counted at the final norm during the importance stage."""
    import torch

    loaded, sentences = redundant
    calls = {"ablation": 0}
    stages, notes = [], []

    class Stages(NullReporter):
        def stage(self, text):
            stages.append((text, calls["ablation"]))

        def note(self, message):
            notes.append(message)

    def hook(module, args):
        calls["ablation"] += not torch.is_grad_enabled()

    handle = loaded.lm.transformer.ln_f.register_forward_pre_hook(hook)
    options = {"charts": None, "page": False, "probes": False, "bootstrap": 0, "max_memory": 2**21}
    try:
        report = headscope.analyze(loaded, sentences, importance="exact", reporter=Stages(), **options)
    finally:
        handle.remove()
    planned = report.run["importance"]["planned"]
    at = next(i for i, (text, _) in enumerate(stages) if text.startswith("importance (exact)"))
    ran = stages[at + 1][1] - stages[at][1]
    assert planned["forwards"] == ran > 2  # several batches, and replicas counted, not only the clean passes
    assert any(f"then {planned['forwards']:,} forward passes" in note for note in notes)


def test_the_ablate_table_keeps_every_cell_whole(redundant, tmp_path):
    """A long list of heads is named up to six and counted, never cut to "2.0,2.1,2.…"; an interval stays on one
    line, whatever the terminal's width (80 columns here)."""
    loaded, sentences = redundant
    corpus = tmp_path / "repeats.txt"
    corpus.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    every = ",".join(f"{layer}.{head}" for layer in range(2) for head in range(4))
    result = run_cli("ablate", str(loaded.source.location), "--heads", every, "--mode", "zero", "--corpus", corpus,
                     "--out", tmp_path / "a", "--bootstrap", "50")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "0.0,0.1,0.2,0.3,1.0,1.1,... (8)" in result.output and "…" not in result.output
    assert re.search(r"\[[-+]\d\.\d{4}, [-+]\d\.\d{4}\]", result.output)


@pytest.mark.parametrize("command", ["ablate", "prune", "inspect"])
def test_every_command_that_reads_a_corpus_takes_encoding_errors(command, redundant, tmp_path):
    """--encoding-errors is in the option bundle of every command that reads a corpus (it was analyze's only): a line
    of invalid UTF-8 stops the command in one line naming it, and with `skip` the command reads the other lines."""
    loaded, sentences = redundant
    corpus = tmp_path / "mixed.txt"
    corpus.write_bytes(("\n".join(sentences[:4]) + "\n").encode() + b"bad \xff byte\n")
    model = str(loaded.source.location)
    request = {
        "ablate": ["--heads", "0.0", "--bootstrap", "0"],
        "prune": ["--budget", "0.01", "--max-rounds", "1", "--no-charts"],
        "inspect": ["--heads", "0.0", "--sentences", "0,1", "--no-page"],
    }[command]
    common = [command, model, *request, "--corpus", str(corpus)]
    assert_one_line_error(run_cli(*common, "--out", str(tmp_path / "strict")), "mixed.txt:5", "invalid UTF-8")
    out = tmp_path / "skipped"
    result = run_cli(*common, "--out", str(out), "--encoding-errors", "skip")
    assert result.exit_code == 0, result.output
    record = json.loads(next(out.glob("*.json")).read_text())
    assert record["settings"]["encoding_errors"] == "skip" and record["corpus"]["sentences"] == 4, record
