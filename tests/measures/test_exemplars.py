"""Exemplars: the strongest rows of each head, kept in bounded memory, equal to a sort of every row whatever the
batches, their order, the ranks or the attention path; on a planted model, the planted rows; on SmolLM2, a float64
computation from the model's own eager attention."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import headscope
from headscope.measures.exemplars import TopRows, exemplar_frame, merged_states

from helpers import assert_same_exemplars
from reference import eager_attention

COUNT = 5


def random_rows(seed: int, sentences: int = 40, heads: int = 3, rows: int = 7):
    """Scores with many exact ties (a few distinct values), some rows not counted, and keys and weights."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 6, (sentences, heads, rows), generator=gen).float() / 5
    counted = torch.rand(sentences, 1, rows, generator=gen) > 0.2
    keys = torch.randint(0, rows, (sentences, heads, rows), generator=gen)
    return scores, counted, keys, torch.rand(sentences, heads, rows, generator=gen)


def brute_force(scores, counted, keys, weights, sentence_ids, count):
    """Every counted row sorted by score (descending), then sentence, then row: the first `count` per head."""
    rows = []
    for b, sentence in enumerate(sentence_ids):
        for h in range(scores.shape[1]):
            for r in range(scores.shape[2]):
                if counted[b, 0, r]:
                    rows.append((h, -float(scores[b, h, r]), sentence, r, int(keys[b, h, r]), float(weights[b, h, r])))
    rows.sort()
    frame = pd.DataFrame(rows, columns=["head", "score", "sentence", "row", "key", "weight"])
    frame["score"] = -frame["score"]
    frame["rank"] = frame.groupby("head").cumcount() + 1
    return frame[frame["rank"] <= count].reset_index(drop=True)


def offered(batches, scores, counted, keys, weights, sentence_ids, count=COUNT):
    top = TopRows(count, ["sharp"], layers=[0], heads=scores.shape[1])
    for picked in batches:
        starts = torch.zeros(len(picked), dtype=torch.long)
        ids = [sentence_ids[i] for i in picked]
        top.offer(0, ["sharp"], scores[picked][None], counted[picked][None], keys[picked][None],
                  weights[picked][None], sentence_ids=ids, seq_start=starts)  # fmt: skip
    return top


def kept(top) -> pd.DataFrame:
    frame = exemplar_frame(top.state, top.kinds, [0])
    return frame[["head", "score", "sentence", "row", "key", "weight", "rank"]].astype({"weight": float})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kept_rows_are_a_full_sort_of_every_row_whatever_the_batches(seed):
    scores, counted, keys, weights = random_rows(seed)
    sentence_ids = list(np.random.default_rng(seed).permutation(1000)[: scores.shape[0]])
    expected = brute_force(scores, counted, keys, weights, sentence_ids, COUNT)
    everything = [list(range(scores.shape[0]))]
    one_by_one = [[i] for i in reversed(range(scores.shape[0]))]
    uneven = [list(range(0, 3)), list(range(3, 31)), list(range(31, scores.shape[0]))]
    for batches in (everything, one_by_one, uneven):
        got = kept(offered(batches, scores, counted, keys, weights, sentence_ids))
        pd.testing.assert_frame_equal(got, expected[got.columns], check_dtype=False, atol=1e-6)


def test_ranks_states_merge_to_one_runs():
    """Sentences split between two ranks (chunk i to rank i % 2): the merged states equal one process's."""
    scores, counted, keys, weights = random_rows(7)
    ids = list(range(scores.shape[0]))
    whole = offered([ids], scores, counted, keys, weights, ids)
    ranks = [offered([ids[r::2]], scores, counted, keys, weights, ids) for r in range(2)]
    merged = merged_states([rank.state for rank in ranks], ["sharp"], [0])
    np.testing.assert_array_equal(merged, whole.state)


def test_a_head_with_fewer_rows_than_asked_keeps_what_there_is():
    scores, counted, keys, weights = random_rows(3, sentences=1, rows=3)
    got = kept(offered([[0]], scores, counted, keys, weights, [0], count=50))
    assert (got.groupby("head").size() == int(counted.sum())).all()


@pytest.fixture(scope="module")
def planted_runs(planted_gpt2, corpus_lines):
    """The planted GPT-2 on 30 sentences: batched by memory, one sentence a batch, and on the block-wise fused path
    (block_bytes 4096)."""
    model = headscope.load_model(str(planted_gpt2), device="cpu")
    common = {"probes": False, "check_dormant": False, "bootstrap": 0, "exemplars": 6}
    return {
        name: headscope.analyze(model, corpus_lines[:30], **common, **options)
        for name, options in {"auto": {}, "one": {"batch_size": 1}, "fused": {"block_bytes": 4096}}.items()
    }


def exemplars_of(report):
    return pd.read_parquet(report.folder / "exemplars.parquet") if report.folder else report.exemplars


def test_the_planted_previous_token_head_attends_to_the_previous_token_in_every_exemplar(planted_runs):
    frame = planted_runs["auto"].exemplars
    head = frame[(frame["layer"] == 0) & (frame["head"] == 1)]  # planted: all its mass on t - 1
    assert set(head["kind"]) == {"sharp", "write", "induction", "duplicate", "previous"}
    for kind in ("sharp", "previous"):
        rows = head[head["kind"] == kind]
        assert len(rows) == 6
        assert (rows["key"] == rows["row"] - 1).all() and (rows["weight"] > 0.99).all()
        assert (rows["row"] >= 4).all()  # rows before 4 see too few keys to count


@pytest.mark.parametrize("other", ["one", "fused"])
def test_exemplars_are_the_same_whatever_the_batch_size_or_attention_path(planted_runs, other):
    """Scores within float32 rounding; the rows themselves equal wherever the scores are not tied within it."""
    assert_same_exemplars(planted_runs["auto"].exemplars, planted_runs[other].exemplars)


def test_the_batching_comparison_admits_ties_and_nothing_else():
    """assert_same_exemplars, as the batch-size and resume tests use it: a repeated sentence kept in another copy
    passes; a row that is not tied with what it replaces, or another key, fails."""
    frame = pd.DataFrame({"layer": 0, "head": 0, "kind": "sharp", "rank": [1, 2, 3], "sentence": [4, 7, 9],
                          "row": [5, 5, 6], "key": [1, 2, 3], "score": [0.9, 0.5, 0.25]})  # fmt: skip
    repeat = frame.assign(sentence=[4, 7, 19], score=[0.9, 0.5, 0.25 + 1e-7])  # sentence 19 repeats 9: a border tie
    assert_same_exemplars(frame, repeat)
    # two rows tied, in the other order
    swapped = frame.assign(sentence=[4, 9, 7], row=[5, 6, 5], key=[1, 3, 2], score=[0.9, 0.5 + 1e-7, 0.5])
    assert_same_exemplars(frame.assign(score=[0.9, 0.5, 0.5]), swapped)
    for other in (frame.assign(sentence=[4, 8, 9]), frame.assign(key=[1, 2, 4]), frame.assign(score=[0.9, 0.5, 0.2])):
        with pytest.raises(AssertionError):
            assert_same_exemplars(frame, other)


def test_exemplars_off_writes_no_table(planted_gpt2, corpus_lines, tmp_path):
    report = headscope.analyze(str(planted_gpt2), corpus_lines[:5], out=tmp_path / "r", exemplars=0, probes=False,
                               check_dormant=False, charts=None)  # fmt: skip
    assert report.exemplars is None and not (tmp_path / "r" / "exemplars.parquet").exists()


def test_smollm2_sharp_exemplars_equal_a_float64_computation_from_the_eager_attention(smollm2, corpus_lines):
    """The sharpest rows of three heads (the top induction head 18.6 among them), recomputed row by row from the
    attention the model's own eager function gives: the largest weight off the first token, over rows >= 4."""
    heads = [(18, 6), (0, 0), (29, 8)]
    report = headscope.analyze(smollm2, corpus_lines[:40], probes=False, check_dormant=False, exemplars=10)
    got = report.exemplars
    rows = {head: [] for head in heads}
    for sentence, (ids, attention) in enumerate(eager_attention(smollm2, corpus_lines[:40])):
        for layer, head in heads:
            weights = attention[layer][head]
            for t in range(4, len(ids)):
                key = int(weights[t, 1 : t + 1].argmax()) + 1
                rows[(layer, head)].append((-weights[t, key], sentence, t, key))
    for (layer, head), candidates in rows.items():
        expected = sorted(candidates)[:10]
        mine = got[(got["layer"] == layer) & (got["head"] == head) & (got["kind"] == "sharp")]
        np.testing.assert_allclose(mine["score"], [-row[0] for row in expected], rtol=1e-5, atol=1e-6)
        assert list(zip(mine["sentence"], mine["row"], mine["key"], strict=True)) == [row[1:] for row in expected]
