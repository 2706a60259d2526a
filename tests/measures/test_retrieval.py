"""The retrieval probe (headscope.measures.retrieval): its sequences, its hits on hand-built attention, the planted
induction head found as a retrieval head, every head against a straightforward computation from the model's own
attention weights, and its options refused in one line."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModel

import headscope
from headscope.errors import ConfigError
from headscope.measures.retrieval import (
    RetrievalSpec,
    chance_rows,
    retrieval_hits,
    retrieval_probe,
)
from headscope.model.batch import collate

from helpers import assert_one_line_error, run_cli
from planted import build_planted_induction, build_tokenizer, induction_words

SPAN, TOKENS = 4, 64


@pytest.fixture(scope="module")
def induction(tmp_path_factory):
    """The planted induction circuit (layer 1, head 0 attends to the token after an earlier copy of the current one)
    and a corpus of its words."""
    folder = build_planted_induction(tmp_path_factory.mktemp("retrieval") / "model")
    rng = np.random.default_rng(0)
    corpus = folder.parent / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(induction_words(), size=rng.integers(5, 30))) for _ in range(20)))
    return folder, corpus


def test_each_sequence_plants_one_span_twice():
    """The span's tokens occur exactly twice, at `first` and at the end; the rest is filler of other ordinary tokens;
    the seeds give different spans, and the same seed the same sequence."""
    tokenizer = build_tokenizer(induction_words())
    probe = retrieval_probe(tokenizer, RetrievalSpec(seeds=3, tokens=TOKENS, span=SPAN))
    for seed in range(3):
        ids = probe.sequence(seed)
        span = ids[probe.first : probe.first + SPAN]
        assert len(ids) == TOKENS and ids[probe.second :] == span and probe.second == TOKENS - SPAN
        counts = Counter(ids)
        assert all(counts[token] == 2 for token in span) and len(set(span)) == SPAN
        assert probe.first >= (TOKENS - 2 * SPAN) // 10
        assert probe.sequence(seed) == ids
    assert probe.sequence(0) != probe.sequence(1)


def test_a_hit_is_the_target_holding_the_rows_largest_weight():
    """Hand-built attention on one sequence beside a longer one (padded left and right): rows of the repeat that
    put their largest weight on the key after the first copy hit, a tie with another key does not, nor other rows;
    uniform attention's chance is the mean of 1 / (p + 1) over the repeat's rows."""
    first, second, t = 3, 10, 14  # span of 4: rows 10, 11, 12 are scored (13 has no next token in the span)
    attn = torch.zeros(1, 1, t, t)
    for p in range(t):
        attn[0, 0, p, : p + 1] = 1.0 / (p + 1)
    attn[0, 0, 10] = 0.0
    attn[0, 0, 10, first + 1] = 1.0  # a hit
    attn[0, 0, 11, :] = 0.0
    attn[0, 0, 11, [first + 2, 0]] = 0.5  # a tie: no hit
    attn[0, 0, 12, :] = 0.0
    attn[0, 0, 12, [first + 3, 12]] = torch.tensor([0.4, 0.6])  # another key holds more: no hit
    attn[0, 0, 13, :] = 0.0
    attn[0, 0, 13, first + 4] = 1.0  # past the span's end: not scored
    for side in ("right", "left"):
        batch = collate([0, 1], [[5] * t, [5] * (t + 3)], padding_side=side)
        start = int(batch.seq_start[0])
        padded = torch.full((2, 1, t + 3, t + 3), float("nan"))
        padded[0, :, start : start + t, :] = 0.0
        padded[0, :, start : start + t, start : start + t] = attn[0]
        valid = batch.attention_mask.bool()
        lengths = valid.sum(-1)
        hits = retrieval_hits(padded.nan_to_num(), 0, batch.seq_start, valid, lengths, first, second)
        in_blocks = sum(  # the same rows read in blocks of 4 (a block sees only its own rows' validity)
            retrieval_hits(padded.nan_to_num()[:, :, r : r + 4], r, batch.seq_start, valid[:, r : r + 4], lengths,
                           first, second)
            for r in range(0, t + 3, 4)
        )  # fmt: skip
        assert torch.equal(in_blocks, hits), side
        assert hits[0, 0] == 1.0, side
        rows, uniform = chance_rows(valid, batch.seq_start, second)
        assert rows[0] == 3 and uniform[0] == pytest.approx(1 / 11 + 1 / 12 + 1 / 13), side


def test_the_planted_induction_head_is_the_retrieval_head(induction):
    """At 64 tokens, layer 1 head 0 finds the span's next token on every row and takes the retrieval role (before
    induction); the previous-token head never does; the chance level is the rows' mean 1 / (p + 1)."""
    folder, corpus = induction
    report = headscope.analyze(str(folder), corpus, retrieval_length=TOKENS, probe_length=SPAN, probe_seeds=4,
                               bootstrap=0, charts=None, page=False)  # fmt: skip
    heads = report.heads.set_index(["layer", "head"])
    assert heads.at[(1, 0), "probe_retrieval"] == 1.0 and heads.at[(1, 0), "role"] == "retrieval"
    assert heads.at[(0, 0), "probe_retrieval"] == 0.0 and heads.at[(0, 0), "role"] == "previous-token"
    assert heads["probe_retrieval_ci_low"].le(heads["probe_retrieval"] + 1e-12).all()
    rows = range(TOKENS - SPAN, TOKENS - 1)
    assert heads["probe_retrieval_chance"].iloc[0] == pytest.approx(np.mean([1 / (p + 1) for p in rows]))
    assert report.run["settings"]["retrieval_length"] == TOKENS
    without = headscope.analyze(str(folder), corpus, probe_length=SPAN, probe_seeds=4, bootstrap=0, charts=None,
                                page=False)  # fmt: skip
    assert without.heads["probe_retrieval"].isna().all() and "retrieval" not in set(without.heads["role"])
    assert without.heads.set_index(["layer", "head"]).at[(1, 0), "role"] == "induction"


@pytest.mark.parametrize("block_bytes", [None, 4096])  # one block, or blocks of a few rows (the fused path's)
def test_every_head_equals_a_straightforward_computation(induction, block_bytes):
    """probe_retrieval of every head of the planted model (its other heads random) equals, per seed, the share of the
    repeat's rows whose largest weight in the model's own eager attention weights is the target, computed row by
    row with numpy. No row's target is within 1e-6 of its largest weight without equalling it (checked), so float32
    rounding cannot turn a hit into a miss here."""
    folder, corpus = induction
    blocks = {} if block_bytes is None else {"block_bytes": block_bytes}
    report = headscope.analyze(str(folder), corpus, retrieval_length=TOKENS, probe_length=SPAN, probe_seeds=3,
                               bootstrap=0, charts=None, page=False, **blocks)  # fmt: skip
    assert block_bytes is None or "fused" in str(report.run["attention_implementation"])
    probe = retrieval_probe(build_tokenizer(induction_words()), RetrievalSpec(3, TOKENS, SPAN))
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    scores = np.zeros((3, 2, 4))
    for seed in range(3):
        with torch.no_grad():
            attentions = model(torch.tensor([probe.sequence(seed)]), output_attentions=True).attentions
        for layer, weights in enumerate(attentions):
            for head in range(4):
                rows = weights[0, head].double().numpy()
                hits = []
                for p in range(probe.second, TOKENS - 1):
                    target = rows[p, probe.first + p - probe.second + 1]
                    assert abs(target - rows[p].max()) == 0 or abs(target - rows[p].max()) > 1e-6
                    hits.append(target >= rows[p].max() and (rows[p] == rows[p].max()).sum() == 1)
                scores[seed, layer, head] = np.mean(hits)
    expected = pd.Series(scores.mean(0).reshape(-1))
    np.testing.assert_array_equal(report.heads["probe_retrieval"].to_numpy(), expected.to_numpy())


def test_its_options_are_refused_in_one_line(induction, tmp_path):
    folder, corpus = induction
    common = ("analyze", folder, "--corpus", corpus, "--probe-length", SPAN, "--no-charts", "--no-page")
    too_short = run_cli(*common, "--retrieval-length", 12, "--out", tmp_path / "a")
    assert_one_line_error(too_short, "--retrieval-length 12", "at least 16 tokens", code=2)
    too_long = run_cli(*common, "--retrieval-length", 100, "--out", tmp_path / "b")
    assert_one_line_error(too_long, "--retrieval-length 100", "limit of 72", code=2)
    without_probes = run_cli(*common, "--retrieval-length", TOKENS, "--no-probes", "--out", tmp_path / "c")
    assert_one_line_error(without_probes, "--retrieval-length", "--no-probes", code=2)
    with pytest.raises(ConfigError, match="--retrieval-length"):
        headscope.RunConfig(retrieval_length=-1)
