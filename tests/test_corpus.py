"""Corpus formats and their errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from headscope.errors import CorpusError
from headscope.run.corpus import default_corpus_path, read_corpus


def texts(corpus) -> list[tuple[int, str]]:
    return [(s.line, s.text) for s in corpus.sentences]


def test_text_lines_are_stripped_and_blank_lines_skipped(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"\xef\xbb\xbf  First one.\r\n\r\nSecond\ttwo.  \n   \nThird.\rFourth.\n")
    corpus = read_corpus(path)
    assert texts(corpus) == [(1, "First one."), (3, "Second\ttwo."), (5, "Third."), (6, "Fourth.")]
    assert corpus.blank_skipped == 2
    assert [s.sentence_id for s in corpus.sentences] == [0, 1, 2, 3]


def test_jsonl_csv_and_parquet(tmp_path):
    rows = [{"text": "Alpha.", "n": 1}, {"text": " ", "n": 2}, {"text": "Gamma, delta.", "n": 3}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pd.DataFrame(rows).to_csv(tmp_path / "c.csv", index=False)
    pd.DataFrame(rows).rename(columns={"text": "sentence"}).to_parquet(tmp_path / "c.parquet")
    expected = [(1, "Alpha."), (3, "Gamma, delta.")]
    assert texts(read_corpus(tmp_path / "c.jsonl")) == expected
    assert texts(read_corpus(tmp_path / "c.csv")) == [(2, "Alpha."), (4, "Gamma, delta.")]  # line 1 is the header
    assert texts(read_corpus(tmp_path / "c.parquet", text_column="sentence")) == expected


def test_missing_and_directory(tmp_path):
    with pytest.raises(CorpusError, match="corpus file not found"):
        read_corpus(tmp_path / "absent.txt")
    with pytest.raises(CorpusError, match="not a file"):
        read_corpus(tmp_path)


def test_shipped_corpus_has_100_distinct_sentences():
    corpus = read_corpus(default_corpus_path())
    assert len(corpus.sentences) == 100
    assert len({s.text for s in corpus.sentences}) == 100
