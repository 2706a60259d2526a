"""Detectors a researcher defines: each family's score equals the metric or probe that measures the same thing, a
callable's equals TransformerLens's formula written out, and a bad SPEC is one line naming the detector."""

from __future__ import annotations

import json

import numpy as np
import pytest

import headscope
from headscope.detector_specs import detector_of
from headscope.errors import ConfigError
from headscope.measures.pattern_scores import PatternScores
from headscope.measures.probes import ProbeScores, ProbeSpec, probe_inputs
from headscope.model.batch import collate
from headscope.model.capture import attached

from helpers import assert_one_line_error, run_cli
from reference import eager_attention


@pytest.fixture(scope="module")
def planted(planted_gpt2):
    return headscope.load_model(str(planted_gpt2), device="cpu")


def every_other(tokens: list[str]) -> np.ndarray:
    """A pattern with weights that are not 0 or 1, from the tokens alone: key s of row t gets (s + 1) / (t + 1) on
    even keys."""
    n = len(tokens)
    pattern = np.zeros((n, n))
    for t in range(n):
        for s in range(0, t + 1, 2):
            pattern[t, s] = (s + 1) / (t + 1)
    return pattern


@pytest.fixture(scope="module")
def detected(planted, corpus_lines):
    detectors = {"prev": "offset:1", "two": "offset:2", "start": "first", "period": "token:^\\.$",
                 "mine": every_other, "mine_abs": (every_other, "abs")}  # fmt: skip
    return headscope.analyze(planted, corpus_lines[:12], probes=False, check_dormant=False, detectors=detectors,
                             batch_size=5)  # fmt: skip


def test_offset_one_is_prev_token_and_first_is_sink(detected):
    heads = detected.heads
    np.testing.assert_allclose(heads["detect_prev"], heads["prev_token"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(heads["detect_start"], heads["sink"], rtol=0, atol=1e-6)
    assert (heads["detect_prev_ci_low"] <= heads["detect_prev"]).all()
    assert (heads["detect_prev"] <= heads["detect_prev_ci_high"]).all()


def test_each_detector_equals_its_formula_on_the_eager_attention(planted, corpus_lines, detected):
    """TransformerLens's `mul` (sum A * P / sum A) and `abs` (1 - sum |A - P| / rows) over the whole corpus, offset:2
    and token:REGEX as the mean over rows with a target of the mass there, and their chance levels, all from the
    model's own eager attention in float64."""
    layers, heads = planted.architecture["layers"], planted.architecture["heads"]
    sums = {name: np.zeros((layers, heads, 2)) for name in ("mine", "mine_abs", "two", "period")}
    chance = {name: np.zeros(2) for name in ("two", "period", "mine")}
    for ids, attention in eager_attention(planted, corpus_lines[:12]):
        tokens = [planted.tokenizer.decode([i]) for i in ids]
        n = len(ids)
        causal = np.tril(np.ones((n, n)))
        mine = every_other(tokens) * causal
        two = np.eye(n, k=-2)
        period = causal * np.array([token == "." for token in tokens])[None, :]
        uniform = causal / causal.sum(-1, keepdims=True)
        for layer in range(layers):
            a = np.stack(attention[layer])  # (heads, n, n)
            sums["mine"][layer, :, 0] += (a * mine).sum((1, 2))
            sums["mine"][layer, :, 1] += a.sum((1, 2))
            sums["mine_abs"][layer, :, 0] += n - np.abs(a - mine).sum((1, 2))
            sums["mine_abs"][layer, :, 1] += n
            for name, target in (("two", two), ("period", period)):
                rows = target.sum(-1) > 0
                sums[name][layer, :, 0] += (a * target).sum(-1)[:, rows].sum(-1)
                sums[name][layer, :, 1] += rows.sum()
        for name, target in (("two", two), ("period", period)):
            rows = target.sum(-1) > 0
            chance[name] += [(uniform * target).sum(-1)[rows].sum(), rows.sum()]
        chance["mine"] += [(uniform * mine).sum(), n]
    heads_table = detected.heads
    for name, total in sums.items():
        expected = (total[..., 0] / total[..., 1]).reshape(-1)
        np.testing.assert_allclose(heads_table[f"detect_{name}"], expected, rtol=1e-5, atol=1e-6)
    for name, (numerator, rows) in chance.items():
        np.testing.assert_allclose(
            heads_table[f"detect_{name}_chance"], numerator / rows, rtol=1e-6
        )  # float32 uniform weights
    assert sums["period"][..., 1].min() > 0  # the corpus has periods for token:REGEX to find


@pytest.mark.parametrize("block_bytes", [4096, 2**30])  # block-wise logits (fused path), then the eager weights
def test_after_same_token_is_probe_induction_on_the_probe_text(planted, block_bytes):
    spec = ProbeSpec(seeds=4, length=9)
    ids, prefix = probe_inputs(planted.tokenizer, spec)
    batch = collate(list(range(len(ids))), ids)
    layers = list(range(planted.architecture["layers"]))
    probes = ProbeScores(spec, prefix, layers)
    detectors = [detector_of("induction", "after-same-token"), detector_of("duplicate", "same-token")]
    patterns = PatternScores(detectors, layers, token_text=str, token_strings=list)
    with attached(planted.model, block_bytes=block_bytes) as capture:
        capture.run(batch, measures=[probes, patterns])
    mass, rows, *_ = probes.finish()  # (layers, batch, heads, patterns), (batch, patterns)
    sums, _ = patterns.finish()  # (layers, batch, heads, detectors, 2)
    for i, pattern in enumerate(("induction", "duplicate")):
        probe = ("induction", "duplicate", "previous").index(pattern)
        np.testing.assert_allclose(sums[..., i, 0].numpy(), mass[..., probe], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(sums[0, :, 0, i, 1].numpy(), rows[:, probe])


def test_run_json_records_the_detectors_and_classify_keeps_their_columns(planted_gpt2, corpus_lines, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:6]) + "\n")
    out = tmp_path / "report"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--detector", "prev=offset:1",
                     "--detector", "comma=token:,", "--no-probes", "--no-charts", "--no-check-dormant")  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["detectors"] == ["prev=offset:1", "comma=token:,"]
    relabelled = tmp_path / "relabelled"
    result = run_cli("classify", out, "--out", relabelled, "--local-min-locality", "0.9")
    assert result.exit_code == 0, result.output
    assert {"detect_prev", "detect_comma_chance"} <= set(headscope.Report.open(relabelled).heads.columns)


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        ("prev=offset:zero", ("detector 'prev'", "offset:K takes a whole number")),
        ("prev", ("--detector takes NAME=SPEC",)),
        ("x=token:(", ("detector 'x'", "token:REGEX takes a regular expression")),
        ("x=nearby", ("detector 'x'", "SPEC is one of offset:K, same-token")),
        ("Bad=first", ("detector name 'Bad'",)),
        ("sharp=first", ("taken by an exemplar kind",)),
    ],
)
def test_a_bad_detector_is_one_line_before_the_model_loads(no_model_loading, planted_gpt2, spec, fragments):
    assert_one_line_error(no_model_loading("analyze", planted_gpt2, "--detector", spec), *fragments, code=2)


def test_a_callable_of_the_wrong_shape_is_one_line(planted, corpus_lines):
    with pytest.raises(ConfigError, match="detector 'bad': the callable returned a pattern of shape"):
        headscope.analyze(planted, corpus_lines[:2], probes=False, detectors={"bad": lambda tokens: np.eye(2)})
