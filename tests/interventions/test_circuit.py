"""`headscope circuit`: every edge's EAP and EAP-IG score and every component's DLA against a plain computation
(tests/support/reference_edges.py: the metric's derivative with the sender's change added into one receiver's channel,
one pair at a time, in float64), a planted induction circuit, invariance to batching and pair order, and the
command's surface."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import headscope
from headscope.cli import app
from headscope.config import RunConfig
from headscope.interventions.edge_graph import (
    build_graph,
    circuit_size,
    curve_areas,
    faithfulness,
    greedy_edges,
    outside,
    ranked_edges,
)
from headscope.interventions.edges import EdgeModel
from headscope.interventions.pairs import pairs_from_records, tokenize_pairs
from headscope.model.capture import attached
from headscope.run.plan import plan_for_model

from helpers import assert_one_line_error, tiny_lm_config, tiny_model_folder
from planted import build_planted_induction
from reference_edges import Reference
from tolerances import UNIT

# The float32 scores against the float64 plain computation: the bar (the differences measured 3e-8 on both
# models, float32 rounding of sums of some hundred products of size ~1).
CLOSE = 1e-4


def word_pairs(tokenizer, count: int = 3) -> list[dict]:
    """Pairs of one length and of another (two batches), each clean prompt repeating a word the corrupt one does not."""
    words = [w for w in tokenizer.get_vocab() if w.isalpha()][:12]
    pairs = [{"clean": f"{words[0]} {words[1]} {words[2]} {words[0]}", "corrupt": f"{words[3]} {words[1]} {words[2]} "
              f"{words[0]}", "answer": words[1], "distractor": words[4]}]  # fmt: skip
    pairs += [{"clean": f"{words[5 + i]} {words[6]} {words[5 + i]}", "corrupt": f"{words[9]} {words[6]} {words[5 + i]}",
               "answer": words[6], "distractor": words[8]} for i in range(count - 1)]  # fmt: skip
    return pairs


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2"])
def tiny_lm(request, tmp_path_factory, corpus_lines):
    """GPT-2 (biases everywhere, a fused q|k|v projection), a grouped-KV Llama (8 query heads on 4 KV heads) or a
    grouped-KV Gemma 2 (post-attention and post-MLP norms, (1 + w) RMS norms, scaled embeddings, softcapped
    attention and logits)."""
    config, model_class = tiny_lm_config(request.param, 2, final_logit_softcapping=5.0)
    folder = tiny_model_folder(tmp_path_factory.mktemp(request.param), config, model_class, corpus_lines)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    return loaded, tokenize_pairs(pairs_from_records(word_pairs(loaded.tokenizer)), loaded.tokenizer, None)


def scores(loaded, pairs, method, steps=3, **settings):
    plan = plan_for_model(RunConfig(**settings), loaded)
    with attached(loaded.lm) as capture:
        return EdgeModel(capture, loaded, plan).scores(pairs, method=method, steps=steps)


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
@pytest.mark.first_case_fast
def test_every_edge_equals_the_plain_computation(tiny_lm, method):
    loaded, pairs = tiny_lm
    found = scores(loaded, pairs, method)
    reference, graph = Reference(loaded.lm), found.graph
    assert found.scores.shape == (len(pairs), len(graph.senders), len(graph.receivers))
    pair = pairs[0]
    worst = 0.0
    for s, sender in enumerate(graph.senders):
        for r, (receiver, channel) in enumerate(graph.receivers):
            if not graph.edges[s, r]:
                assert (found.scores[:, s, r] == 0).all()  # no edge, no score
                continue
            want = reference.edge(pair, sender, receiver, channel, steps=3 if method == "eap-ig" else None)
            worst = max(worst, abs(found.scores[0, s, r] - want))
    assert worst < CLOSE
    assert np.abs(found.scores[0]).max() > 0.1  # scores that can tell an error from rounding


def test_a_finite_difference_agrees_on_a_few_edges(tiny_lm):
    """The derivative the plain computation takes by autograd, taken again by a central difference. Llama's and
    Gemma's RMS norms compute in float32 even on a float64 model: each of the 2 x layers + 1 norms rounds the stream
    to float32's unit roundoff of its size, which moves m (a difference of logits) by up to that share of the
    logits' size, and the difference divides it by the step. A step of 1e-3 balances that rounding against the
    difference's own error (~step^2): the two agree to 1e-3 of the score and the rounding's bound."""
    loaded, pairs = tiny_lm
    found, reference = scores(loaded, pairs, "eap"), Reference(loaded.lm)
    graph, step = found.graph, 1e-3
    with torch.no_grad():
        logits = float(loaded.lm(torch.tensor([pairs[0].clean_ids])).logits[0, -1].abs().max())
    rounding = (2 * loaded.lm.config.num_hidden_layers + 1) * UNIT * logits / step
    strongest = np.argsort(-np.abs(found.scores[0]), axis=None)[:4]
    for flat in strongest:
        s, r = np.unravel_index(flat, found.scores[0].shape)
        receiver, channel = graph.receivers[r]
        difference = reference.edge(pairs[0], graph.senders[s], receiver, channel, step=step)
        assert difference == pytest.approx(found.scores[0, s, r], abs=CLOSE + rounding, rel=1e-3)


def test_dla_adds_up_to_the_metric_and_equals_the_plain_computation(tiny_lm):
    loaded, pairs = tiny_lm
    found, reference = scores(loaded, pairs, "eap"), Reference(loaded.lm)
    np.testing.assert_allclose(found.dla.sum(1), found.clean, atol=CLOSE)  # every component, the biases included
    for index, pair in enumerate(pairs):
        want = reference.dla(pair)
        got = dict(zip([*found.graph.senders, "bias"], found.dla[index], strict=True))
        assert max(abs(got[name] - value) for name, value in want.items()) < CLOSE


def test_an_edges_score_at_each_role_equals_the_plain_computation_there(tiny_lm):
    """--by-role: the pairs mark their second word A; each edge's score at A and at END (the last token) is the
    plain computation with the sender's change added at that position alone."""
    loaded, _ = tiny_lm
    records = word_pairs(loaded.tokenizer)
    for record in records:
        words = record["clean"].split()
        words[1] = f"[[A:{words[1]}]]"
        record["clean"] = " ".join(words)
    pairs = tokenize_pairs(pairs_from_records(records), loaded.tokenizer, None)
    plan = plan_for_model(RunConfig(), loaded)
    with attached(loaded.lm) as capture:
        found = EdgeModel(capture, loaded, plan).scores(pairs, method="eap", steps=1, roles=["A", "END"])
    reference, graph = Reference(loaded.lm), found.graph
    assert found.by_role.shape == (len(pairs), 2, *graph.edges.shape)
    strongest = np.argsort(-np.abs(found.scores[0]), axis=None)[:6]
    for index, pair in enumerate(pairs[:2]):
        for role_index, role in enumerate(["A", "END"]):
            for flat in strongest:
                s, r = np.unravel_index(flat, graph.edges.shape)
                receiver, channel = graph.receivers[r]
                want = reference.edge(pair, graph.senders[s], receiver, channel, position=pair.positions[role])
                assert found.by_role[index, role_index, s, r] == pytest.approx(want, abs=CLOSE)


def test_eap_ig_of_one_step_is_eap_and_steps_reach_the_scores(tiny_lm):
    """One interpolation step is the clean input itself: EAP; more steps average other gradients."""
    loaded, pairs = tiny_lm
    eap = scores(loaded, pairs, "eap").scores
    np.testing.assert_array_equal(scores(loaded, pairs, "eap-ig", steps=1).scores, eap)
    assert np.abs(scores(loaded, pairs, "eap-ig", steps=4).scores - eap).max() > 100 * CLOSE


def test_an_edge_patched_exactly_equals_the_plain_computation(tiny_lm):
    """One edge carrying the corrupt sender's write into its receiver alone: m as the plain computation gets it with
    the whole change added (e = 1); no edge patched: the clean run's m exactly; every edge: the corrupt run's."""
    loaded, pairs = tiny_lm
    plan = plan_for_model(RunConfig(), loaded)
    reference = Reference(loaded.lm)
    with attached(loaded.lm) as capture:
        model = EdgeModel(capture, loaded, plan)
        found = model.scores(pairs, method="eap", steps=1)
        graph = model.graph
        strongest = ranked_edges(graph, found.scores.mean(0))[:5]
        masks = []
        for sender, receiver in strongest:
            mask = np.zeros_like(graph.edges)
            mask[sender, receiver] = True
            masks.append(mask)
        patched = model.patched(pairs, [*masks, np.zeros_like(graph.edges), graph.edges])
    for (sender, receiver), got in zip(strongest, patched, strict=False):
        name, channel = graph.receivers[receiver]
        added = reference.added(graph.senders[sender], reference.writes(pairs[0].clean_ids),
                                reference.writes(pairs[0].corrupt_ids))  # fmt: skip
        want = float(reference.metric(pairs[0], name, channel, added, 1.0))
        assert got[0] == pytest.approx(want, abs=CLOSE)
    assert np.abs(patched[: len(masks)] - found.clean).max() > 100 * CLOSE  # the edges move m
    np.testing.assert_array_equal(patched[-2], found.clean)
    np.testing.assert_allclose(patched[-1], found.corrupt, atol=CLOSE)


def test_the_faithfulness_of_a_circuit_and_the_curves_areas():
    """By hand: the strongest edges first; a circuit of a share rounds up; faithfulness (m - corrupt) / (clean -
    corrupt) of the means; CPR and CMD by trapezoids."""
    graph = build_graph(layers=1, heads=1, kv_heads=1)  # 10 edges
    scores = np.zeros(graph.edges.shape)
    scores[0, -1], scores[1, -1] = -3.0, 2.0  # embed -> logits, then 0.0 -> logits
    ranked = ranked_edges(graph, scores)
    assert tuple(ranked[0]) == (0, len(graph.receivers) - 1) and tuple(ranked[1]) == (1, len(graph.receivers) - 1)
    assert circuit_size(0.001, 10) == 1 and circuit_size(0.25, 10) == 3 and circuit_size(0.2, 10) == 2
    left_out = outside(graph, ranked, 2)
    assert left_out.sum() == graph.edge_count - 2 and not left_out[0, -1] and not left_out[1, -1]
    assert faithfulness(np.array([1.0, 3.0]), np.array([4.0, 4.0]), np.array([0.0, 0.0])) == 0.5
    assert np.isnan(faithfulness(np.array([1.0]), np.array([2.0]), np.array([2.0])))
    cpr, cmd = curve_areas([0.0, 0.5, 1.0], [0.0, 1.0, 1.0])
    assert (cpr, cmd) == (0.75, 0.25)


def test_greedy_growth_takes_the_strongest_edge_into_the_circuit_so_far():
    """By hand, on a 2-layer graph of 2 query heads on 1 KV head: the strongest edge of all (embed -> 1.0 q) waits
    until 1.0 joins through its edge into the logits; 1.0 opens its query and its KV head's key and value, but not
    1.1's query; every circuit of n edges is connected to the logits."""
    graph = build_graph(layers=2, heads=2, kv_heads=1)
    sender = {name: index for index, name in enumerate(graph.senders)}
    receiver = {name: index for index, name in enumerate(graph.receivers)}
    scores = np.zeros(graph.edges.shape)
    scores[sender["embed"], receiver[("1.0", "q")]] = 9.0
    scores[sender["embed"], receiver[("1.1", "q")]] = 8.0
    scores[sender["1.0"], receiver[("logits", "")]] = -2.0
    scores[sender["0.1"], receiver[("1.kv0", "k")]] = 1.5
    scores[sender["mlp1"], receiver[("logits", "")]] = 1.0
    order = [(graph.senders[s], graph.receivers[r]) for s, r in greedy_edges(graph, scores)]
    assert order[:4] == [("1.0", ("logits", "")), ("embed", ("1.0", "q")), ("0.1", ("1.kv0", "k")),
                         ("mlp1", ("logits", ""))]  # fmt: skip
    assert order.index(("embed", ("1.1", "q"))) > order.index(("mlp1", ("logits", "")))  # 1.1 never joined first
    assert len(order) == len(set(order)) == graph.edge_count
    # who reads through each receiver: a query head its own query; every head of the layer its KV head's
    readers = {("1.0", "q"): {"1.0"}, ("1.1", "q"): {"1.1"}, ("1.kv0", "k"): {"1.0", "1.1"}}
    joined = set()
    for name, into in order[:4]:
        assert into == ("logits", "") or readers[into] & joined, (name, into)
        joined.add(name)


def test_batching_and_pair_order_change_no_number(tiny_lm):
    loaded, pairs = tiny_lm
    together = scores(loaded, pairs, "eap")
    apart = scores(loaded, list(reversed(pairs)), "eap", max_memory="1MiB")  # one pair a pass
    assert list(apart.pair_ids) == list(together.pair_ids)  # back in pair order
    # Each is within CLOSE of float64 (above), and other batch shapes round otherwise (MKL picks its sgemm by shape
    # and alignment: 3.4e-6 apart on scores of order 1 here, from run to run); a batching bug moves a score by its size.
    for name in ("scores", "dla", "clean", "corrupt"):
        np.testing.assert_allclose(getattr(apart, name), getattr(together, name), rtol=0, atol=CLOSE, err_msg=name)
    # pairs of one length go together, unpadded: the padding side reaches nothing
    left = scores(loaded, pairs, "eap", padding_side="left")
    for name in ("scores", "dla", "clean", "corrupt"):
        np.testing.assert_array_equal(getattr(left, name), getattr(together, name), err_msg=name)


def test_max_memory_sizes_the_batches(tiny_lm):
    """--max-memory bounds a batch's tokens by what the edges hold a token (EdgeModel.token_bytes), not only by a
    gradient pass: at the smallest budget (1 MiB) a batch holds at most 1 MiB of them."""
    loaded, pairs = tiny_lm
    pairs = pairs * 40  # 120 pairs of two lengths
    plan = plan_for_model(RunConfig(), loaded)
    with attached(loaded.lm) as capture:
        roomy = [len(batch) for batch in EdgeModel(capture, loaded, plan).batches(pairs)]
        tight = EdgeModel(capture, loaded, plan_for_model(RunConfig(max_memory="1MiB"), loaded))
        sizes = [(len(batch), batch[0].length) for batch in tight.batches(pairs)]
    assert all(rows * length * tight.token_bytes() <= 2**20 for rows, length in sizes)
    assert len(sizes) > len(roomy) and sum(rows for rows, _ in sizes) == len(pairs)
    at_roles = 40 * tight.graph.edges.size * 4  # each pair's float32 scores at 40 roles
    by_role = [(len(batch), batch[0].length) for batch in tight.batches(pairs, roles=40)]
    assert all(rows * (length * tight.token_bytes() + at_roles) <= 2**20 for rows, length in by_role)
    assert len(by_role) > len(sizes)  # the roles' scores take room: smaller batches
    # EAP-IG keeps the last step's gradients (EAP's) a token and each pair's EAP scores (float64) besides
    extra_token, extra_pair = len(tight.graph.receivers) * tight.columns[0].shape[0] * 4, tight.graph.edges.size * 8
    ig = [(len(batch), batch[0].length) for batch in tight.batches(pairs, method="eap-ig")]
    assert all(rows * (length * (tight.token_bytes() + extra_token) + extra_pair) <= 2**20 for rows, length in ig)
    assert len(ig) >= len(sizes)
    words = [w for w in loaded.tokenizer.get_vocab() if w.isalpha()][:3]
    long = " ".join(words[:2] * (2**20 // tight.token_bytes()))  # more tokens than 1 MiB holds
    record = {"clean": long, "corrupt": long.replace(words[0], words[1], 1), "answer": words[2], "distractor": words[0]}
    too_long = tokenize_pairs(pairs_from_records([record]), loaded.tokenizer, None)
    with pytest.raises(headscope.HeadscopeError, match="raise --max-memory or shorten the prompts"):
        list(tight.batches(too_long))


class _SoftNorm(torch.nn.Module):
    """No LayerNorm and no RMS norm: tanh of the RMS-normed input, which norm_back carries through by autograd."""

    def forward(self, x):
        return torch.tanh(x * x.square().mean(-1, keepdim=True).add(1e-6).rsqrt())


@pytest.mark.parametrize("kind", ["layer", "rms", "gemma", "other"])
def test_a_norms_jacobian_carries_gradients_back_as_autograd_does(kind):
    """norm_back carries each of n gradients at a norm's output back to its input: by the Jacobian written out for a
    LayerNorm, an RMS norm and Gemma's (1 + w) one, by autograd for any other; each equals autograd's
    vector-Jacobian product of the module itself, one gradient at a time, in float64."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from headscope.model.norms import norm_back

    torch.manual_seed(0)
    hidden = 16
    norm = {"layer": torch.nn.LayerNorm(hidden), "rms": LlamaRMSNorm(hidden), "gemma": Gemma2RMSNorm(hidden),
            "other": _SoftNorm()}[kind]  # fmt: skip
    for parameter in norm.parameters():
        torch.nn.init.normal_(parameter)
    x, grads = torch.randn(2, 3, hidden), torch.randn(2, 3, 4, hidden)
    got = norm_back(norm, x, grads)
    double = norm.double()
    for n in range(grads.shape[2]):
        point = x.double().requires_grad_()
        (want,) = torch.autograd.grad(double(point), point, grad_outputs=grads[:, :, n].double())
        np.testing.assert_allclose(got[:, :, n].numpy(), want.numpy(), atol=1e-5 * float(want.abs().max()))


def test_the_graph_joins_each_sender_to_every_later_reader():
    graph = build_graph(layers=2, heads=2, kv_heads=1)
    assert graph.senders == ("embed", "0.0", "0.1", "mlp0", "1.0", "1.1", "mlp1")
    assert graph.receivers[:5] == (("0.0", "q"), ("0.1", "q"), ("0.kv0", "k"), ("0.kv0", "v"), ("mlp0", ""))
    edges = dict(zip([(s, r) for s in graph.senders for r in graph.receivers], graph.edges.ravel(), strict=True))
    assert edges[("embed", ("0.0", "q"))] and not edges[("0.0", ("0.1", "q"))]  # a head never reads its own layer
    assert edges[("0.1", ("mlp0", ""))] and not edges[("mlp0", ("mlp0", ""))]  # the MLP reads its layer's heads
    assert edges[("mlp0", ("1.kv0", "v"))] and all(edges[(s, ("logits", ""))] for s in graph.senders)
    # layer 0's four inputs read embed; mlp0 reads 3 senders; layer 1's four inputs 4 each; mlp1 6; the logits all 7
    assert graph.edge_count == sum(edges.values()) == 4 + 3 + 16 + 6 + 7


@pytest.fixture(scope="module")
def induction_lm(tmp_path_factory):
    folder = build_planted_induction(tmp_path_factory.mktemp("induction-lm"), predicts=True)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    records = [
        {"clean": "w5 w9 w12 w20 w5", "corrupt": "w7 w9 w12 w20 w5", "answer": "w9", "distractor": "w12"},
        {"clean": "w3 w4 w6 w8 w11 w3", "corrupt": "w2 w4 w6 w8 w11 w3", "answer": "w4", "distractor": "w8"},
    ]
    return folder, loaded, tokenize_pairs(pairs_from_records(records), loaded.tokenizer, None)


def test_the_planted_induction_circuit_is_found(induction_lm):
    """Layer 0's previous-token head writes the token before each position; layer 1's induction head finds, through
    its key, the position after the earlier occurrence and copies its token into the logits. EAP-IG scores the
    previous-token head's edge into the induction head's key the strongest of every edge into a key, and the
    induction head's edge into the logits the strongest of all; the induction head writes all of m (DLA)."""
    _, loaded, pairs = induction_lm
    found = scores(loaded, pairs, "eap-ig", steps=5)
    graph, mean = found.graph, found.scores.mean(0)
    assert (found.clean > 10).all() and (np.abs(found.corrupt) < 0.01).all()
    keys = [r for r, (_, channel) in enumerate(graph.receivers) if channel == "k"]
    s, r = np.unravel_index(np.argmin(mean[:, keys]), (len(graph.senders), len(keys)))
    assert (graph.senders[s], graph.receivers[keys[r]]) == ("0.0", ("1.kv0", "k"))
    assert mean[s, keys[r]] < -1.0  # corrupting it loses much of m
    s, r = np.unravel_index(np.argmin(mean), mean.shape)
    assert (graph.senders[s], graph.receivers[r]) == ("1.0", ("logits", ""))
    dla = dict(zip([*graph.senders, "bias"], found.dla.mean(0), strict=True))
    assert dla["1.0"] == pytest.approx(found.clean.mean(), rel=1e-4)


def test_eap_reads_a_soft_induction_head_through_its_key_and_the_edge_patch_is_computed_by_hand(tmp_path):
    """With the induction head's attention soft (score 2 on the key it looks for), the gradient at the clean run
    sees its key: EAP scores the previous-token head's edge into it the strongest of every edge into a query or a
    key, negative. Patched exactly, that edge hands every key of the induction head the corrupt previous token, so
    none matches the query: the head attends uniformly, the answer and the distractor each get 1/6 of its copy,
    and nothing else tells them apart (zero MLPs and biases, other heads silent): m = 0 by hand. The first token
    (w13) is the same in both prompts, so that the previous-token head (which attends to itself there) changes one
    key only. The tolerance: see below."""
    folder = build_planted_induction(tmp_path / "soft", predicts=True, sharpness=2.0)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    records = [
        {"clean": "w13 w5 w9 w12 w20 w5", "corrupt": "w13 w7 w9 w12 w20 w5", "answer": "w9", "distractor": "w12"},
        {"clean": "w13 w3 w4 w6 w8 w11", "corrupt": "w13 w2 w4 w6 w8 w11", "answer": "w4", "distractor": "w6"},
    ]
    records[1]["clean"] += " w3"
    records[1]["corrupt"] += " w3"
    pairs = tokenize_pairs(pairs_from_records(records), loaded.tokenizer, None)
    plan = plan_for_model(RunConfig(), loaded)
    with attached(loaded.lm) as capture:
        model = EdgeModel(capture, loaded, plan)
        found = model.scores(pairs, method="eap", steps=1)
        graph, mean = model.graph, found.scores.mean(0)
        reads = [r for r, (_, channel) in enumerate(graph.receivers) if channel in ("q", "k")]
        s, r = np.unravel_index(np.argmax(np.abs(mean[:, reads])), (len(graph.senders), len(reads)))
        assert (graph.senders[s], graph.receivers[reads[r]]) == ("0.0", ("1.kv0", "k"))
        assert mean[s, reads[r]] < -0.1
        mask = np.zeros_like(graph.edges)
        mask[s, reads[r]] = True
        (patched,) = model.patched(pairs, [mask])
    assert (found.clean > 10).all()
    # By hand, up to the previous-token head's own leak (weight e^-10 = 5e-5 on every other key), which moves m by
    # some 1e-4: the corrupt run itself gives -3e-4 where the same reasoning gives 0.
    np.testing.assert_allclose(patched, 0.0, atol=1e-3)


def test_the_planted_circuit_is_the_smallest_faithful_one(induction_lm, tmp_path):
    """The strongest few edges (the induction head into the logits, the previous-token head into its key, the
    embeddings into the previous-token head's value) recover m; the empty circuit gives 0 and the full one 1."""
    _, loaded, pairs = induction_lm
    records = [{"clean": p.pair.clean, "corrupt": p.pair.corrupt, "answer": p.pair.answer,
                "distractor": p.pair.distractor} for p in pairs]  # fmt: skip
    found = headscope.circuit(loaded, records, method="eap-ig", verify=3, target=0.9)
    curve = found.record["faithfulness"]
    assert curve[0] == {"edges": 0, "share": 0.0, "faithfulness": 0.0}
    assert curve[-1] == {"edges": found.record["graph"]["edges"], "share": 1.0, "faithfulness": 1.0}
    smallest = found.record["circuit"]
    assert smallest is not None and smallest["edges"] <= 5 and smallest["faithfulness"] >= 0.9
    chosen = found.edges[found.edges["in_circuit"]]
    assert len(chosen) == smallest["edges"]
    chosen_edges = set(zip(chosen.sender, chosen.receiver, chosen.channel, strict=True))
    assert {("0.0", "1.kv0", "k"), ("1.0", "logits", "")} <= chosen_edges
    verified = found.edges["exact"].notna().sum()  # the 3 strongest by EAP-IG and by EAP
    assert 3 <= verified == found.record["verified"] <= 6 and 0 < found.record["cpr"] <= 1
    grown = headscope.circuit(loaded, records, method="eap-ig", verify=0, target=0.9, selection="greedy")
    assert grown.record["selection"] == "greedy" and grown.record["faithfulness"][-1]["faithfulness"] == 1.0
    assert grown.record["circuit"] is not None and grown.record["circuit"]["edges"] <= smallest["edges"] + 2


def test_attention_beside_the_mlp_is_refused_in_one_line(tmp_path, corpus_lines):
    """GPT-J adds attention and MLP, both reading one norm, to the stream together: no stream lies between them for
    the MLP's edges to enter, and circuit says so."""
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64)
    folder = tiny_model_folder(tmp_path / "gptj", config, GPTJForCausalLM, corpus_lines)
    words = corpus_lines[0].split()
    pairs = [{"clean": f"{words[0]} {words[1]}", "corrupt": f"{words[2]} {words[1]}", "answer": words[3],
              "distractor": words[4]}]  # fmt: skip
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    with pytest.raises(headscope.HeadscopeError, match="attention in parallel with the MLP"):
        headscope.circuit(loaded, pairs, method="eap")


@pytest.mark.parametrize("architecture", ["olmo2", "gemma3"])
def test_models_without_input_norms_or_with_query_norms_add_up(architecture, tmp_path, corpus_lines):
    """OLMo 2 reads the stream itself (no input norms; post-norms and a norm over all of q and k); Gemma 3 norms
    each head's q and k. The plain computation does not spell them out: here the DLA adds up to m, no edge patched
    gives the clean m and every edge the corrupt one."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Olmo2Config, Olmo2ForCausalLM

    shared = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, initializer_range=0.2)  # fmt: skip
    if architecture == "olmo2":
        config, model_class = Olmo2Config(**shared), Olmo2ForCausalLM
    else:
        config = Gemma3TextConfig(**shared, head_dim=8, query_pre_attn_scalar=8, sliding_window=4)
        model_class = Gemma3ForCausalLM
    folder = tiny_model_folder(tmp_path / architecture, config, model_class, corpus_lines)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    pairs = tokenize_pairs(pairs_from_records(word_pairs(loaded.tokenizer)), loaded.tokenizer, None)
    plan = plan_for_model(RunConfig(), loaded)
    with attached(loaded.lm) as capture:
        model = EdgeModel(capture, loaded, plan)
        found = model.scores(pairs, method="eap", steps=1)
        graph = model.graph
        np.testing.assert_allclose(found.dla.sum(1), found.clean, atol=CLOSE)
        none, every = model.patched(pairs, [np.zeros_like(graph.edges), graph.edges])
    np.testing.assert_array_equal(none, found.clean)
    np.testing.assert_allclose(every, found.corrupt, atol=CLOSE)
    assert np.abs(found.clean - found.corrupt).max() > 0.1


def test_numbers_of_any_type_are_taken_as_numbers():
    """The API takes numpy's numbers and numeric text as the CLI would (arguments.as_number), and refuses in one line
    what is no number or out of range."""
    from headscope.commands.circuit import check_request

    assert check_request("eap-ig", np.int64(3), np.int32(2), np.float32(0.3)) == (3, 2, 0.3)
    assert check_request("eap", "4", 0, "1") == (4, 0, 1)
    refused = (
        ((0, 10, 0.8), "--steps"),
        ((2.5, 10, 0.8), "--steps"),
        ((5, -1, 0.8), "--verify"),
        ((5, True, 0.8), "--verify"),
        ((5, 10, 0.0), "--target"),
        ((5, 10, "high"), "--target"),
    )
    for bad, option in refused:
        with pytest.raises(headscope.HeadscopeError, match=option):
            check_request("eap-ig", *bad)


@pytest.mark.slow  # over 1.5 s on two cores: out of the fast loop (docs/tests.md)
def test_the_command_writes_its_tables_and_refuses_bad_settings(induction_lm, tmp_path):
    folder, _, _ = induction_lm
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"clean": "w5 w9 w12 w5", "corrupt": "w7 w9 w12 w5", "answer": "w9",
                                 "distractor": "w12"}) + "\n" + json.dumps({"clean": "w3 w4 w3", "corrupt": "w2 w4 w3",
                                 "answer": "w4", "distractor": "w8"}) + "\n")  # fmt: skip
    out = tmp_path / "circuit"
    runner = CliRunner()
    done = runner.invoke(app, ["circuit", str(folder), "--pairs", str(pairs), "--out", str(out), "--steps", "2",
                               "--bootstrap", "50", "--device", "cpu", "--verify", "2", "--no-curve"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert "the strongest edges" in done.output and "1.0" in done.output
    edges, nodes = pd.read_parquet(out / "edges.parquet"), pd.read_parquet(out / "nodes.parquet")
    record = json.loads((out / "circuit.json").read_text())
    assert record["method"] == "eap-ig" and record["steps"] == 2 and record["pairs"]["count"] == 2
    assert record["verified"] == 2 and record["faithfulness"] == [] and record["circuit"] is None  # --no-curve
    assert (out / "circuit_graph.png").is_file() and not (out / "circuit_faithfulness.png").exists()
    assert len(edges) == record["graph"]["edges"] and sorted(edges["rank"]) == list(range(1, len(edges) + 1))
    top = edges.nsmallest(1, "rank").iloc[0]
    assert (top["sender"], top["receiver"]) == ("1.0", "logits") and top["score_ci_low"] <= top["score"]
    assert set(nodes["kind"]) == {"embed", "head", "mlp", "bias"}
    marked = tmp_path / "marked.jsonl"
    marked.write_text(
        pairs.read_text().replace('"clean": "w5', '"clean": "[[S:w5]]').replace('"clean": "w3', '"clean": "[[S:w3]]')
    )
    by_role = runner.invoke(app, ["circuit", str(folder), "--pairs", str(marked), "--out", str(tmp_path / "roles"),
                                  "--steps", "2", "--device", "cpu", "--verify", "0", "--no-curve", "--no-charts",
                                  "--by-role"])  # fmt: skip
    assert by_role.exit_code == 0, by_role.output
    table = pd.read_parquet(tmp_path / "roles" / "edges_by_role.parquet")
    assert list(table["position_role"].unique()) == ["S", "END", "(unmarked)"] and len(table) == 3 * len(edges)
    # each edge's parts add up to its score (issue 65: without the unmarked positions' bucket they did not), within
    # float32 rounding of the role parts (the score is float64, its parts at one position float32)
    keys = ["sender", "receiver", "channel"]
    summed = table.groupby(keys, dropna=False)["score"].agg(["sum", lambda part: part.abs().sum()])
    whole = edges.set_index(keys)["score"]
    summed = summed.loc[whole.index]
    assert (np.abs(summed["sum"] - whole) <= 8 * 2.0**-24 * summed["<lambda_0>"] + 1e-12).all()
    assert (table.loc[table.position_role == "(unmarked)", "score"].abs() > 1e-3).any()  # not an empty bucket
    half = tmp_path / "half.jsonl"
    half.write_text(pairs.read_text().replace('"clean": "w5', '"clean": "[[S:w5]]'))  # the second pair marks none
    refused = runner.invoke(app, ["circuit", str(folder), "--pairs", str(half), "--out", str(tmp_path / "y"),
                                  "--by-role"])  # fmt: skip
    assert_one_line_error(refused, "marks no 'S'", code=1)
    bad_settings = (
        (["--steps", "0"], "--steps"),
        (["--method", "sideways"], "--method"),
        (["--target", "0"], "--target"),
        (["--target", "1.5"], "--target"),
        (["--verify", "100000"], "--verify 100000 is more than"),
        (["--select", "best"], "--select"),
    )
    for bad, option in bad_settings:
        refused = runner.invoke(app, ["circuit", str(folder), "--pairs", str(pairs), "--out", str(tmp_path / "x"),
                                      *bad])  # fmt: skip
        assert_one_line_error(refused, option, code=2)


def test_a_sender_without_a_role_prints_as_a_dash(capsys):
    """--report gives heads their roles; `embed` and the MLPs have none, read back as NaN: the printout shows "-"
    where rich once refused a float cell (NotRenderableError, after the files were written: issue 65)."""
    from headscope.cli.printing import print_circuit
    from headscope.commands.circuit import Circuit

    missing = [np.nan, np.nan]
    edges = pd.DataFrame({"sender": ["embed", "1.0"], "receiver": ["logits", "logits"], "channel": [None, None],
                          "score": [2.0, 1.0], "score_ci_low": missing, "score_ci_high": missing, "exact": missing,
                          "rank": [1, 2], "sender_role": [np.nan, "induction"]})  # fmt: skip
    nodes = pd.DataFrame({"node": ["embed", "1.0"], "dla": [0.5, 0.2]})
    record = {"model": {"input": "tiny"}, "metric": {"name": "logit_diff", "definition": "m"}, "method": "eap",
              "m": {"clean": 1.0, "corrupt": 0.0}, "graph": {"edges": 2}, "pairs": {"count": 2},
              "faithfulness": []}  # fmt: skip
    print_circuit(Circuit(edges, nodes, record))
    shown = capsys.readouterr().out
    line = next(line for line in shown.splitlines() if line.strip().startswith("embed"))
    assert line.split()[-1] == "-" and "induction" in shown


def test_an_eap_ig_run_verifies_the_strongest_by_eap_too(induction_lm):
    """EAP-IG's last step runs the clean inputs exactly, so the same pass gives EAP's scores (score_eap, equal to an
    EAP run's); --verify k patches the k strongest by each ranking (issue 65: an edge EAP ranked 685th was the
    second strongest patched), every one of them and no other."""
    _, loaded, pairs = induction_lm
    records = [{"clean": p.pair.clean, "corrupt": p.pair.corrupt, "answer": p.pair.answer,
                "distractor": p.pair.distractor} for p in pairs]  # fmt: skip
    ig = headscope.circuit(loaded, records, method="eap-ig", steps=3, verify=4, curve=False)
    eap = headscope.circuit(loaded, records, method="eap", verify=0, curve=False)
    edges, keys = ig.edges, ["sender", "receiver", "channel"]
    expected = eap.edges.set_index(keys).loc[edges.set_index(keys).index, "score"].to_numpy()
    assert np.abs(edges["score_eap"].to_numpy() - expected).max() <= 1e-5 * (np.abs(expected).max() + 1)
    assert sorted(edges["rank_eap"]) == list(range(1, len(edges) + 1)) and "score_eap" not in eap.edges
    chosen = edges[(edges["rank"] <= 4) | (edges["rank_eap"] <= 4)]
    assert set(chosen.index) == set(edges.index[edges["exact"].notna()])
    assert ig.record["verified"] == len(chosen) > 4  # the rankings differ here: both were verified
