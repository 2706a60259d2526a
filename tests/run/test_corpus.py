"""Corpus formats and their errors."""

from __future__ import annotations

import json
import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from headscope.errors import CorpusError
from headscope.run.corpus import default_corpus_path, read_corpus

from helpers import (
    assert_one_line_error,
    run_cli,
)


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


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            'text\n"The cat sat.\nThe dog ran.\nA bird sang.\n',
            "corpus.csv:2: a quote opened on this line is never closed",
        ),
        ('id,text\n1,"The cat" sat.\n2,Fine.\n', "corpus.csv:2: malformed CSV"),
        ("text\nHello, world.\n", "corpus.csv:2: 2 fields, but the header has 1"),
    ],
)
def test_malformed_csv_is_an_error_naming_the_line(planted_gpt2, tmp_path, content, message, no_model_loading):
    path = tmp_path / "corpus.csv"
    path.write_text(content)
    assert_one_line_error(no_model_loading("analyze", planted_gpt2, "--corpus", path, "--out", tmp_path / "o"), message)


def test_text_column_reads_a_tsv_and_is_refused_for_plain_text(planted_gpt2, tmp_path):
    tsv = tmp_path / "corpus.tsv"
    tsv.write_text("id\tsentence\n1\tThe cat sat.\n2\tThe dog ran.\n")
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--corpus", tsv, "--text-column", "sentence", "--out", out, "--no-charts")
    assert result.exit_code == 0, result.output
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert sentences["text"].tolist() == ["The cat sat.", "The dog ran."] and sentences["line"].tolist() == [2, 3]
    txt = tmp_path / "corpus.txt"
    txt.write_text("id\tsentence\n1\tThe cat sat.\n")
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--corpus", txt, "--text-column", "sentence", "--out", tmp_path / "p"),
        "is read as plain text, one sentence per line",
        code=2,
    )


def test_a_parquet_corpus_with_corrupt_data_pages(planted_gpt2, tmp_path, corpus_lines, no_model_loading):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": [f"{line} {i}" for i in range(20) for line in corpus_lines]}), path)
    data = bytearray(path.read_bytes())
    data[64:4096] = os.urandom(4096 - 64)  # the first data page; the footer at the end stays intact
    path.write_bytes(bytes(data))
    pq.read_schema(path)  # the footer still reads
    assert_one_line_error(
        no_model_loading("analyze", planted_gpt2, "--corpus", path, "--out", tmp_path / "o"),
        "corpus.parquet: column 'text' cannot be read",
    )
