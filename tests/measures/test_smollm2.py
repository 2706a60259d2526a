"""The real SmolLM2-135M (Llama architecture, 9 query heads on 3 KV heads) against a plain reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headscope
from headscope.columns import MEASURED_COLUMNS
from headscope.measures.probes import ProbeSpec, probe_inputs

from reference import METRIC_NAMES, corpus_means, probe_scores, role_evidence, sentence_rows
from reference_importance import straightforward_importance

pytestmark = pytest.mark.slow
ALL_METRICS = (*METRIC_NAMES, "entropy_std")


@pytest.fixture(scope="module")
def reference_attention(smollm2, corpus_lines):
    """Per layer, each sentence's (9, n, n) attention from output_attentions=True, one sentence at a time."""
    model, tokenizer = smollm2.model, smollm2.tokenizer
    assert model.config._attn_implementation == "eager"
    layers: list[list[np.ndarray]] = [[] for _ in range(model.config.num_hidden_layers)]
    with torch.inference_mode():
        for line in corpus_lines:
            ids = torch.tensor([tokenizer(line)["input_ids"]])
            for layer, attn in enumerate(model(ids, output_attentions=True).attentions):
                layers[layer].append(attn[0].double().numpy())
    return layers


@pytest.fixture(scope="module")
def batched(smollm2, shipped_corpus):
    return headscope.analyze(smollm2, shipped_corpus, batch_size=16)


def test_all_270_heads_match_output_attentions(batched, reference_attention):
    heads = batched.heads.sort_values(["layer", "head"])
    assert len(heads) == 30 * 9
    for layer, sentences in enumerate(reference_attention):
        expected = corpus_means(sentences)
        got = heads[heads["layer"] == layer]
        for name in ALL_METRICS:
            np.testing.assert_allclose(got[name].to_numpy(), expected[name], atol=1e-5, err_msg=f"{layer} {name}")
        assert (got["n_rows"] == expected["n_rows"]).all()


def test_role_evidence_matches_output_attentions(batched, reference_attention):
    heads = batched.heads.sort_values(["layer", "head"])
    for layer in (0, 7, 17, 29):
        expected = role_evidence(reference_attention[layer])
        got = heads[heads["layer"] == layer]
        np.testing.assert_allclose(got["sink_rate"], expected["sink_rate"], atol=1e-9, err_msg=f"{layer}")
        assert got["top_offset"].tolist() == expected["top_offset"].tolist(), layer
        np.testing.assert_allclose(got["top_offset_share"], expected["top_offset_share"], atol=1e-9)


def test_probe_scores_match_output_attentions(smollm2, batched):
    """The probe battery, recomputed row by row from the model's own weights on the same inputs."""
    spec = ProbeSpec(seeds=8, length=32)
    sequences, prefix = probe_inputs(smollm2.tokenizer, spec)
    assert prefix == 0  # SmolLM2's tokenizer adds no BOS to ordinary text
    per_layer: list[list[np.ndarray]] = [[] for _ in range(30)]
    with torch.inference_mode():
        for sequence in sequences:
            for layer, attn in enumerate(smollm2.model(torch.tensor([sequence]), output_attentions=True).attentions):
                per_layer[layer].append(attn[0].double().numpy())
    heads = batched.heads.sort_values(["layer", "head"])
    for layer in range(30):
        expected = probe_scores(per_layer[layer], prefix, spec.length)
        got = heads[heads["layer"] == layer]
        for pattern, values in expected.items():
            message = f"{layer} {pattern}"
            np.testing.assert_allclose(got[f"probe_{pattern}"], values, rtol=1e-5, atol=1e-6, err_msg=message)


def test_per_sentence_metrics_match_output_attentions(batched, reference_attention):
    table = batched.sentence_heads
    for sentence_id in (0, 42, 86, 99):  # includes the two-token "Stop!" and a 20+ token sentence
        for layer in (0, 15, 29):
            rows = sentence_rows(reference_attention[layer][sentence_id])
            got = table[(table["sentence_id"] == sentence_id) & (table["layer"] == layer)].sort_values("head")
            for name in ("entropy", "diagonal", "sink", "max_weight"):
                np.testing.assert_allclose(got[name], np.mean(rows[name], axis=0), atol=1e-5, err_msg=name)


def test_batch_size_and_padding_side_do_not_change_results(smollm2, shipped_corpus, batched):
    """Every number within float32 rounding of the model's own: its hidden states differ between batch shapes (MKL
    picks its sgemm by shape) by up to 5e-6 of a row's norm at layer 29, so write_norm (up to ~750) is compared
    relatively. A share of rows past a threshold (sink_rate, active_rows) or holding a largest key (the top-offset
    shares) may move by a row whose value sits within that rounding of the edge: at most two rows here, of the
    fewest rows a head's share counts (rows t >= 4); the threshold rule itself is tested on rows away from the edge
    (test_roles.py)."""
    one_at_a_time = headscope.analyze(smollm2, shipped_corpus, batch_size=1, sentence_heads=False)
    left = headscope.analyze(smollm2, shipped_corpus, batch_size=7, padding_side="left", sentence_heads=False)
    categories = ("top_offset", "offsink_top_offset", "dormant_check")
    counted = ("sink_rate", "active_rows", "top_offset_share", "offsink_top_offset_share")
    numbers = [c for c in MEASURED_COLUMNS if c not in ("layer", "head", "kv_head", *categories, *counted)]
    lengths = batched.sentences["n_tokens"].to_numpy()
    two_rows = 2 / np.clip(lengths - 4, 0, None).sum()
    for other in (one_at_a_time, left):
        for name in numbers:
            np.testing.assert_allclose(other.heads[name], batched.heads[name], rtol=1e-6, atol=1e-6, err_msg=name)
        for name in counted:
            np.testing.assert_allclose(other.heads[name], batched.heads[name], rtol=0, atol=two_rows, err_msg=name)
        for name in categories:
            assert other.heads[name].tolist() == batched.heads[name].tolist(), name
        assert other.heads["role"].tolist() == batched.heads["role"].tolist()


def test_grouped_query_heads_are_reported_per_query_head(batched):
    layer0 = batched.heads[batched.heads["layer"] == 0]
    assert layer0["head"].tolist() == list(range(9))
    assert layer0.groupby("kv_head")["head"].apply(list).tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batched.run["model"]["architecture"]["kv_heads"] == 3


HANDFUL = [(0, 3), (17, 4), (29, 8)]  # (layer, head): an early head, an induction head, the last layer
FEW = 6  # sentences for the importance checks: every formula exercised, on sentences of 5 to 14 tokens


@pytest.fixture(scope="module")
def importance(smollm2, corpus_lines):
    layers = tuple(sorted({layer for layer, _ in HANDFUL}))
    return headscope.analyze(
        smollm2,
        corpus_lines[:FEW],
        importance="exact",
        layers=layers,
        probes=False,
        sentence_heads=False,
        batch_size=16,
    )


def test_importance_matches_a_straightforward_computation(smollm2, importance, corpus_lines):
    heads = importance.heads.set_index(["layer", "head"])
    for layer, head in HANDFUL:
        expected = straightforward_importance(smollm2, corpus_lines[:FEW], layer, head)
        got = heads.loc[(layer, head), ["ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean"]]
        np.testing.assert_allclose(got[:2].to_numpy(float), expected[:2], atol=1e-4, err_msg=f"{layer} {head}")
        np.testing.assert_allclose(got[2:].to_numpy(float), expected[2:4], rtol=1e-3, atol=1e-5, err_msg="attribution")
        estimates = heads.loc[(layer, head), ["estimate_zero", "estimate_mean"]].to_numpy(float)
        second = [expected[2] + expected[5], expected[3] + expected[4]]  # first order + curvature, zero and mean
        np.testing.assert_allclose(estimates, second, rtol=1e-3, atol=1e-5, err_msg="estimate")
    agreement = importance.run["importance"]["agreement"]
    assert set(agreement) == {"attribution_zero", "estimate_zero", "attribution_mean", "estimate_mean"}
    assert all(entry["heads"] == 27 for entry in agreement.values())


def test_prunes_estimate_matches_a_straightforward_computation(smollm2, corpus_lines):
    """prune's estimated cost of removing a head (mean mode, clean model): first order plus the curvature term,
    against hooks one sentence at a time."""
    from headscope.interventions.loss_model import loss_model
    from headscope.model.loading import load_for_run
    from headscope.run.setup import CommandRun

    run = CommandRun.prepare(smollm2, corpus_lines[:FEW], config=None, options={}, reporter=None)
    session = run.session(smollm2, load_for_run, what="prune", lm_head=True)
    with (
        session as opened,
        loss_model(opened.loaded, opened.plan, run.corpus, run.reporter, opened.ranks, "prune") as lm,
    ):
        _, estimated = lm.estimated_costs([], lm.removal("mean"))
    for layer, head in HANDFUL:
        _, _, _, first, curvature, _ = straightforward_importance(smollm2, corpus_lines[:FEW], layer, head)
        assert estimated[(layer, head)] == pytest.approx(first + curvature, rel=1e-3, abs=1e-5), (layer, head)
        assert curvature > 0


def test_batch_size_does_not_change_importance(smollm2, importance, corpus_lines):
    one_at_a_time = headscope.analyze(
        smollm2, corpus_lines[:FEW], importance="exact", layers=(17,), probes=False, sentence_heads=False, batch_size=1
    )
    columns = ["ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean"]
    batched = importance.heads[importance.heads["layer"] == 17][columns].to_numpy()
    np.testing.assert_allclose(one_at_a_time.heads[columns].to_numpy(), batched, atol=1e-5)


@pytest.mark.parametrize("what", ["output", "values"])
def test_patching_matches_hooks_on_the_real_model(smollm2, what):
    """headscope patch on SmolLM2 (9 query heads on 3 KV heads) and the shipped IOI pairs equals the independent
    reference (tests/support/reference_patching.py: pre-hooks on o_proj, or a plain attention function) one pair at a
    time."""
    import json
    from pathlib import Path

    from reference_patching import Reference

    lines = (Path(__file__).resolve().parents[2] / "corpora" / "ioi-pairs.jsonl").read_text().splitlines()[:3]
    pairs = [json.loads(line) for line in lines]
    heads = [(5, 1), (20, 0), (23, 3)]
    found = headscope.patch(smollm2, pairs, what=what, heads=heads, bootstrap=0, batch_size=4)
    reference = Reference(model=smollm2.lm, tokenizer=smollm2.tokenizer)
    for row in found.per_pair.itertuples():
        expected = reference.patched(pairs[row.pair], what, "denoise", row.layer, row.head, None)
        assert abs(row.m_patched - expected) < 1e-4 * max(1.0, abs(expected)), (row, expected)
    assert found.record["gap"] > 5
