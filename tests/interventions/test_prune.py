"""Pruning: the search's guarantees on a known cost function, the planted redundant pair, saved checkpoints."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

import headscope
from headscope.errors import ConfigError, ResourceError
from headscope.interventions.search import Estimate, prune_search
from headscope.progress import NullReporter

from helpers import assert_one_line_error, refuse_to_load, run_cli
from reference import hooked_losses

HEADS = [(layer, head) for layer in range(4) for head in range(6)]


def cost_model(costs: dict, pairs: dict):
    """A loss with additive per-head costs plus a penalty for each pair removed together."""
    calls = {"verify": 0}

    def loss(removed) -> float:
        removed = set(removed)
        total = 1.0 + sum(costs[h] for h in removed)
        return total + sum(penalty for (a, b), penalty in pairs.items() if a in removed and b in removed)

    def verify(sets):
        calls["verify"] += len(sets)
        return [loss(s) for s in sets]

    def estimate(removed):  # the exact loss; honest about singles, blind to the pairs
        return Estimate(loss(removed), {h: costs[h] for h in HEADS if h not in removed})

    return loss, verify, estimate, calls


def test_the_search_never_exceeds_the_budget_and_reports_verified_losses():
    rng = np.random.default_rng(0)
    costs = {h: float(rng.exponential(0.01)) for h in HEADS}
    costs[(0, 0)] = -0.02  # a head the model is better without
    pairs = {((1, 1), (2, 2)): 5.0}  # redundant: cheap alone, expensive together
    costs[(1, 1)] = costs[(2, 2)] = 0.0
    loss, verify, estimate, calls = cost_model(costs, pairs)
    result = prune_search(HEADS, budget=0.05, estimate=estimate, verify=verify, shortlist=8, tries=3)
    assert result.loss == pytest.approx(loss(result.heads)) and result.loss <= 1.05
    assert len(set(result.heads)) == len(result.heads)
    assert (0, 0) in result.heads  # it lowers the loss: taken
    assert ((1, 1) in result.heads) != ((2, 2) in result.heads)  # exactly one of the redundant pair
    assert [n for n, _ in result.curve] == sorted(n for n, _ in result.curve) and result.curve[-1][1] == result.loss
    assert all(value == pytest.approx(loss(result.heads[:n])) for n, value in result.curve)
    assert result.verified_sets == calls["verify"]
    # Greedy by exact cost: as many heads as the cheapest additive choice, give or take the one the pair blocks.
    cheapest = sorted(c for h, c in costs.items() if h != (2, 2))
    affordable = int(np.searchsorted(np.cumsum(cheapest), 0.05, side="right"))
    assert len(result.heads) >= affordable - 2


def test_a_budget_nothing_fits_removes_nothing():
    costs = {h: 1.0 for h in HEADS}
    _, verify, estimate, _ = cost_model(costs, {})
    result = prune_search(HEADS, budget=0.5, estimate=estimate, verify=verify)
    assert result.heads == [] and result.loss == 1.0 and result.curve == [(0, 1.0)]


def test_each_round_removes_half_of_what_its_estimates_fit_in_the_gradient_pass_that_ranks_the_next():
    costs = {h: 0.001 * (i + 1) for i, h in enumerate(HEADS)}
    loss, verify, estimate, _ = cost_model(costs, {})
    asked, steps = [], []

    def asking(removed):
        asked.append(len(removed))
        return estimate(removed)

    result = prune_search(HEADS, budget=0.05, estimate=asking, verify=verify,
                          on_step=lambda found: steps.append(len(found.heads)))  # fmt: skip
    # round 1: 9 heads fit 0.05 by their (exact) estimates, half of them go (the one-shot answer, +0.010); round 2:
    # 5 of the 0.040 left, 2 go (+0.011); then 3, 2 and 1 fit: one head each; round 6: none fits the 0.005 left, and
    # the 8 best-ranked verified alone overshoot: it stops. Each step was verified by its own gradient pass.
    assert steps == [4, 6, 7, 8, 9] and result.one_shot == 4 and result.rounds == 6
    assert (
        asked == [0, 4, 6, 7, 8, 9] and result.verify_calls == 1 and result.stopped == "no shortlisted head fits alone"
    )
    assert all(value == pytest.approx(loss(result.heads[:n])) for n, value in result.curve)
    fits = int(np.searchsorted(np.cumsum(sorted(costs.values())), 0.05 + 1e-12, side="right"))  # 9 heads
    assert len(result.heads) == fits  # every head the exact costs allow


def test_an_estimate_that_stops_predicting_is_replaced_by_exact_costs():
    """A head the estimate calls the cheapest but whose removal costs a nat (a saturated head: its gradient is flat)
    spoils every prefix the estimate packs; the round then verifies its shortlist alone and packs by exact costs."""
    costs = {h: 0.001 * (i + 1) for i, h in enumerate(HEADS)}
    saturated = HEADS[5]
    costs[saturated] = 1.0
    loss, verify, _, calls = cost_model(costs, {})

    def estimate(removed):
        return Estimate(loss(removed), {h: -0.01 if h == saturated else costs[h] for h in HEADS if h not in removed})

    result = prune_search(HEADS, budget=0.05, estimate=estimate, verify=verify, first_shortlist=8)
    assert saturated not in result.heads and result.loss == pytest.approx(loss(result.heads)) and result.loss <= 1.05
    fits = int(np.searchsorted(np.cumsum(sorted(costs.values())), 0.05 + 1e-12, side="right"))
    assert len(result.heads) == fits  # every head the exact costs allow
    assert calls["verify"] >= 8  # the first round's 8 heads verified alone


def test_a_step_that_fits_takes_one_gradient_pass_and_no_replicated_pass():
    heads = [(layer, head) for layer in range(10) for head in range(10)]
    costs = {h: 0.0001 for h in heads}
    loss, verify, _, calls = cost_model(costs, {})
    asked = []

    def estimate(removed):
        asked.append(len(removed))
        return Estimate(loss(removed), {h: costs[h] for h in heads if h not in removed})

    result = prune_search(heads, budget=0.1, estimate=estimate, verify=verify, first_shortlist=40, patience=0)
    # every head fits: round 1 trusts 40 (first_shortlist) and removes 20; later rounds trust up to 96 (`longest`),
    # all that is left, and remove half of it, down to the last head
    assert [n for n, _ in result.curve] == [0, 20, 60, 80, 90, 95, 97, 98, 99, 100]
    assert asked == [n for n, _ in result.curve] and result.estimates == 10 and result.clean_loss == 1.0
    assert result.verify_calls == 0 and calls["verify"] == 0 and result.stopped == "every head removed"


def test_smaller_sizes_are_verified_only_where_a_step_overshoots_and_its_two_largest_halves_too():
    """A step that overshoots (its gradient pass's loss above the budget) is cut to the largest nested size that
    fits: half of it and a quarter in one replicated pass, the two smaller only where neither fits. Costs that make
    20, 10 and 5 heads overshoot and 2 fit: the second pass, for 2 and 1, takes 2."""
    heads = [(layer, head) for layer in range(10) for head in range(10)]
    costs = {h: 0.001 for h in heads}
    ranked = sorted(heads)
    for h in ranked[2:20]:
        costs[h] = 0.05  # heads ranked 3 to 20 cost far more than their estimates say
    loss, verify, _, calls = cost_model(costs, {})
    estimate = lambda removed: Estimate(loss(removed), {h: 0.001 for h in heads if h not in removed})  # noqa: E731
    result = prune_search(heads, budget=0.1, estimate=estimate, verify=verify, first_shortlist=40,
                          max_rounds=1)  # fmt: skip
    assert result.heads == ranked[:2] and result.loss == pytest.approx(loss(ranked[:2]))
    assert result.estimates == 2 and result.verify_calls == 2 and calls["verify"] == 4  # 10 and 5, then 2 and 1


def test_blind_estimates_still_find_the_cheapest_heads_by_their_exact_costs():
    rng = np.random.default_rng(1)
    costs = {h: float(rng.uniform(0.0, 0.004)) for h in HEADS}
    loss, verify, _, _ = cost_model(costs, {})

    def estimate(removed):  # blind (every head the same): the shortlists' order is arbitrary; exact costs decide
        return Estimate(loss(removed), {h: 0.0 for h in HEADS if h not in removed})

    result = prune_search(HEADS, budget=0.03, shortlist=24, verify=verify, estimate=estimate)
    assert result.loss <= 1.03 and result.loss == pytest.approx(1.0 + sum(costs[h] for h in result.heads))
    cheapest = int(np.searchsorted(np.cumsum(sorted(costs.values())), 0.03 + 1e-12, side="right"))
    assert len(result.heads) >= cheapest - 3


def growing_chain(per_pass: int, per_head: float = 0.09):
    """300 heads whose costs only the reversed order's prefixes fit, `per_head` nats each, and only
    `per_pass` more heads of that chain for each gradient pass so far: (heads, chain, estimate, verify) for
    prune_search."""
    heads = [(layer, head) for layer in range(50) for head in range(6)]
    chain = heads[::-1]
    passes = []

    def estimate(removed):  # its loss verifies `removed` as a verification after this pass would
        passes.append(len(removed))
        return Estimate(verify([removed])[0], {h: 1e-4 * chain.index(h) for h in heads if h not in removed})

    def verify(sets):
        return [1.0 + per_head * len(s) if set(s) == set(chain[: len(s)]) and len(s) <= per_pass * len(passes)
                else 2.0 for s in sets]  # fmt: skip

    return heads, chain, estimate, verify


@pytest.mark.parametrize(("patience", "kept", "rounds"), [(0, 50, 8), (1, 43, 3), (2, 46, 4)])
def test_patience_stops_rounds_that_add_almost_nothing_near_the_budget(patience, kept, rounds):
    """300 heads (4% is 12) at 1/128 nats each, exactly, within a budget of 50 of them: the rounds remove 24, 13, 6,
    3, 2, 1 and 1 heads (half of what the budget left fits). From the third on, each adds fewer than 12 and the next
    is expected to add fewer too: patience K stops the search after K of them; 0 goes on to all 50."""
    heads = [(layer, head) for layer in range(50) for head in range(6)]
    costs = {h: 1 / 128 for h in heads}
    loss, verify, _, _ = cost_model(costs, {})
    estimate = lambda removed: Estimate(loss(removed), {h: costs[h] for h in heads if h not in removed})  # noqa: E731
    result = prune_search(heads, budget=50 / 128, estimate=estimate, verify=verify, patience=patience)
    assert len(result.heads) == kept and result.rounds == rounds and result.loss == 1 + kept / 128
    if patience:
        assert result.stopped.startswith(f"patience: {patience} rounds in a row added fewer than 12 heads")
    else:
        assert result.stopped == "no shortlisted head fits alone"


def test_a_round_adding_under_4_percent_of_the_heads_counts_against_patience_only_near_the_budget():
    """300 heads: 4% is 12. Steps of the chain's prefixes overshoot beyond 4 more heads a pass, and are cut to
    what a replicated pass verifies: rounds of a few heads. At 0.09 nats a head the budget left soon buys fewer
    than 12 more at the verified cost per head, and patience stops the search; at 0.001 a head it buys hundreds,
    and the search goes on (a rule on the share of heads alone stopped it there, its budget barely spent)."""
    heads, chain, estimate, verify = growing_chain(per_pass=4)
    result = prune_search(heads, budget=0.5, estimate=estimate, verify=verify, first_shortlist=4,
                          max_rounds=8)  # fmt: skip
    assert result.heads == chain[:4] and result.rounds == 3 and result.stopped.startswith("patience: 2 rounds")
    heads, chain, estimate, verify = growing_chain(per_pass=4, per_head=0.001)
    result = prune_search(heads, budget=0.5, estimate=estimate, verify=verify, first_shortlist=4,
                          max_rounds=8)  # fmt: skip
    assert result.heads == chain[:55] and result.stopped == "max_rounds: 8 rounds"


def test_an_interrupted_search_resumes_from_its_journal_to_the_same_result(tmp_path):
    from headscope.errors import OutputError
    from headscope.interventions.journal import SearchJournal

    rng = np.random.default_rng(2)
    costs = {h: float(rng.exponential(0.01)) for h in HEADS}
    pairs = {((1, 1), (2, 2)): 5.0, ((0, 3), (3, 0)): 0.02}
    _, verify, estimate, _ = cost_model(costs, pairs)
    options = {"budget": 0.08, "shortlist": 6, "first_shortlist": 8, "tries": 3}
    whole = prune_search(HEADS, estimate=estimate, verify=verify, **options)
    assert whole.verify_calls >= 4

    class Interrupted(Exception):
        pass

    live = {"verify": 0}

    def verify_until(limit):
        def counted(sets):
            if live["verify"] == limit:
                raise Interrupted
            live["verify"] += 1
            return verify(sets)

        return counted

    path, key = tmp_path / "journal.json", {"budget": 0.08}
    first = SearchJournal(path, key, resume=True)
    with pytest.raises(Interrupted):
        prune_search(HEADS, estimate=first.estimate(estimate), verify=first.verify(verify_until(3)), **options)
    live["verify"] = 0
    again = SearchJournal(path, key, resume=True)
    resumed = prune_search(HEADS, estimate=again.estimate(estimate), verify=again.verify(verify_until(-1)), **options)
    assert (resumed.heads, resumed.curve, resumed.loss) == (whole.heads, whole.curve, whole.loss)
    assert again.replayed >= 4 and live["verify"] == whole.verify_calls - 3  # only what was not done yet ran
    with pytest.raises(OutputError, match="budget differ"):
        SearchJournal(path, {"budget": 0.09}, resume=True)


def journal_of_a_search(tmp_path):
    """A journal of the toy search, its path and fingerprint, and what replaying it asks."""
    from headscope.interventions.journal import SearchJournal

    costs = {h: 0.001 * (i + 1) for i, h in enumerate(HEADS)}
    _, verify, estimate, _ = cost_model(costs, {})
    options = {"budget": 0.08, "shortlist": 6, "first_shortlist": 8, "tries": 3}
    path, key = tmp_path / "journal.json", {"budget": 0.08}
    journal = SearchJournal(path, key, resume=True, candidates=HEADS)
    whole = prune_search(HEADS, estimate=journal.estimate(estimate), verify=journal.verify(verify), **options)

    def replay():
        again = SearchJournal(path, key, resume=True, candidates=HEADS)
        return prune_search(HEADS, estimate=again.estimate(estimate), verify=again.verify(verify), **options)

    return path, whole, replay


def edited(path, change) -> None:
    """Apply `change` to the journal's record, keeping its checksum as it was (a hand edit)."""
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def resealed(path, change) -> None:
    """Apply `change` and recompute the checksum: the answers' form is checked on its own."""
    from headscope.interventions.journal import _checksum

    record = json.loads(path.read_text())
    change(record)
    record["checksum"] = _checksum(record["fingerprint"], record["calls"])
    path.write_text(json.dumps(record))


def test_a_journal_edited_by_hand_is_refused_in_one_line(tmp_path):
    """A verified loss changed by hand is not replayed as what the model said: the checksum refuses it."""
    from headscope.errors import OutputError

    path, whole, replay = journal_of_a_search(tmp_path)
    assert replay().loss == whole.loss  # untouched: replayed to the same result

    def lower_a_loss(record):
        call = next(c for c in record["calls"] if c["call"] == "verify")
        call["answer"][0] -= 0.5

    edited(path, lower_a_loss)
    with pytest.raises(OutputError, match="was changed after the search wrote it"):
        replay()


@pytest.mark.parametrize(
    "damage",
    [
        lambda call: call.__setitem__("answer", "0.5") if call["call"] == "verify" else None,  # a string
        lambda call: call["answer"].pop() if call["call"] == "verify" else None,  # one loss short
        lambda call: call["answer"]["costs"].pop() if call["call"] == "estimate" else None,  # a head missing
        lambda call: call["answer"]["costs"].append([99, 0, 0.1]) if call["call"] == "estimate" else None,  # unknown
        lambda call: call["answer"]["costs"].__setitem__(0, [0, 0, "x"]) if call["call"] == "estimate" else None,
        lambda call: call["answer"].__setitem__("loss", None) if call["call"] == "estimate" else None,  # no loss
        lambda call: call.__setitem__("answer", call["answer"]["costs"]) if call["call"] == "estimate" else None,
    ],
    ids=["string", "short", "missing-head", "unknown-head", "not-a-number", "no-loss", "costs-alone"],
)
def test_a_malformed_journal_answer_is_refused_in_one_line(tmp_path, damage):
    from headscope.errors import OutputError

    path, _, replay = journal_of_a_search(tmp_path)
    resealed(path, lambda record: [damage(call) for call in record["calls"]])
    with pytest.raises(OutputError, match="is not one the search gives"):
        replay()


def test_the_curvature_term_is_half_the_squared_change_along_the_gradient_on_real_positions():
    """OutputSums with curvature_of sums ((r - o) . dL/do)^2 over the unpadded positions; Removal.curvature halves it
    per token. A loss linear in the outputs, L = sum c . o, has dL/do = c: a known gradient."""
    from headscope.interventions.removal import OutputSums, Removal

    rng = np.random.default_rng(3)
    outputs = torch.tensor(rng.normal(size=(2, 3, 2, 4)), requires_grad=True)  # (batch, t, heads, head_dim)
    c = torch.tensor(rng.normal(size=(2, 3, 2, 4)))
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # the second sentence padded on the left
    means = rng.normal(size=(1, 2, 4))
    for removal, r in [(Removal("mean", means), means[0]), (Removal("zero"), np.zeros((2, 4)))]:
        sums = OutputSums([0], 2, 4, grad=True, curvature_of=removal)
        sums.start(SimpleNamespace(attention_mask=mask))
        kept = sums.output(0, outputs.clone())
        (kept * c).sum().backward()
        sums.collect()
        o, g = outputs.detach().numpy(), c.numpy()
        expected = np.zeros(2)
        for b, t in zip(*np.nonzero(mask.numpy()), strict=True):
            expected += (((r - o[b, t]) * g[b, t]).sum(-1)) ** 2
        np.testing.assert_allclose(sums.sum_squared_change[0], expected, rtol=1e-12)
        np.testing.assert_allclose(removal.curvature(sums, 4)[0], expected / 8, rtol=1e-12)
    with pytest.raises(ValueError, match="did not record"):
        Removal("mean", means).curvature(sums, 4)  # the zero removal's sums
    # The moments give every replacement's term after the pass (importance's estimates: the mean is known only then).
    moments = OutputSums([0], 2, 4, grad=True, moments=True)
    moments.start(SimpleNamespace(attention_mask=mask))
    (moments.output(0, outputs.clone()) * c).sum().backward()
    moments.collect()
    for removal, r in [(Removal("mean", means), means[0]), (Removal("zero"), np.zeros((2, 4)))]:
        expected = sum((((r - o[b, t]) * g[b, t]).sum(-1)) ** 2 for b, t in zip(*np.nonzero(mask.numpy()), strict=True))
        np.testing.assert_allclose(moments.curvatures(removal, 4)[0], expected / 8, rtol=1e-10)


# ---------------------------------------------------------------- on models


@pytest.fixture(scope="module")
def redundant(tmp_path_factory):
    from planted import build_planted_copier, copy_words

    folder = build_planted_copier(tmp_path_factory.mktemp("redundant") / "model", copiers=(0, 1), logit=20.0)
    words = copy_words()
    sentences = [" ".join([words[i % 7]] * (3 + i % 6)) for i in range(30)]
    return headscope.load_model(str(folder), device="cpu", lm_head=True), sentences


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_verifying_sets_alone_stops_the_first_pass_where_the_replicas_start(redundant, mode):
    """prune reads only the sets' losses: the first pass of each batch runs only the layers the replicas are handed
    (here layer 0 of 2), the sets' losses equal those of a whole first pass, and the planned layer runs equal the
    blocks the model runs."""
    from headscope.interventions.loss_model import loss_model
    from headscope.model.loading import load_for_run
    from headscope.run.setup import CommandRun

    loaded, sentences = redundant
    run = CommandRun.prepare(loaded, sentences, config=None, options={"batch_size": 8}, reporter=None)
    blocks = {"runs": 0}
    hooks = [block.register_forward_pre_hook(lambda *_: blocks.update(runs=blocks["runs"] + 1))
             for block in loaded.lm.transformer.h]  # fmt: skip
    base, sets = [(0, 0)], [[(0, 0), (1, 1)], [(0, 0), (1, 2)], [(0, 0), (1, 1), (1, 3)]]
    try:
        session = run.session(loaded, load_for_run, what="prune", lm_head=True)
        with (
            session as opened,
            loss_model(opened.loaded, opened.plan, run.corpus, run.reporter, opened.ranks, "prune") as lm,
        ):
            removal, batches = lm.removal(mode), len(list(lm.batches()))
            found = {}
            for clean in (True, False):
                planned, before = lm.planned(sets, mode, base, clean=clean), blocks["runs"]
                found[clean] = lm.losses(sets, removal, base=base, clean=clean).arrays("all")
                assert planned.layer_runs == blocks["runs"] - before, clean
                found[clean] += (planned,)
    finally:
        for hook in hooks:
            hook.remove()
    (tokens, clean_losses, ablated, whole), (_, nan, alone, short) = found[True], found[False]
    np.testing.assert_array_equal(ablated, alone)
    assert np.isnan(nan).all() and np.isfinite(clean_losses).all() and tokens.sum() > 0
    assert short.forwards == whole.forwards and batches > 1  # each batch's first pass still runs, only shorter:
    assert whole.layer_runs - short.layer_runs == batches  # its layer 1 is not run


def test_prune_keeps_one_of_two_redundant_heads_and_saves_a_model_that_computes_it(redundant, tmp_path):
    loaded, sentences = redundant
    found = headscope.prune(
        loaded, sentences, budget=0.01, mode="zero", out=tmp_path / "prune", save_model=tmp_path / "model"
    )
    record = found.record
    removed = {tuple(map(int, name.split("."))) for name in record["heads"]}
    assert len(removed) == 7 and ((0, 0) in removed) != ((0, 1) in removed)  # every head but one copier
    assert record["pruned_loss"] - record["clean_loss"] <= 0.01
    ids = [loaded.tokenizer(s)["input_ids"] for s in sentences]
    clean, ablated, _ = hooked_losses(loaded.lm, loaded.lm.transformer.h, ids, sorted(removed), "zero", "all", 24)
    assert record["clean_loss"] == pytest.approx(clean, abs=1e-4)
    assert record["pruned_loss"] == pytest.approx(ablated, abs=1e-4)
    mask = pd.read_parquet(tmp_path / "prune" / "head_mask.parquet")
    assert mask.shape == (2, 4) and mask.to_numpy().sum() == 1
    assert all(mask.at[layer, str(head)] == 0 for layer, head in removed)
    assert (tmp_path / "prune" / "prune_curve.png").stat().st_size > 0
    assert json.loads((tmp_path / "prune" / "prune.json").read_text())["heads"] == record["heads"]
    # The saved checkpoint, loaded by transformers alone, computes the pruned loss.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    own, _, _ = hooked_losses(saved, saved.transformer.h, ids, [], "zero", "all", 24)
    assert own == pytest.approx(record["pruned_loss"], abs=1e-4)
    assert record["saved_model"]["loss"] == pytest.approx(own, abs=1e-5)
    assert json.loads((tmp_path / "model" / "pruned.json").read_text())["heads_removed"] == record["heads"]


def test_mean_pruning_a_llama_folds_the_means_into_new_biases(tmp_path, corpus_lines):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from helpers import tiny_model_folder

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4
    )
    folder = tiny_model_folder(tmp_path / "llama", config, LlamaForCausalLM, corpus_lines)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    lines = corpus_lines[:10]
    found = headscope.prune(loaded, lines, budget=0.02, mode="mean", save_model=tmp_path / "pruned", charts=None)
    record = found.record
    assert record["heads"] and record["pruned_loss"] - record["clean_loss"] <= 0.02
    heads = [tuple(map(int, name.split("."))) for name in record["heads"]]
    ids = [loaded.tokenizer(s)["input_ids"] for s in lines]
    _, ablated, _ = hooked_losses(loaded.lm, loaded.lm.model.layers, ids, heads, "mean", "all", 8)
    assert record["pruned_loss"] == pytest.approx(ablated, abs=1e-4)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    assert saved.config.attention_bias and saved.model.layers[0].self_attn.o_proj.bias is not None
    own, _, _ = hooked_losses(saved, saved.model.layers, ids, [], "zero", "all", 8)
    assert own == pytest.approx(record["pruned_loss"], abs=1e-4)
    # The caller's model is as it was: no bias added, weights untouched.
    assert loaded.lm.model.layers[0].self_attn.o_proj.bias is None and not loaded.lm.config.attention_bias
    clean, _, _ = hooked_losses(loaded.lm, loaded.lm.model.layers, ids, [], "zero", "all", 8)
    assert clean == pytest.approx(record["clean_loss"], abs=1e-4)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--budget", "0"], ["--budget must be a positive number"]),
        (["--budget", "nan"], ["--budget must be a positive number"]),
        (["--budget", "0.1", "--mode", "half"], ["--mode"]),
        (["--budget", "0.1", "--max-rounds", "-1"], ["--max-rounds must be a whole number"]),
        (["--budget", "0.1", "--patience", "-1"], ["--patience must be a whole number"]),
    ],
)
def test_prune_refuses_bad_options_before_loading(args, fragments, tmp_path):
    result = run_cli("prune", "gpt2", *args, "--out", str(tmp_path / "p"), loader=refuse_to_load)
    assert_one_line_error(result, *fragments, code=2)


def test_prune_refuses_one_folder_for_both_outputs(tmp_path):
    with pytest.raises(ConfigError, match="--out and --save-model name the same folder"):
        headscope.prune("gpt2", budget=0.1, out=tmp_path / "x", save_model=tmp_path / "x", loader=refuse_to_load)


def test_prune_through_the_cli(redundant, tmp_path):
    loaded, sentences = redundant
    corpus = tmp_path / "repeats.txt"
    corpus.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    out = tmp_path / "prune"
    args = ["prune", str(loaded.source.location), "--budget", "0.01", "--mode", "zero", "--corpus", str(corpus)]
    result = run_cli(*args, "--out", str(out), "--no-charts")
    assert result.exit_code == 0, result.output
    assert "removed 7 of 8 heads" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["head_mask.parquet", "prune.html", "prune.json"]
    unbounded = json.loads((out / "prune.json").read_text())["search"]
    # --max-rounds and --patience reach the search, not only the record: one round, where the whole search ran more
    result = run_cli(*args, "--out", str(tmp_path / "one"), "--no-charts", "--max-rounds", "1", "--patience", "0",
                     "--no-page")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["head_mask.parquet", "prune.json"]  # --no-page
    search = json.loads((tmp_path / "one" / "prune.json").read_text())["search"]
    assert unbounded["rounds"] > 1 and unbounded["patience"] == 2 and unbounded["max_rounds"] is None
    assert (search["rounds"], search["stopped"], search["patience"]) == (1, "max_rounds: 1 rounds", 0)


@pytest.mark.parametrize("state", ["users", "ablation"])
@pytest.mark.parametrize("target", ["prune --out", "prune --save-model", "ablate --out"])
def test_ablate_and_prune_never_replace_what_they_did_not_make(redundant, tmp_path, state, target):
    from helpers import snapshot

    loaded, sentences = redundant
    corpus = tmp_path / "repeats.txt"
    corpus.write_text("\n".join(sentences[:6]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    if state == "users":
        out.mkdir()
        (out / "config.json").write_text("{}")  # a name a checkpoint holds, but the user's
        (out / "notes.md").write_text("mine\n")
    else:
        assert (
            run_cli("ablate", loaded.source.location, "--heads", "0.0", "--corpus", corpus, "--out", out).exit_code == 0
        )
    model = str(loaded.source.location)
    args = {
        "prune --out": ["prune", model, "--budget", "0.01", "--out", out],
        "prune --save-model": ["prune", model, "--budget", "0.01", "--out", tmp_path / "p", "--save-model", out],
        "ablate --out": ["ablate", model, "--heads", "0.1", "--out", out],
    }[target]
    before = snapshot(tmp_path)
    result = run_cli(*args, "--corpus", corpus, "--overwrite")
    if state == "ablation" and target == "ablate --out":
        assert result.exit_code == 0, result.output  # its own kind, with --overwrite
        assert json.loads((out / "ablation.json").read_text())["groups"][0]["heads"] == ["0.1"]
        return
    assert_one_line_error(result, "is not a headscope")
    assert snapshot(tmp_path) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_prune_draws_its_curve_in_the_format_asked(redundant, tmp_path):
    loaded, sentences = redundant
    headscope.prune(loaded, sentences[:8], budget=0.01, mode="zero", out=tmp_path / "p", charts="svg")
    written = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert written == ["head_mask.parquet", "prune.html", "prune.json", "prune_curve.svg"]


# ---------------------------------------------------------------- what can be checked before the search is


class RefuseToSearch(NullReporter):
    """A progress reporter that fails the test if the search starts: the check under test must come first."""

    def stage(self, text: str) -> None:
        assert not text.startswith("pruning within"), "the search started before the refusal"


def test_a_save_that_cannot_be_made_is_refused_before_the_search(tmp_path, corpus_lines, monkeypatch):
    from transformers import MistralConfig, MistralForCausalLM

    from helpers import tiny_model_folder

    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    mistral = tiny_model_folder(tmp_path / "mistral", config, MistralForCausalLM, corpus_lines)
    lines = corpus_lines[:6]
    with pytest.raises(ConfigError, match="have none its config can add: save with --mode zero"):
        headscope.prune(
            str(mistral), lines, budget=0.1, mode="mean", save_model=tmp_path / "s", reporter=RefuseToSearch()
        )
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=10**12 - 4096, free=4096))
    with pytest.raises(ResourceError, match=r"needs about .* and .* has 0.0 MiB free"):
        headscope.prune(
            str(mistral), lines, budget=0.1, mode="zero", save_model=tmp_path / "s", reporter=RefuseToSearch()
        )
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "out, save, fragment",
    [("p", "p/model", "--save-model is inside --out"), ("m/prune", "m", "--out is inside --save-model"),
     ("x", "x", "name the same folder")],
)  # fmt: skip
def test_out_and_save_model_are_folders_side_by_side(out, save, fragment, tmp_path):
    result = run_cli("prune", "gpt2", "--budget", "0.1", "--out", tmp_path / out, "--save-model", tmp_path / save,
                     loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(result, fragment, code=2)


def test_a_save_that_fails_after_the_search_keeps_the_search(redundant, tmp_path):
    """Whatever goes wrong in saving, prune.json (the verified result) is published, saying what failed."""
    from headscope.model.loading import load_for_run

    def failing_save(source, settings, model_config, lm_head):
        loaded = load_for_run(source, settings, model_config, lm_head)

        def save_pretrained(*args, **kwargs):
            raise RuntimeError("this architecture cannot be written")

        loaded.lm.save_pretrained = save_pretrained
        return loaded

    loaded, sentences = redundant
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences) + "\n")
    out, model = tmp_path / "prune", tmp_path / "model"
    result = run_cli("prune", loaded.source.location, "--corpus", corpus, "--budget", "0.01", "--mode", "zero",
                     "--out", out, "--save-model", model, loader=failing_save)  # fmt: skip
    assert_one_line_error(result, "the pruned model was not saved", "cannot be written", f"were written to {out}")
    record = json.loads((out / "prune.json").read_text())
    assert len(record["heads"]) == 7 and "cannot be written" in record["saved_model"]["error"]
    assert not model.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


class Notes(NullReporter):
    """Keeps the notes; raises KeyboardInterrupt at the stage starting `interrupt_at`, or at the note (an accepted
    step) numbered `interrupt_at_step`."""

    def __init__(self, interrupt_at: str | None = None, interrupt_at_step: int | None = None) -> None:
        self.notes, self.interrupt_at, self.interrupt_at_step = [], interrupt_at, interrupt_at_step

    def note(self, text: str) -> None:
        self.notes.append(text)
        steps = sum("heads removed (+" in n for n in self.notes)
        if "heads removed (+" in text and steps == self.interrupt_at_step:
            raise KeyboardInterrupt

    def stage(self, text: str) -> None:
        if self.interrupt_at and text.startswith(self.interrupt_at):
            raise KeyboardInterrupt

    def start(self, total_sentences: int, what: str = "measuring") -> None:
        self.bars = [*getattr(self, "bars", []), [what, total_sentences, 0]]

    def advance(self, sentences: int, tokens: int) -> None:
        self.bars[-1][2] += sentences


def test_prune_says_which_heads_each_step_removed_and_what_it_plans(redundant, tmp_path):
    loaded, sentences = redundant
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences) + "\n")
    args = ["prune", loaded.source.location, "--corpus", corpus, "--budget", "0.01", "--mode", "zero", "--no-charts"]
    notes = Notes()
    assert run_cli(*args, "--out", tmp_path / "a", reporter=notes).exit_code == 0
    steps = [n for n in notes.notes if "heads removed (+" in n]
    assert steps and all("(+-" not in n and "nats)" in n for n in steps)
    named = [h for n in steps for h in n.split("(+")[1].split(")")[0].split(",")]
    record = json.loads((tmp_path / "a" / "prune.json").read_text())
    assert named == record["heads"]  # every head, in order, once
    planned = [n for n in notes.notes if n.startswith("planned: a gradient pass for the clean loss")]
    assert planned and "8 heads verified alone (8 in the first round)" in planned[0]
    search = record["search"]
    assert search["forward_passes"] >= search["verify_calls"] * 2 and search["gradient_passes"] >= 1
    # every pass of the search has a bar naming the pass, the heads removed and the verified loss, and it fills
    assert notes.bars[0][0] == "clean loss and first ranking (0 heads removed so far, loss +0.0000 of 0.01 nats)"
    verifying = [bar for bar in notes.bars if bar[0].startswith("verifying")]
    gradient = [bar for bar in notes.bars if bar[0].startswith(("clean loss", "gradient pass with"))]
    assert len(verifying) == search["verify_calls"] and len(gradient) == search["gradient_passes"]
    assert all(done == total for _, total, done in notes.bars)
    result = run_cli(*args, "--out", tmp_path / "b", reporter=Notes(interrupt_at_step=1))
    kept = tmp_path / ".b.partial"
    assert result.exit_code == 130 and (kept / "prune-journal.json").is_file()  # every search keeps its journal
    assert f"kept in {kept}: the same command with --resume continues it" in " ".join(result.output.split())
    from headscope.output import kept_checkpoints

    before = kept_checkpoints()
    with pytest.raises(KeyboardInterrupt):  # no output folder: no journal, and nothing for --resume to continue
        headscope.prune(loaded, sentences, budget=0.01, mode="zero", reporter=Notes(interrupt_at_step=1))
    assert kept_checkpoints() == before


def test_an_interrupted_prune_resumes_to_the_result_an_uninterrupted_one_gives(redundant, tmp_path):
    loaded, sentences = redundant
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences) + "\n")
    args = ["prune", loaded.source.location, "--corpus", corpus, "--budget", "0.01", "--mode", "mean", "--no-charts"]
    assert run_cli(*args, "--out", tmp_path / "whole").exit_code == 0
    whole = json.loads((tmp_path / "whole" / "prune.json").read_text())
    assert len(whole["curve"]) >= 3  # at least two accepted steps: one to interrupt after, one to resume to
    interrupted = run_cli(*args, "--out", tmp_path / "r", "--resume", reporter=Notes(interrupt_at_step=1))
    assert interrupted.exit_code == 130
    journal = tmp_path / ".r.partial" / "prune-journal.json"
    assert json.loads(journal.read_text())["state"]["heads"] == whole["heads"][: whole["curve"][1]["heads_removed"]]
    refused = run_cli(*args, "--out", tmp_path / "r")  # without --resume the checkpoint is not someone else's
    assert_one_line_error(refused, "interrupted `headscope prune` run", code=1)
    notes = Notes()
    resumed = run_cli(*args, "--out", tmp_path / "r", "--resume", reporter=notes)
    assert resumed.exit_code == 0, resumed.output
    record = json.loads((tmp_path / "r" / "prune.json").read_text())
    for key in ("heads", "curve", "clean_loss", "pruned_loss", "set_aside"):
        assert record[key] == whole[key], key
    assert record["search"]["resumed_calls"] >= 2 and record["search"]["rounds"] == whole["search"]["rounds"]
    for count in ("forward_passes", "token_forwards", "verified_sets", "verify_calls", "gradient_passes"):
        assert record["search"][count] == whole["search"][count], count  # the whole search's, replayed part included
    assert any(n.startswith("resuming the interrupted search: ") for n in notes.notes)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["head_mask.parquet", "prune.html", "prune.json"]
    assert not (tmp_path / ".r.partial").exists()


def test_prune_removes_heads_of_the_layers_it_is_given_only(redundant, tmp_path):
    loaded, sentences = redundant
    everywhere = headscope.prune(loaded, sentences, budget=0.01, mode="zero")
    assert {layer for layer, _ in everywhere.result.heads} == {0, 1}
    found = headscope.prune(loaded, sentences, budget=0.01, mode="zero", layers=[1])
    assert found.result.heads and {layer for layer, _ in found.result.heads} == {1}
    assert found.record["search"]["candidates"] == 4 and list(found.record["settings"]["layers"]) == [1]


@pytest.fixture(scope="module")
def prefix_models(redundant, tmp_path_factory, corpus_lines):
    """The planted GPT-2, a grouped-KV Llama (8 query heads on 4 KV heads) and a Gemma 2 (post-attention norms, a
    sliding window, softcapping): a pass started from the prefix must hand each its own layer output."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    from helpers import tiny_model_folder

    configs = {
        "llama-gqa": (LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                  num_key_value_heads=4), LlamaForCausalLM),
        "gemma2": (Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, sliding_window=4, attn_logit_softcapping=5.0,
                                query_pre_attn_scalar=16, max_position_embeddings=128), Gemma2ForCausalLM),
    }  # fmt: skip
    models = {"gpt2": redundant}
    for name, (config, model_class) in configs.items():
        folder = tiny_model_folder(tmp_path_factory.mktemp(name), config, model_class, corpus_lines)
        models[name] = (headscope.load_model(str(folder), device="cpu", lm_head=True), corpus_lines[:12])
    return models


@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa", "gemma2"])
@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_passes_from_the_clean_prefix_give_the_numbers_of_whole_passes(prefix_models, arch, mode):
    """A gradient pass and a replicated pass that start at layer 1 from the clean prefix give the loss, every layer-1
    head's estimate and every set's per-sentence losses of the same passes run from the embeddings, to the bit."""
    from headscope.interventions.loss_model import loss_model
    from headscope.model.loading import load_for_run
    from headscope.run.setup import CommandRun

    loaded, sentences = prefix_models[arch]
    run = CommandRun.prepare(loaded, sentences, config=None, options={"batch_size": 8}, reporter=None)
    base, sets = [(1, 0)], [[(1, 0), (1, 1)], [(1, 0), (1, 2), (1, 3)]]
    found = []
    with (
        run.session(loaded, load_for_run, what="prune", lm_head=True) as opened,
        loss_model(opened.loaded, opened.plan, run.corpus, run.reporter, opened.ranks, "p") as lm,
    ):
        removal = lm.removal(mode)
        for skip in (False, True):
            if skip:
                lm.skip_below(1)
                assert lm.prefix is not None and lm.prefix.layer == 1
            loss, costs = lm.estimated_costs(base, removal)
            found.append(
                (loss, [costs[1, head] for head in range(4)], lm.losses(sets, removal, base=base).arrays("all"))
            )
    (whole_loss, whole_costs, whole_sets), (loss, costs, from_prefix) = found
    assert loss == whole_loss and costs == whole_costs
    for whole, part in zip(whole_sets, from_prefix, strict=True):
        np.testing.assert_array_equal(part, whole)


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_prune_of_later_layers_runs_the_layers_below_them_once(redundant, mode):
    """Every head of --layers 1 is in layer 1: layer 0 computes the clean model's output in every pass of the search,
    so it runs once per batch for the whole search (and once more for the means), every gradient and replicated pass
    starts at layer 1 from what it returned, and each verified loss of the curve is the loss of its heads removed,
    computed independently with hooks."""
    loaded, sentences = redundant
    rows = {"layer 0": 0, "layer 1": 0}  # the sentences each layer ran, over every pass

    def counter(name):
        return lambda module, args, kwargs: rows.update(
            {name: rows[name] + len(kwargs.get("hidden_states", *args[:1]))}
        )

    hooks = [block.register_forward_pre_hook(counter(name), with_kwargs=True)
             for name, block in zip(rows, loaded.lm.transformer.h, strict=True)]  # fmt: skip
    try:
        found = headscope.prune(loaded, sentences, budget=0.01, mode=mode, layers=[1], batch_size=8)
    finally:
        for hook in hooks:
            hook.remove()
    assert rows["layer 0"] == len(sentences) * (2 if mode == "mean" else 1)  # the prefix (and the means' pass)
    search = found.result  # each gradient pass runs layer 1 once a sentence, each replicated pass once a set
    assert rows["layer 1"] == len(sentences) * (search.estimates + search.verified_sets + (mode == "mean"))
    passes = found.record["search"]
    assert found.result.heads and {layer for layer, _ in found.result.heads} == {1}
    ids = [loaded.tokenizer(s)["input_ids"] for s in sentences]
    for size, loss in found.result.curve[1:]:
        heads = found.result.heads[:size]
        _, expected, _ = hooked_losses(loaded.lm, loaded.lm.transformer.h, ids, heads, mode, "all", 24)
        assert loss == pytest.approx(expected, abs=1e-5), (heads, passes)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [({"max_rounds": -1}, "--max-rounds"), ({"patience": -2}, "--patience"), ({"resume": True}, "--out")],
)
def test_prune_refuses_a_stopping_rule_that_cannot_be(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        headscope.prune("gpt2", budget=0.1, loader=refuse_to_load, **options)


def test_a_gguf_model_is_saved_as_its_float_weights(tmp_path, monkeypatch):
    """A GGUF file read by transformers itself (its cache turned off) is de-quantized on loading, and transformers
    refuses to save a model its GGUF quantizer is attached to ("not serializable"), which once crashed `prune
    --save-model` after the whole search. The pruned weights save as a plain checkpoint that computes what the pruned
    model in memory computes, and the loaded model keeps its quantizer record."""
    import torch
    from transformers import AutoModelForCausalLM

    from headscope.interventions.removal import Removal
    from headscope.interventions.surgery import check_savable, pruned_weights
    from headscope.model.gguf_cache import LIMIT_VARIABLE, plain_checkpoint

    from tiny_gguf import HEADS, HIDDEN, write_tiny_gguf

    monkeypatch.setenv(LIMIT_VARIABLE, "0")
    loaded = headscope.load_model(str(write_tiny_gguf(tmp_path / "tiny.gguf")), device="cpu", lm_head=True)
    lm, head_dim = loaded.lm, HIDDEN // HEADS
    assert lm.hf_quantizer is not None
    check_savable(lm, tmp_path / "saved", mean=True, head_count=HEADS, head_dim=head_dim)  # nothing to refuse
    ids = torch.tensor([loaded.tokenizer("the cat sat on the mat, then the man ran")["input_ids"]])
    with (
        pruned_weights(lm, [(0, 0), (1, 3)], Removal("zero"), head_count=HEADS, head_dim=head_dim),
        plain_checkpoint(lm),
    ):
        lm.save_pretrained(tmp_path / "saved")
        with torch.no_grad():
            expected = lm(ids).logits
    assert lm.hf_quantizer is not None and hasattr(lm.config, "quantization_config")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    assert getattr(saved, "hf_quantizer", None) is None
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, expected, rtol=0, atol=1e-5)  # eager against sdpa
