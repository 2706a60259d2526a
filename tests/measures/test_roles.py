"""Head roles: the probe battery, the corpus evidence (sink rate, top offset) and the role rule."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from headscope.columns import PROBE_PATTERNS
from headscope.config import RoleThresholds, Thresholds
from headscope.estimates import metric_means
from headscope.labels import HEAD_TYPES, ROLES, assign_roles, classify_heads, label_heads
from headscope.measures.probes import (
    ProbeSpec,
    ordinary_token_ids,
    pattern_counts,
    pattern_mass,
    prefix_ids,
    probe_inputs,
)
from headscope.measures.row_sums import head_row_sums
from headscope.model.batch import collate
from headscope.model.masks import causal_visible_keys
from headscope.summary import top_heads_per_role

from helpers import run_cli
from planted import build_planted_induction, build_tokenizer, induction_words

SPEC = ProbeSpec(seeds=2, length=5)  # sequences of 10 random tokens (two copies), plus a prefix if any


def target_attention(t: int, targets) -> torch.Tensor:
    """(1, 1, t, t): row p puts all its mass on the key targets(p) names (or spreads it uniformly if None)."""
    attn = torch.zeros(1, 1, t, t)
    for p in range(t):
        key = targets(p)
        if key is None:
            attn[0, 0, p, : p + 1] = 1.0 / (p + 1)
        else:
            attn[0, 0, p, key] = 1.0
    return attn


def probe_sums(attn: torch.Tensor, prefix: int, padding_side: str = "right") -> dict[str, tuple[float, float, float]]:
    """pattern -> (target mass, rows, chance mass) of one probe sequence's attention (1, 1, t, t), through the
    measure's maths, in a batch beside a longer sequence so that it is padded on `padding_side`."""
    t = attn.shape[-1]
    batch = collate([0, 1], [[5] * t, [5] * (t + 3)], padding_side=padding_side)
    start = int(batch.seq_start[0])
    padded = torch.full((2, 1, t + 3, t + 3), float("nan"))  # padding rows hold garbage: they must not count
    padded[0, :, start : start + t, :] = 0.0
    padded[0, :, start : start + t, start : start + t] = attn[0]
    valid = batch.attention_mask.bool()
    mass = pattern_mass(padded, 0, batch.seq_start, valid, prefix, SPEC)
    rows, chance = pattern_counts(valid, batch.seq_start, prefix, SPEC)
    return {p: (float(mass[0, 0, i]), float(rows[0, i]), float(chance[0, i])) for i, p in enumerate(PROBE_PATTERNS)}


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("prefix", [0, 1])
def test_each_pattern_scores_1_on_its_own_target_and_0_on_the_others(prefix, padding_side):
    length, t = SPEC.length, prefix + 2 * SPEC.length
    in_repeat = range(prefix + length, t)
    heads = {
        "induction": lambda p: p - length + 1 if p in in_repeat else None,
        "duplicate": lambda p: p - length if p in in_repeat else None,
        "previous": lambda p: p - 1 if p >= prefix + 1 else None,
    }
    for name, targets in heads.items():
        sums = probe_sums(target_attention(t, targets), prefix, padding_side)
        mass, rows, _ = sums[name]
        assert mass == pytest.approx(rows), name  # every defined row scores 1
        assert rows == (length if name != "previous" else 2 * length - 1)
        for other in PROBE_PATTERNS:
            if other != name:
                assert sums[other][0] < sums[other][1]  # not a perfect score on another pattern


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_uniform_attention_scores_exactly_its_chance_level(padding_side):
    prefix, length = 1, SPEC.length
    t = prefix + 2 * length
    sums = probe_sums(target_attention(t, lambda p: None), prefix, padding_side)
    for name, (mass, _, chance) in sums.items():
        assert mass == pytest.approx(chance, abs=1e-6), name
    expected = sum(1 / (p + 1) for p in range(prefix + length, t))  # one target per repeat row, p + 1 keys
    assert sums["induction"][2] == pytest.approx(expected) and sums["duplicate"][2] == pytest.approx(expected)
    assert sums["previous"][2] == pytest.approx(sum(1 / (p + 1) for p in range(prefix + 1, t)))


def bos_tokenizer():
    """A word-level tokenizer that puts [BOS] before every text, as Llama's does."""
    from tokenizers.processors import TemplateProcessing

    fast = build_tokenizer(induction_words())
    core = fast.backend_tokenizer
    fast.add_special_tokens({"bos_token": "[BOS]"})
    core.post_processor = TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", fast.bos_token_id)])
    return fast


def test_probe_inputs_follow_the_spec():
    plain, with_bos = build_tokenizer(induction_words()), bos_tokenizer()
    assert prefix_ids(plain) == [] and prefix_ids(with_bos) == [with_bos.bos_token_id]
    for tokenizer in (plain, with_bos):
        ordinary = set(ordinary_token_ids(tokenizer).tolist())
        assert not ordinary & set(tokenizer.all_special_ids) and len(ordinary) == 38
        spec = ProbeSpec(seeds=8, length=20)
        sequences, prefix = probe_inputs(tokenizer, spec)
        assert (sequences, prefix) == probe_inputs(tokenizer, spec)  # deterministic
        assert len({tuple(s) for s in sequences}) == 8  # a different sequence per seed
        for seed, sequence in enumerate(sequences):
            random_part = sequence[prefix : prefix + 20]
            assert sequence == prefix_ids(tokenizer) + random_part * 2
            assert len(set(random_part)) == 20 and set(random_part) <= ordinary  # without replacement
            expected = np.random.default_rng(seed).choice(sorted(ordinary), size=20, replace=False).tolist()
            assert random_part == expected  # reproducible from the docs' recipe


def test_a_probe_longer_than_the_vocabulary_is_refused():
    from headscope.errors import ConfigError

    with pytest.raises(ConfigError, match="--probe-length 39 needs that many distinct ordinary tokens"):
        probe_inputs(build_tokenizer(induction_words()), ProbeSpec(seeds=2, length=39))


def corpus_evidence(attn: torch.Tensor, sink_threshold: float = 0.3) -> dict:
    t = attn.shape[-1]
    valid = torch.ones(1, t, dtype=torch.bool)
    sums = head_row_sums(
        attn,
        key_visible=causal_visible_keys(valid),
        query_valid=valid,
        seq_start=torch.zeros(1, dtype=torch.long),
        window=2,
        sink_threshold=sink_threshold,
    )
    means = metric_means(sums.numpy())
    return {name: means[name][0, 0] for name in ("sink_rate", "top_offset", "top_offset_share")}


def test_sink_rate_and_top_offset_on_hand_built_heads():
    t = 12  # rows 4..11 are the evidence rows
    first = corpus_evidence(target_attention(t, lambda p: 0))
    assert first == {"sink_rate": 1.0, "top_offset": "first", "top_offset_share": 1.0}
    previous = corpus_evidence(target_attention(t, lambda p: max(p - 1, 0)))
    assert previous == {"sink_rate": 0.0, "top_offset": "1", "top_offset_share": 1.0}
    itself = corpus_evidence(target_attention(t, lambda p: p))
    assert itself["top_offset"] == "0" and itself["top_offset_share"] == 1.0
    far = corpus_evidence(target_attention(t, lambda p: p - 9 if p >= 9 else 1))  # 9 back, else key 1
    assert far["top_offset"] == "other" or far["top_offset_share"] < 1.0
    uniform = corpus_evidence(target_attention(t, lambda p: None))  # ties everywhere: no single key
    assert uniform == {"sink_rate": 0.0, "top_offset": "other", "top_offset_share": 1.0}
    # A row at position p sends 1/(p + 1) to the first token: above 0.3 up to p = 2, never from p = 4 on.
    half = torch.zeros(1, 1, t, t)
    for p in range(t):
        half[0, 0, p, 0], half[0, 0, p, p] = (0.5, 0.5) if p else (1.0, 0.0)
    assert corpus_evidence(half)["sink_rate"] == 1.0 and corpus_evidence(half, sink_threshold=0.5)["sink_rate"] == 0.0


def evidence(**columns) -> pd.DataFrame:
    """A one-head table holding only what the role rule reads (defaults: a head nothing matches)."""
    row = {
        "probe_induction": 0.02,
        "probe_induction_chance": 0.02,
        "probe_duplicate": 0.02,
        "probe_duplicate_chance": 0.02,
        "probe_previous": 0.06,
        "probe_previous_chance": 0.06,
        "prev_token": 0.1,
        "sink_rate": 0.1,
        "top_offset": "other",
        "top_offset_share": 0.2,
        "norm_entropy": 0.5,
        "write_ratio": 0.1,
        "active_rows": 0.2,
        "offsink_prev_token": 0.1,
        "offsink_top_offset": "other",
        "offsink_top_offset_share": 0.3,
        "offsink_norm_entropy": 0.5,
        "far_mass": 0.3,
        "probe_retrieval": 0.0,
        "probe_retrieval_chance": 0.001,
    }
    return pd.DataFrame([{**row, **columns}])


@pytest.mark.parametrize(
    ("columns", "role", "reason"),
    [
        ({"probe_induction": 0.9, "sink_rate": 0.99}, "induction", "probe_induction 0.900 >= 0.3 (chance 0.020)"),
        ({"probe_duplicate": 0.5, "probe_previous": 0.5}, "duplicate-token", "probe_duplicate 0.500 >= 0.3"),
        ({"probe_previous": 0.7, "sink_rate": 0.8}, "previous-token", "probe_previous 0.700 >= 0.3"),
        ({"probe_previous": float("nan"), "prev_token": 0.8}, "previous-token", "prev_token 0.800 >= 0.3 (no probes)"),
        ({"probe_induction": 0.9, "write_ratio": 0.001}, "induction", "probe_induction 0.900 >= 0.3"),
        ({"write_ratio": 0.001, "sink_rate": 0.99}, "dormant", "write_ratio 0.0010 < 0.025"),
        ({"sink_rate": 0.8, "top_offset": "0", "top_offset_share": 0.9}, "sink", "sink_rate 0.800 >= 0.5"),
        ({"top_offset": "0", "top_offset_share": 0.9}, "positional", "top_offset 0 in 0.900 of rows >= 0.5"),
        ({"top_offset": "first", "top_offset_share": 0.9}, "other", "no rule matched"),
        ({"far_mass": 0.01, "norm_entropy": 0.9}, "streaming", "far_mass 0.010 <= 0.05"),
        ({"probe_retrieval": 0.5, "probe_induction": 0.9}, "retrieval", "probe_retrieval 0.500 >= 0.1 (chance 0.001)"),
        ({"probe_retrieval": float("nan"), "probe_induction": 0.9}, "induction", "probe_induction 0.900"),
        ({"top_offset": "0", "top_offset_share": 0.9, "far_mass": 0.0}, "positional", "top_offset 0 in 0.900"),
        ({"far_mass": float("nan"), "norm_entropy": 0.9}, "broad", "norm_entropy 0.900 >= 0.7"),
        ({"norm_entropy": 0.9}, "broad", "norm_entropy 0.900 >= 0.7"),
        ({}, "other", "no rule matched: best probe 0.060"),
    ],
)
def test_the_role_rule_in_order(columns, role, reason):
    labelled = assign_roles(evidence(**columns), RoleThresholds(), Thresholds())
    assert labelled["role"].iloc[0] == role and role in ROLES
    assert labelled["role_reason"].iloc[0].startswith(reason)


@pytest.fixture(scope="module")
def induction_report(tmp_path_factory):
    """The planted induction circuit, measured through the CLI on sentences of its own words."""
    folder = build_planted_induction(tmp_path_factory.mktemp("induction") / "model")
    rng = np.random.default_rng(0)
    corpus = folder.parent / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(induction_words(), size=rng.integers(5, 30))) for _ in range(60)))
    out = folder.parent / "report"
    result = run_cli("analyze", folder, "--corpus", corpus, "--out", out, "--no-charts")
    assert result.exit_code == 0, result.output
    # The summary names each role's strongest heads with the evidence: the planted circuit's two heads.
    heads = pd.read_parquet(out / "heads.parquet").set_index(["layer", "head"])
    shown = " ".join(result.stdout.split())
    assert f"induction (1) probe_induction 1.0 {heads.loc[(1, 0), 'probe_induction']:.3f}" in shown
    assert f"previous-token (1) probe_previous 0.0 {heads.loc[(0, 0), 'probe_previous']:.3f}" in shown
    return out


def test_the_strongest_heads_of_each_role_by_its_evidence():
    heads = pd.DataFrame(
        {
            "layer": [0, 0, 1, 1, 2, 2],
            "head": [0, 1, 0, 1, 0, 1],
            "role": ["induction", "induction", "previous-token", "previous-token", "induction", "other"],
            "probe_induction": [0.5, 0.9, 0.1, 0.1, 0.7, 0.95],
            "probe_previous": [np.nan] * 6,  # no probes: previous-token is ranked by the corpus's prev_token
            "prev_token": [0.1, 0.1, 0.6, 0.8, 0.1, 0.1],
        }
    )
    found = top_heads_per_role(heads, count=2)
    assert found == [
        {"role": "induction", "heads": 3, "evidence": "probe_induction", "top": [(0, 1, 0.9), (2, 0, 0.7)]},
        {"role": "previous-token", "heads": 2, "evidence": "prev_token", "top": [(1, 1, 0.8), (1, 0, 0.6)]},
    ]  # "other" has no evidence to rank by; the 0.95 of an "other" head is not an induction head's


def test_a_planted_induction_circuit_is_found(induction_report):
    heads = pd.read_parquet(induction_report / "heads.parquet").set_index(["layer", "head"])
    induction, previous = heads.loc[(1, 0)], heads.loc[(0, 0)]
    assert induction["probe_induction"] >= 0.9 and induction["role"] == "induction"
    assert induction["probe_induction_ci_low"] > 0.9 * induction["probe_induction"]
    assert previous["probe_previous"] >= 0.9 and previous["role"] == "previous-token"
    random_heads = heads.drop([(0, 0), (1, 0)])
    for pattern in PROBE_PATTERNS:
        chance = heads[f"probe_{pattern}_chance"]
        assert np.allclose(random_heads[f"probe_{pattern}"], chance.iloc[0], atol=0.01), pattern
        assert (random_heads[f"probe_{pattern}_ci_low"] <= random_heads[f"probe_{pattern}"]).all()
    # The other heads' outputs are discarded (their output projection columns are zero): they write nothing.
    assert (random_heads["write_norm"] == 0).all() and (random_heads["role"] == "dormant").all()


def test_classify_reapplies_the_roles_with_other_thresholds(induction_report, tmp_path):
    out = tmp_path / "strict"
    result = run_cli("classify", induction_report, "--out", out, "--role-probe-min", "0.999")
    assert result.exit_code == 0, result.output
    heads = pd.read_parquet(out / "heads.parquet").set_index(["layer", "head"])
    assert heads.loc[(1, 0), "role"] != "induction"  # 0.98 < 0.999
    assert "induction" in result.output  # the role table is printed
    run = pd.read_json(out / "run.json", typ="series")
    assert run["classification"]["role_thresholds"]["probe_min"] == 0.999
    assert math.isclose(
        heads.loc[(1, 0), "probe_induction"],
        pd.read_parquet(induction_report / "heads.parquet").set_index(["layer", "head"]).loc[(1, 0), "probe_induction"],
    )


def test_both_labels_at_once_equal_each_in_turn():
    """label_heads reads the table once for both reasons: the same frame as assign_roles(classify_heads(...)),
    on 400 heads drawn so that every type and role occurs, NaN evidence included."""
    rng = np.random.default_rng(7)
    n = 400
    frame = pd.concat([evidence()] * n, ignore_index=True)
    for column in ("probe_induction", "probe_duplicate", "probe_previous", "prev_token", "sink_rate",
                   "top_offset_share", "norm_entropy", "active_rows", "offsink_prev_token",
                   "offsink_top_offset_share", "offsink_norm_entropy", "far_mass", "probe_retrieval"):  # fmt: skip
        values = rng.uniform(0, 1, n) ** 3
        values[rng.uniform(0, 1, n) < 0.05] = np.nan
        frame[column] = values
    frame["write_ratio"] = rng.uniform(0, 0.2, n)
    frame["top_offset"] = rng.choice(["first", "0", "1", "2", "other"], n)
    frame["offsink_top_offset"] = rng.choice(["0", "1", "2", "other"], n)
    frame["layer"], frame["head"] = np.arange(n) // 20, np.arange(n) % 20
    frame["diagonal"], frame["diagonal_uniform"] = rng.uniform(0.3, 1, n), 0.4
    thresholds, roles = Thresholds(), RoleThresholds()

    together = label_heads(frame, thresholds, roles)

    pd.testing.assert_frame_equal(together, assign_roles(classify_heads(frame, thresholds), roles, thresholds))
    assert set(together["head_type"]) == set(HEAD_TYPES) and set(together["role"]) == set(ROLES)
