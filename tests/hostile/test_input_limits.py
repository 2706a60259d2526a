"""Inputs that would hang, exhaust memory or crash a run are refused at once, before the model loads, in one
line: huge ranges and counts, long lines, options that would do nothing."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest

from headscope.progress import NullReporter

from helpers import (
    QUICK,
    assert_one_line_error,
    hidden_leftovers,
    refuse_to_load,
    run_cli,
    run_measuring_script,
    tiny_llama,
)


def test_a_huge_layer_range_is_refused_at_once(planted_gpt2, tmp_path, no_model_loading):
    started = time.perf_counter()
    assert_one_line_error(
        no_model_loading("analyze", planted_gpt2, "--layers", "0-9999999999", "--out", tmp_path / "o"),
        "--layers names layer 9999999999",
        code=2,
    )
    assert time.perf_counter() - started < 5


def test_layers_beyond_the_model_are_refused_before_its_weights_load(planted_gpt2, tmp_path, no_model_loading):
    assert_one_line_error(  # the model's config is read, its weights are not
        no_model_loading("analyze", planted_gpt2, "--layers", "0-5", "--out", tmp_path / "o"),
        "--layers names layer 2, but the model has layers 0-1",
        code=2,
    )
    assert not (tmp_path / "o").exists() and hidden_leftovers(tmp_path) == []


def test_a_huge_window_is_the_same_as_the_longest_sentence(planted_gpt2, corpus, tmp_path):
    started = time.perf_counter()
    huge = run_cli(
        "analyze",
        planted_gpt2,
        "--corpus",
        corpus,
        "--out",
        tmp_path / "huge",
        "--no-charts",
        "--window",
        "99999999999999999999",
    )
    assert huge.exit_code == 0, huge.output
    assert time.perf_counter() - started < 30
    wide = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", tmp_path / "wide", "--no-charts", "--window", "64"
    )  # the planted model's longest possible sentence
    assert wide.exit_code == 0, wide.output
    columns = ["diagonal", "diagonal_uniform", "locality", "head_type"]
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "huge" / "heads.parquet")[columns],
        pd.read_parquet(tmp_path / "wide" / "heads.parquet")[columns],
    )


PEAK_SCRIPT = """
import json, resource, sys
import headscope
from headscope.model.loading import load_model
loaded = load_model(sys.argv[1], device="cpu", dtype="float32")
words = open(sys.argv[2]).read().split()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the first call checks the eager function: no warm-up
result = headscope.analyze(loaded, [" ".join(words[:5000])], max_length=4096, sentence_heads=False, charts=None)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kib": after - before, "tokens": result.run["corpus"]["tokens"],
                  "paths": result.run["attention_implementation"]}))
"""


@pytest.mark.slow  # a child process
def test_peak_memory_of_a_long_input_is_bounded_by_the_block_budget(tmp_path, corpus_lines, shipped_corpus):
    """One 4,096-token sentence through 8 heads: a full layer of float32 attention is 512 MiB, and the old
    first-call check held three of them; what headscope holds now is bounded by its 32 MiB blocks."""
    folder = tiny_llama(tmp_path / "llama", corpus_lines)
    words = tmp_path / "words.txt"
    words.write_text(" ".join(shipped_corpus.read_text().split() * 6))
    measured = run_measuring_script(PEAK_SCRIPT, folder, words)
    assert measured["tokens"] == 4096
    assert "fused" in measured["paths"]["LlamaAttention"]
    assert measured["grew_kib"] * 1024 < 256 * 2**20, measured  # blocks and their temporaries, not t x t


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bootstrap", "1000000000"], "--bootstrap takes 0 (no intervals) or 2 to 100,000 replicates"),
        (["--probe-seeds", "1000000000"], "--probe-seeds takes at most 10,000 sequences"),
        (["--bootstrap-seed", "-1"], "--bootstrap-seed takes a whole number from 0 to 2**64 - 1"),
    ],
)
def test_absurd_counts_are_refused_before_loading(args, message, planted_gpt2, tmp_path):
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", *args, loader=refuse_to_load)
    assert_one_line_error(result, message, "(see headscope analyze --help)", code=2)


def test_replicate_sums_beyond_the_memory_budget_are_refused_before_loading(planted_gpt2, tmp_path):
    result = run_cli(
        "analyze", planted_gpt2, "--out", tmp_path / "o", "--bootstrap", "100000", "--max-memory", "1MiB",
        loader=refuse_to_load,
    )  # fmt: skip
    assert_one_line_error(result, "--bootstrap 100,000 needs", "MiB for its replicate sums (2 layers x 3 heads)",
                          "replicates fit")  # fmt: skip


def test_a_one_line_corpus_of_many_megabytes_is_cut_before_it_is_tokenized(planted_gpt2, tmp_path, corpus_lines):
    """A 5 MB line used to be tokenized whole before truncation (a 100 MB line took more than 8 GB): the text is
    cut first, to what can still give the model's 64 tokens, and the run says so."""
    words = " ".join(corpus_lines).split()
    line = " ".join(words * (5_000_000 // len(" ".join(words)) + 1))
    corpus = tmp_path / "huge.txt"
    corpus.write_text(line[:5_000_000] + "\nThe cat sat on the mat.\n")
    out = tmp_path / "o"
    started = time.perf_counter()
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, *QUICK, "--no-charts", "--no-page")
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - started < 20
    assert "(1 truncated, 1 so long they were cut before tokenizing)" in result.output
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert sentences["n_tokens"].tolist() == [64, 7] and sentences["truncated"].tolist() == [True, False]
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["cut_before_tokenizing"] == 1


@pytest.mark.slow  # analyze through the CLI for each of three modes
@pytest.mark.parametrize(("mode", "outcome"), [("strict", "error"), ("replace", "\ufffd"), ("skip", "skipped")])
def test_a_lone_surrogate_in_jsonl_is_invalid_text(mode, outcome, planted_gpt2, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "The cat sat."}\n{"text": "bad \\ud800 here"}\n')
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--encoding-errors", mode, *QUICK)
    if outcome == "error":
        assert_one_line_error(result, "c.jsonl:2: a lone surrogate ('\\ud800') at column 5")
        return
    assert result.exit_code == 0, result.output
    texts = pd.read_parquet(out / "sentences.parquet")["text"].tolist()
    assert texts == (["The cat sat.", "bad \ufffd here"] if mode == "replace" else ["The cat sat."])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "100000000"], "--threads takes 1 to"),  # torch crashed (a segmentation fault)
        (["--offload-folder", "off"], "--offload-folder keeps what a --device-map sends to disk"),  # was ignored
    ],
)
def test_options_that_would_crash_or_do_nothing_are_refused(args, message, planted_gpt2, tmp_path):
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", *args, loader=refuse_to_load)
    assert_one_line_error(result, message, code=2)


class MeasuringFails(NullReporter):
    def start(self, total_sentences: int, what: str = "measuring") -> None:
        raise AssertionError("the corpus was measured before the bad option was refused")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--probe-length", "100000"], "needs that many distinct ordinary tokens; the tokenizer has 576"),
        (["--probe-length", "40"], "makes probe sequences of 80 tokens, more than the model's limit of 64"),
    ],
)
def test_a_probe_battery_that_cannot_run_is_refused_before_measuring(args, message, planted_gpt2, tmp_path):
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", *args, reporter=MeasuringFails())
    assert_one_line_error(result, message, code=2)


def test_a_probe_length_the_vocabulary_cannot_fill_is_refused_before_the_weights_load(planted_gpt2, tmp_path):
    """The tokenizer alone says so: no weights are loaded for it (it took 57-110 s on a large model)."""
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", "--probe-length", "100000",
                     loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(result, "needs that many distinct ordinary tokens; the tokenizer has 576", code=2)
