"""ablate --pairs: heads removed on a task's clean prompts, the metric's change (interventions/pair_removal.py),
on the planted induction circuit, where the answer is known, and against a plain computation (transformers alone,
the head's slice of the output projection's input zeroed by a hook, one prompt at a time, float64 differences)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import headscope
from headscope.errors import ConfigError

from helpers import assert_one_line_error, run_cli
from planted import build_planted_induction

RECORDS = [
    {"clean": "w5 w9 w12 w20 w5", "corrupt": "w7 w9 w12 w20 w5", "answer": "w9", "distractor": "w12"},
    {"clean": "w3 w4 w6 w8 w11 w3", "corrupt": "w2 w4 w6 w8 w11 w3", "answer": "w4", "distractor": "w8"},
    {"clean": "w3 w4 w3", "corrupt": "w2 w4 w3", "answer": "w4", "distractor": "w8"},
    {"clean": "w6 w1 w2 w6", "corrupt": "w7 w1 w2 w6", "answer": "w1", "distractor": "w2"},
]


@pytest.fixture(scope="module")
def induction(tmp_path_factory):
    folder = build_planted_induction(tmp_path_factory.mktemp("induction-lm"), predicts=True)
    return folder, headscope.load_model(str(folder), device="cpu", lm_head=True)


def plain_metric(lm, tokenizer, record: dict, removed: list[tuple[int, int]]) -> float:
    """logit[answer] - logit[distractor] at the last position of the clean prompt, the heads' slices of their
    layer's c_proj input set to 0."""
    heads, head_dim = lm.config.n_head, lm.config.n_embd // lm.config.n_head
    handles = []
    for layer, head in removed:

        def zero(module, args, head=head):
            merged = args[0].clone()
            merged[..., head * head_dim : (head + 1) * head_dim] = 0
            return (merged,)

        assert head < heads
        handles.append(lm.transformer.h[layer].attn.c_proj.register_forward_pre_hook(zero))
    try:
        with torch.no_grad():
            logits = lm(torch.tensor([tokenizer(record["clean"])["input_ids"]])).logits[0, -1].double()
    finally:
        for handle in handles:
            handle.remove()
    answer, distractor = (tokenizer(record[key], add_special_tokens=False)["input_ids"][0]
                          for key in ("answer", "distractor"))  # fmt: skip
    return float(logits[answer] - logits[distractor])


def test_removing_the_circuits_heads_takes_the_task_and_the_others_nothing(induction):
    """The induction head (1.0) and the previous-token head it reads (0.0) carry the task: zeroing either does what
    the corrupt prompt does (share of the gap near 1); 1.1's output is discarded by the planted model: change 0.
    Every number equals the plain computation; mean removal (the corpus's means) differs from zero removal."""
    _, loaded = induction
    groups = [[(1, 0)], [(0, 0)], [(1, 1)], [(0, 0), (1, 0)]]
    found = headscope.ablate(loaded, heads=groups, mode="zero", pairs=RECORDS, bootstrap=200)
    effects = {effect.name: effect for effect in found.effects}
    assert effects["1.0"].clean_metric > 10 and effects["1.0"].gap_share > 0.9 and effects["0.0"].gap_share > 0.9
    assert effects["1.1"].change == pytest.approx(0, abs=1e-5) and effects["1.1"].pairs == len(RECORDS)
    low, high = effects["1.0"].change_ci_low, effects["1.0"].change_ci_high
    assert low <= effects["1.0"].change <= high < 0
    lm, tokenizer = loaded.lm, loaded.tokenizer
    for group, effect in zip(groups, found.effects, strict=True):
        clean = np.array([plain_metric(lm, tokenizer, record, []) for record in RECORDS])
        ablated = np.array([plain_metric(lm, tokenizer, record, group) for record in RECORDS])
        scale = np.abs(clean).max() + 1
        assert effect.clean_metric == pytest.approx(clean.mean(), abs=1e-5 * scale)
        assert effect.ablated_metric == pytest.approx(ablated.mean(), abs=1e-5 * scale)
    record = found.record
    assert record["loss_on"] is None and record["pairs"]["count"] == len(RECORDS) and record["groups"][0]["gap_share"]
    mean = headscope.ablate(loaded, heads=[[(1, 0)]], mode="mean", pairs=RECORDS, bootstrap=0)
    assert mean.effects[0].ablated_metric != pytest.approx(effects["1.0"].ablated_metric, abs=1e-3)


def test_the_command_prints_and_writes_the_task_and_refuses_what_does_not_fit(induction, tmp_path):
    folder, loaded = induction
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    out = tmp_path / "ablated"
    done = run_cli("ablate", str(folder), "--heads", "1.0", "--heads", "1.1", "--pairs", str(pairs), "--mode", "zero",
                   "--device", "cpu", "--out", str(out))  # fmt: skip
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "on 4 pairs' clean prompts, logit_diff" in text and "share of the gap" in text
    written = json.loads((out / "ablation.json").read_text())
    assert [group["name"] for group in written["groups"]] == ["1.0", "1.1"] and written["pairs"]["sha256"]
    refused = run_cli("ablate", str(folder), "--heads", "1.0", "--pairs", str(pairs), "--loss-on", "repeats",
                      "--device", "cpu", "--out", str(tmp_path / "x"))  # fmt: skip
    assert_one_line_error(refused, "with --pairs the task's metric is measured instead", code=2)
    with pytest.raises(ConfigError, match="--loss-on scores the corpus loss"):
        headscope.ablate(loaded, heads=[[(1, 0)]], pairs=RECORDS, loss_on="repeats")
