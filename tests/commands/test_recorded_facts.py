"""Every flag and count headscope writes is true: a sentence cut by --max-length is recorded as cut wherever it
came from, and an interval over one sentence is not an interval (NaN, and a note), in analyze, ablate and
compare alike."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

import headscope
import headscope.progress
from headscope.estimates import ONE_SENTENCE_NOTE

from helpers import run_cli
from planted import build_planted_copier, copy_words


def test_inspect_records_a_corpus_sentence_cut_by_max_length_as_truncated(planted_gpt2, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat and the dog ran\nthe cat\n")
    out = tmp_path / "inspection"
    result = run_cli("inspect", planted_gpt2, "--corpus", corpus, "--sentences", "0,1", "--text",
                     "the dog ran after the cat", "--max-length", "4", "--layers", "0", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    texts = {t["label"]: t for t in json.loads((out / "inspect.json").read_text())["texts"]}
    assert texts["sentence 0"]["truncated"] and texts["text 0"]["truncated"]
    assert not texts["sentence 1"]["truncated"]
    assert {t["tokens"] for t in texts.values()} == {4, 2}
    assert "inspect.html" in result.output.strip().splitlines()[-1]  # the last line lists every file written


def test_one_sentence_gets_no_interval_and_a_note(planted_gpt2, tmp_path):
    notes = []

    class Recording(headscope.progress.NullReporter):
        def note(self, text: str) -> None:
            notes.append(text)

    one = headscope.analyze(str(planted_gpt2), ["the cat sat on the mat"], out=tmp_path / "one", charts=None,
                            probes=False, reporter=Recording())  # fmt: skip
    for metric in ("entropy", "norm_entropy", "sink", "diagonal"):
        assert one.heads[f"{metric}_ci_low"].isna().all() and one.heads[f"{metric}_ci_high"].isna().all()
        assert one.layers[f"{metric}_ci_low"].isna().all()
    assert ONE_SENTENCE_NOTE in notes
    assert one.run["bootstrap"]["intervals"] is False and one.run["bootstrap"]["sentences"] == 1
    two = headscope.analyze(str(planted_gpt2), ["the cat sat on the mat", "the dog ran"], charts=None, probes=False)
    assert two.heads["entropy_ci_low"].notna().any() and two.run["bootstrap"]["intervals"] is True
    # compare pairs the one sentence with itself: no interval, no test, nothing flagged significant
    result = run_cli("compare", tmp_path / "one", tmp_path / "one", "--out", tmp_path / "cmp", "--no-charts")
    assert result.exit_code == 0, result.output
    heads = pd.read_parquet(tmp_path / "cmp" / "compare.parquet")
    assert heads["entropy_delta_ci_low"].isna().all() and heads["entropy_p"].isna().all()
    assert not heads["entropy_significant"].any()
    assert ONE_SENTENCE_NOTE in json.loads((tmp_path / "cmp" / "compare.json").read_text())["method"]


def test_ablate_gives_one_sentence_no_interval(tmp_path):
    folder = build_planted_copier(tmp_path / "copier", copiers=(0,), logit=20.0)
    loaded = headscope.load_model(str(folder), device="cpu", lm_head=True)
    words = copy_words()
    one = headscope.ablate(loaded, [" ".join([words[2]] * 6)], heads=[[(0, 0)]], mode="zero", bootstrap=100)
    group = one.record["groups"][0]
    assert group["delta"] > 1 and group["delta_ci_low"] is None and group["delta_ci_high"] is None
    two = headscope.ablate(loaded, [" ".join([w] * 6) for w in words[2:4]], heads=[[(0, 0)]], mode="zero",
                           bootstrap=100)  # fmt: skip
    assert np.isfinite(two.record["groups"][0]["delta_ci_low"])
