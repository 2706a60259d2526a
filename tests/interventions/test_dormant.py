"""The dormant label, checked by removal (headscope.interventions.dormant): the search on known cost functions, and
end to end on planted models whose answer is known: a Gemma 2 whose one loud head writes 1e-3 before its
post-attention norm, and a copier whose one quiet head carries the whole loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

import headscope
from headscope.config import RoleThresholds, Thresholds
from headscope.interventions.dormant import verified_prefix

from helpers import run_cli
from planted import (
    COPY_LOGIT,
    COPY_VOCAB,
    LOUD,
    POST_HEAD_DIM,
    build_planted_copier,
    build_planted_post_norm,
    copy_words,
)
from reference import hooked_losses

ALL_CANDIDATES = RoleThresholds(dormant_max_write_ratio=1.0)


def counting(cost):
    """verify() over a cost function of the prefix size, counting its calls."""
    calls = []

    def verify(sizes):
        calls.append(list(sizes))
        return [cost(size) for size in sizes]

    return verify, calls


def test_the_search_finds_the_longest_prefix_within_the_tolerance():
    """Prefixes up to 37 heads cost nothing, longer ones 1 nat: the whole group, its halves, then two rounds closing
    in, 37 in four passes of at most four sets."""
    verify, calls = counting(lambda size: 0.0 if size <= 37 else 1.0)
    found = verified_prefix(100, tolerance=0.02, verify=verify)
    assert found.kept == 37 and found.costs[37] == 0.0 and found.costs[38] == 1.0
    assert calls[:2] == [[100], [50, 25, 12, 6]] and len(calls) == found.rounds == 4
    assert all(len(sizes) <= 4 for sizes in calls)


def test_a_group_that_fits_is_verified_in_one_pass():
    verify, calls = counting(lambda size: -0.01)
    found = verified_prefix(29, tolerance=0.02, verify=verify)
    assert found.kept == 29 and calls == [[29]]


def test_a_costly_first_head_leaves_nothing_dormant():
    verify, _ = counting(lambda size: 0.5)
    assert verified_prefix(12, tolerance=0.02, verify=verify).kept == 0


@pytest.mark.parametrize("seed", range(20))
def test_whatever_the_costs_the_answer_is_a_verified_set(seed):
    """Costs in any order (removing more may cost less): the kept prefix was verified within the tolerance, and
    every verified size between it and the next failing one was tried."""
    costs = np.random.default_rng(seed).normal(0.0, 0.05, size=61)
    verify, _ = counting(lambda size: float(costs[size]))
    found = verified_prefix(60, tolerance=0.02, verify=verify)
    assert found.kept == 0 or found.costs[found.kept] <= 0.02
    failing_above = [size for size in found.costs if size > found.kept]
    assert all(found.costs[size] > 0.02 for size in failing_above)


@pytest.fixture(scope="module")
def post_norm_lm(tmp_path_factory, corpus_lines):
    return build_planted_post_norm(tmp_path_factory.mktemp("post-norm-lm"), corpus_lines, causal_lm=True)


def test_on_a_post_norm_model_no_head_that_matters_is_dormant(post_norm_lm, corpus_lines):
    """The Gemma 2 planted with one loud head behind its post-attention norm: the three heads that write nothing
    are dormant and their removal is verified (it costs exactly 0, as a plain hook-based ablation says); the loud
    head, which a write measured before the norm would call dormant, is not, and zeroing it moves every logit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = corpus_lines[:30]
    report = headscope.analyze(str(post_norm_lm), texts, probe_seeds=2, bootstrap=50)
    check = report.run["dormant_check"]
    assert check["status"] == "verified" and check["heads"] == ["0.1", "0.2", "0.3"] and check["effect"]["delta"] == 0
    assert report.run["classification"]["dormant"] == "verified"
    assert report.heads.set_index(["layer", "head"]).loc[(0, LOUD), "role"] != "dormant"
    lm = AutoModelForCausalLM.from_pretrained(post_norm_lm, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(post_norm_lm)
    sentences = [tokenizer(line)["input_ids"] for line in texts]
    layers = lm.model.layers
    clean, quiet, _ = hooked_losses(lm, layers, sentences, [(0, 1), (0, 2), (0, 3)], "zero", "all", POST_HEAD_DIM)
    assert quiet - clean == pytest.approx(check["effect"]["delta"], abs=1e-6)

    def zero_loud(module, args):
        x = args[0].clone()
        x[..., LOUD * POST_HEAD_DIM : (LOUD + 1) * POST_HEAD_DIM] = 0.0
        return (x, *args[1:])

    ids = torch.tensor([sentences[0]])
    with torch.no_grad():
        before = lm(ids).logits
        hook = layers[0].self_attn.o_proj.register_forward_pre_hook(zero_loud)
        after = lm(ids).logits
        hook.remove()
    assert (after - before).abs().amax(-1).min() > 0.01  # every position's logits move


@pytest.fixture(scope="module")
def quiet_copier(tmp_path_factory):
    """The copier whose one head (0.0) writes 0.35 of the residual stream and carries the whole loss."""
    return build_planted_copier(tmp_path_factory.mktemp("quiet") / "model", quiet=0.1)


def repeated_words() -> list[str]:
    return [" ".join([word] * 8) for word in copy_words()]


@pytest.fixture(scope="module")
def demoting_report(quiet_copier):
    return headscope.analyze(str(quiet_copier), repeated_words(), roles=ALL_CANDIDATES, probes=False, bootstrap=50)


def test_a_quiet_head_that_carries_the_loss_is_demoted(demoting_report):
    """All eight heads write under the threshold; zeroing them together costs ln V - the clean loss (2.30 nats),
    all of it the copier's: it is demoted, the seven that write nothing stay dormant, verified at cost 0."""
    check = demoting_report.run["dormant_check"]
    assert check["demoted"] == ["0.0"] and len(check["heads"]) == 7 and check["effect"]["delta"] == 0.0
    cost = math.log(COPY_VOCAB) - math.log1p((COPY_VOCAB - 1) * math.exp(-COPY_LOGIT))
    assert check["verified_sets"]["8"] == pytest.approx(cost, rel=1e-5)
    copier = demoting_report.heads.set_index(["layer", "head"]).loc[(0, 0)]
    assert copier["role"] == "positional" and copier["dormant_check"] == "demoted"
    assert "not dormant: write_ratio 0.3464, but removing it with the quieter heads cost more" in copier["role_reason"]


def test_classify_keeps_the_demotion_and_says_when_the_heads_differ(demoting_report, quiet_copier, tmp_path):
    """The same thresholds: still verified, the copier still demoted. Thresholds that change the dormant heads: the
    label reads unverified (they are not the heads analyze removed together), in heads.parquet, run.json and the
    printout."""
    same = demoting_report.relabelled(Thresholds(), ALL_CANDIDATES)
    assert same.run["classification"]["dormant"] == "verified"
    assert same.heads.set_index(["layer", "head"]).loc[(0, 0), "role"] == "positional"
    folder = tmp_path / "report"  # default thresholds: the seven silent heads, verified; the copier is no candidate
    headscope.analyze(str(quiet_copier), repeated_words(), out=folder, probes=False, bootstrap=0, charts=None,
                      page=False)  # fmt: skip
    result = run_cli("classify", str(folder), "--role-dormant-max-write-ratio", "1.0", "--out", str(tmp_path / "all"))
    assert result.exit_code == 0, result.output
    assert "dormant: unverified, its 8 heads are not the ones analyze removed together" in " ".join(
        result.output.split()
    )
    relabelled = headscope.Report.open(tmp_path / "all")
    assert relabelled.run["classification"]["dormant"] == "unverified"
    assert relabelled.heads.query("role == 'dormant'")["role_reason"].str.endswith("removal not verified").all()


def test_a_model_handed_in_without_its_lm_head_reads_unverified(quiet_copier):
    loaded = headscope.load_model(str(quiet_copier), device="cpu")  # the base model only
    report = headscope.analyze(loaded, repeated_words(), roles=ALL_CANDIDATES, probes=False, bootstrap=0)
    check = report.run["dormant_check"]
    assert check["status"] == "unverified" and "no LM head" in check["why"]
    assert report.run["classification"]["dormant"] == "unverified"
    dormant = report.heads[report.heads["role"] == "dormant"]
    assert len(dormant) == 8 and dormant["role_reason"].str.endswith("; removal not verified").all()


def test_the_printout_says_what_backs_the_label(quiet_copier, tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("\n".join(repeated_words()) + "\n")
    result = run_cli("analyze", str(quiet_copier), "--corpus", str(words), "--out", str(tmp_path / "r"),
                     "--no-probes", "--bootstrap", "0", "--no-charts", "--no-page",
                     "--role-dormant-max-write-ratio", "1.0")  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "dormant, checked by removal: its 7 heads zeroed together cost +0.0000 nats on 70 tokens" in text
    assert "1 demoted, removing them too cost more: 0.0" in text


def test_a_verified_group_whose_interval_excludes_zero_is_flagged():
    """Within the tolerance is not free: a kept group costing +0.0159 nats [+0.0024, +0.0291] (issue 65's held-out
    model, where one of its heads carried a task) is flagged in run.json and in the printout; one whose interval
    holds 0 is not; without an interval nothing is claimed."""
    import pandas as pd

    from headscope.interventions.dormant import DormantCheck
    from headscope.summary import dormant_line

    heads = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "role": ["dormant", "dormant"],
                          "dormant_check": ["verified", "verified"]})  # fmt: skip
    for low, high, flagged in ((0.0024, 0.0291, True), (-0.0031, 0.0291, False), (None, None, None)):
        effect = {"tokens": 900, "clean_loss": 4.0, "ablated_loss": 4.0159, "delta": 0.0159, "delta_ci_low": low,
                  "delta_ci_high": high}  # fmt: skip
        check = DormantCheck("verified", tolerance=0.02, kept=[(0, 0), (0, 1)], effect=effect).record()
        assert check["cost_above_zero"] is flagged
        line = dormant_line(heads, check)
        assert line.startswith("dormant, checked by removal: its 2 heads zeroed together cost +0.0159 nats")
        assert ("its interval excludes 0: within the tolerance, but not free" in line) is bool(flagged)
