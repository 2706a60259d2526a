"""headscope inspect --exemplars L.H REPORT: a head on the corpus sentences of its exemplars, each at its rows."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

import headscope
from headscope.layout import ATTENTION_FILE, INSPECT_RECORD, TOKENS_FILE

from helpers import assert_one_line_error, run_cli

# float32 softmax weights from a batched pass (analyze) and a text run alone (inspect): the same sums in another
# order, off by a few units of float32's 6e-8 per key summed (the planted sentences have under 40 keys).
WEIGHT_TOLERANCE = 40 * 6e-8


@pytest.fixture(scope="module")
def report(planted_gpt2, shipped_corpus, tmp_path_factory):
    folder = tmp_path_factory.mktemp("exemplars") / "report"
    corpus = folder.parent / "corpus.txt"
    shutil.copy(shipped_corpus, corpus)
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", folder, "--no-charts", "--no-page",
                     "--bootstrap", "0", "--exemplars", "4")  # fmt: skip
    assert result.exit_code == 0, result.output
    return folder


def exemplars_of(report, layer: int, head: int) -> pd.DataFrame:
    table = pd.read_parquet(report / "exemplars.parquet")
    return table[(table["layer"] == layer) & (table["head"] == head)]


def test_the_sentences_are_the_heads_exemplars_and_every_exemplar_is_where_the_report_says(report, tmp_path):
    """The texts are the exemplars' sentences, strongest rank first (kinds in the report's order within a rank);
    at each exemplar's row, its key holds the weight and the row the token the report recorded."""
    out = tmp_path / "seen"
    result = run_cli("inspect", "--exemplars", "0.1", report, "--out", out)  # the report stands for the model
    assert result.exit_code == 0, result.output
    record = json.loads((out / INSPECT_RECORD).read_text())
    mine = exemplars_of(report, 0, 1)
    kinds = list(dict.fromkeys(mine["kind"]))
    ordered = mine.assign(order=mine["kind"].map(kinds.index)).sort_values(["rank", "order"])
    assert [text["sentence_id"] for text in record["texts"]] == list(dict.fromkeys(ordered["sentence"]))
    assert record["heads"] == ["0.1"] and record["roles"] == {"0.1": "previous-token"}
    marked = {(text["sentence_id"], m["kind"], m["rank"]): (text["text_id"], m) for text in record["texts"]
              for m in text["exemplars"]}  # fmt: skip
    assert len(marked) == len(mine) == len(kinds) * 4
    attention = pd.read_parquet(out / ATTENTION_FILE).set_index(["text_id", "query", "key"])["weight"]
    tokens = pd.read_parquet(out / TOKENS_FILE).set_index(["text_id", "position"])["token"]
    for e in mine.itertuples():
        text_id, mark = marked[(e.sentence, e.kind, e.rank)]
        assert (mark["row"], mark["key"]) == (e.row, e.key)
        assert attention[(text_id, e.row, e.key)] == pytest.approx(e.weight, abs=WEIGHT_TOLERANCE)
        assert tokens[(text_id, e.row)] == e.query_token
    label = record["texts"][0]["label"]
    first = ordered.iloc[0]
    assert label.startswith(f"sentence {first['sentence']}: {first['kind']} {first['rank']}")


def test_the_library_takes_the_report_and_a_head(planted_gpt2, report, tmp_path):
    seen = headscope.inspect(str(planted_gpt2), report=report, exemplars=(1, 0))
    assert [text.sentence_id for text in seen.texts] == list(dict.fromkeys(
        exemplars_of(report, 1, 0).sort_values("rank", kind="stable")["sentence"]))  # fmt: skip
    assert seen.record["heads"] == ["1.0"]


def test_what_cannot_be_opened_is_one_line(planted_gpt2, report, shipped_corpus, tmp_path):
    ask = ("inspect", "--exemplars")
    assert_one_line_error(run_cli(*ask, "0.1", planted_gpt2), "is not one (no run.json)", code=2)
    assert_one_line_error(run_cli(*ask, "0.1,1.0", report), "one head", code=2)
    assert_one_line_error(run_cli(*ask, "0.1", planted_gpt2, "--report", report, "--heads", "1.0"), "drop --heads",
                          code=2)  # fmt: skip
    assert_one_line_error(run_cli(*ask, "7.0", report), "head 7.0 has no exemplars", "layers: 0-1", code=2)
    result = run_cli(*ask, "0.1", report, "--max-length", "3")
    assert_one_line_error(result, "does not tokenize as in the report", code=2)
    other = tmp_path / "other.txt"
    other.write_text(shipped_corpus.read_text()[::-1])
    assert_one_line_error(run_cli(*ask, "0.1", report, "--corpus", other), "is not the corpus", "sha256", code=2)
    none = tmp_path / "none"
    assert run_cli("analyze", planted_gpt2, "--out", none, "--no-charts", "--no-page", "--bootstrap", "0",
                   "--exemplars", "0").exit_code == 0  # fmt: skip
    assert_one_line_error(run_cli(*ask, "0.1", none), "holds no exemplars.parquet", code=2)
