"""The host side: token ids, collation and the prefetch thread."""

from __future__ import annotations

import threading

import pytest
import torch

from headscope.model.batch import collate
from headscope.run.feed import char_limit, tokenize_sentences
from headscope.run.prefetch import prefetched

AWKWARD = ["", "  ", "The cat sat.", "naïve café 😀 — ok", "x" * 300, "<|endoftext|> after a special token", "\t tab"]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_collate_pads_each_row_and_counts_tokens_on_the_host(padding_side):
    rows = [[5, 6, 7], [8], [9, 10]]
    batch = collate([3, 1, 2], rows, padding_side=padding_side)
    assert batch.sentence_ids == [3, 1, 2] and batch.n_tokens == 6
    for row, ids in enumerate(rows):
        start = 0 if padding_side == "right" else 3 - len(ids)
        assert batch.input_ids[row, start : start + len(ids)].tolist() == ids
        assert batch.attention_mask[row].tolist() == [int(start <= c < start + len(ids)) for c in range(3)]
        assert batch.position_ids[row, start : start + len(ids)].tolist() == list(range(len(ids)))
        assert int(batch.seq_start[row]) == start
    assert batch.input_ids[batch.attention_mask == 0].eq(0).all()
    doubled = batch.replicated(2)
    assert doubled.n_tokens == 12 and doubled.input_ids.shape == (6, 3)


def test_token_ids_equal_the_tokenizers_own_call(planted_gpt2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(planted_gpt2)
    texts = AWKWARD * 3
    ids, cut = tokenize_sentences(tokenizer, texts, None)
    assert ids == tokenizer(texts, add_special_tokens=True)["input_ids"] and not any(cut)
    ids, cut = tokenize_sentences(tokenizer, texts, 4)
    assert ids == [tokenizer(t, add_special_tokens=True, truncation=True, max_length=4)["input_ids"] for t in texts]
    assert cut == [len(row) > 4 for row in tokenizer(texts, add_special_tokens=True)["input_ids"]]


@pytest.mark.slow
def test_token_ids_equal_the_tokenizers_own_call_on_smollm2(smollm2):
    texts = AWKWARD * 3
    ids, _ = tokenize_sentences(smollm2.tokenizer, texts, None)
    assert ids == smollm2.tokenizer(texts, add_special_tokens=True)["input_ids"]


def test_prefetched_keeps_order_and_runs_ahead_in_another_thread():
    seen = []

    def produce():
        for i in range(50):
            seen.append(threading.current_thread().name)
            yield i

    assert list(prefetched(produce(), depth=3)) == list(range(50))
    assert set(seen) == {"headscope-host"}
    assert list(prefetched(iter(range(5)), depth=0)) == list(range(5))  # depth 0: in this thread


def test_prefetched_raises_the_producers_error_after_its_items():
    def produce():
        yield 1
        yield 2
        raise ValueError("bad line 3")

    got = []
    with pytest.raises(ValueError, match="bad line 3"):
        for item in prefetched(produce(), depth=2):
            got.append(item)
    assert got == [1, 2]


def test_prefetched_stops_the_producer_when_the_consumer_stops():
    produced = []

    def produce():
        for i in range(10_000):
            produced.append(i)
            yield i

    for item in prefetched(produce(), depth=2):
        if item == 3:
            break
    assert len(produced) < 10  # bounded: at most depth (+ the one being handed over) ahead
    assert not any(t.name == "headscope-host" for t in threading.enumerate())


def test_batches_move_to_a_device_and_stay_put_when_already_there():
    batch = collate([0], [[1, 2]])
    assert batch.to("cpu") is batch
    assert batch.to(torch.device("meta")).input_ids.device.type == "meta"


def test_the_character_limit_follows_a_tokenizer_that_gains_a_longer_token():
    """The longest vocabulary entry is remembered per tokenizer (reading the vocabulary costs a tenth of a short
    run), and read again once the tokenizer has grown: a limit from the old vocabulary would cut texts too soon."""
    from planted import build_tokenizer

    tokenizer = build_tokenizer(["short", "words", "only"])
    before = char_limit(tokenizer, 10)
    assert char_limit(tokenizer, 10) == before
    tokenizer.add_tokens(["x" * 300])
    assert char_limit(tokenizer, 10) == 2 * 11 * 300 > before
