"""`headscope patch` from the command line: its files, its printout, its roles, every option reaching the code, and
bad input refused in one line naming file and line, with nothing existing replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

import headscope

from helpers import assert_one_line_error, refuse_to_load, run_cli, snapshot
from planted import READER_PAIRS, build_planted_copier, write_reader_pairs


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> Path:
    return build_planted_copier(tmp_path_factory.mktemp("reader"), reads_from=1)


@pytest.fixture
def pairs(tmp_path) -> Path:
    return write_reader_pairs(tmp_path / "pairs.jsonl")


def test_patch_writes_its_tables_record_and_charts_and_prints_the_top_heads(reader, pairs, tmp_path):
    out = tmp_path / "patched"
    result = run_cli("patch", reader, "--pairs", pairs, "--out", out, "--bootstrap", "50")
    assert result.exit_code == 0, result.output
    effects = pd.read_parquet(out / "patching.parquet")
    assert len(effects) == 2 * 4 and set(effects["what"]) == {"output"} and set(effects["direction"]) == {"denoise"}
    per_pair = pd.read_parquet(out / "patching_pairs.parquet")
    assert len(per_pair) == len(effects) * len(READER_PAIRS)
    record = json.loads((out / "patch.json").read_text())
    assert record["pairs"]["count"] == 3 and len(record["per_pair"]) == 3
    assert record["gap"] == pytest.approx(record["m_clean_mean"] - record["m_corrupt_mean"])
    assert (out / "patch_heatmap.png").stat().st_size > 1000
    lines = result.stdout.splitlines()
    first = next(line for line in lines if line.strip().startswith(("0.", "1.")))
    assert first.split()[0] == "0.0" and "+1.000" in first
    assert "1 = all of the behaviour" in result.stdout
    again = run_cli("patch", reader, "--pairs", pairs, "--out", out)
    assert_one_line_error(again, "holds a headscope patching", "--overwrite")
    assert run_cli("patch", reader, "--pairs", pairs, "--out", out, "--overwrite", "--no-charts").exit_code == 0


def test_each_position_draws_the_positions_chart_with_the_tokens(reader, pairs, tmp_path):
    out = tmp_path / "each"
    result = run_cli("patch", reader, "--pairs", pairs, "--positions", "each", "--what", "values", "--out", out,
                     "--heads", "0.0,1.1", "--format", "svg", "--bootstrap", "0")  # fmt: skip
    assert result.exit_code == 0, result.output
    effects = pd.read_parquet(out / "patching.parquet")
    assert sorted(set(effects["position"])) == [0, 1, 2, 3, 4]
    assert {(r.layer, r.head) for r in effects.itertuples()} == {(0, 0), (1, 1)}
    svg = (out / "patch_positions.svg").read_text()
    assert "w3" in svg and "key position" in svg
    assert (out / "patch_heatmap.svg").is_file()


def test_report_adds_each_heads_role(reader, pairs, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(row[0].split() * 2) for row in READER_PAIRS) + "\n")
    report = tmp_path / "report"
    assert run_cli("analyze", reader, "--corpus", corpus, "--out", report, "--bootstrap", "0", "--no-charts",
                   "--probe-seeds", "2", "--probe-length", "8").exit_code == 0  # fmt: skip
    roles = headscope.Report.open(report).heads.set_index(["layer", "head"])["role"]
    found = headscope.patch(reader, pairs, report=report, bootstrap=0)
    assert list(found.effects["role"]) == [roles[r.layer, r.head] for r in found.effects.itertuples()]
    result = run_cli("patch", reader, "--pairs", pairs, "--report", report, "--no-charts", "--out", tmp_path / "p")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if "by role:" in line)
    assert f"{roles[0, 0]} 0.0" in line  # the one head that carries the behaviour, under its role
    layer_one = tmp_path / "layer-one"  # a report of layer 1 alone: layer 0's heads have no role, not "other"
    assert run_cli("analyze", reader, "--corpus", corpus, "--out", layer_one, "--layers", "1", "--bootstrap", "0",
                   "--no-charts", "--no-probes").exit_code == 0  # fmt: skip
    partial = headscope.patch(reader, pairs, report=layer_one, bootstrap=0)
    assert set(partial.effects.query("layer == 0")["role"]) == {"not measured"}
    assert "other" not in set(partial.effects.query("layer == 0")["role"])


def test_every_option_reaches_the_code(reader, pairs):
    """Each option changes what the record or the table says it changed."""
    base = headscope.patch(reader, pairs, bootstrap=20)
    assert base.record["what"] == "output" and base.record["direction"] == "denoise"
    changed = {
        "what": ("values", lambda r: set(r.effects["what"]) == {"values"}),
        "direction": ("noise", lambda r: r.record["direction"] == "noise" and r.record["per_pair"]),
        "heads": ([(1, 2)], lambda r: list(zip(r.effects["layer"], r.effects["head"], strict=True)) == [(1, 2)]),
        "layers": ((1,), lambda r: set(r.effects["layer"]) == {1} and len(r.effects) == 4),
        "fast": (True, lambda r: r.record["method"] == "attribution"),
        "bootstrap": (0, lambda r: r.effects["effect_ci_low"].isna().all()),
        "bootstrap_seed": (
            7,
            lambda r: r.record["bootstrap"]["seed"] == 7,
        ),  # the draws: tests/interventions/test_patch.py
        # fewer replicas per forward: tests/interventions/test_patch.py (this model is too small for a budget to bind)
        "max_memory": ("1MiB", lambda r: r.record["settings"]["max_memory"] == 2**20),
        "batch_size": (2, lambda r: r.record["timing"]["batches"] == 3),
    }
    for name, (value, holds) in changed.items():
        found = headscope.patch(reader, pairs, **{"bootstrap": 20, name: value})
        assert holds(found), name
    assert base.record["timing"]["batches"] == 1


@pytest.mark.parametrize(
    ("rows", "fragments"),
    [
        ([("w2 w3 w5", "w2 w3 w5 w6", "w3", "w4")], ["pairs.jsonl:1", "clean has 3 tokens and corrupt 4"]),
        ([READER_PAIRS[0], ("w2 w3", "w2 w4", "w3 w5", "w4")], ["pairs.jsonl:2", "answer 'w3 w5' is 2 tokens"]),
        ([("w2 w3", "w2 w4", "w3", "w3")], ["pairs.jsonl:1", "same token"]),
        ([("w2 w3", "w2 w4", "", "w4")], ["pairs.jsonl:1", "'answer' is empty"]),
    ],
)
def test_bad_pairs_are_one_line_errors_naming_file_and_line(reader, tmp_path, rows, fragments):
    pairs = write_reader_pairs(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    before = snapshot(tmp_path)
    result = run_cli("patch", reader, "--pairs", pairs, "--out", tmp_path / "new")
    assert_one_line_error(result, *fragments)
    assert snapshot(tmp_path) == before and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("name", "text", "fragments"),
    [
        ("empty.jsonl", "", ["no pairs", "empty.jsonl"]),
        ("blank.jsonl", "\n\n", ["no pairs"]),
        ("missing.jsonl", '{"clean": "a", "corrupt": "b", "answer": "c"}\n', ["missing.jsonl:1", "'distractor'"]),
        ("missing.csv", "clean,corrupt,answer\na,b,c\n", ["missing.csv", "no column 'distractor'"]),
        ("broken.jsonl", '{"clean": "a",\n', ["broken.jsonl:1", "not valid JSON"]),
        ("wrong.tsv", "clean\tcorrupt\tanswer\tdistractor\na\tb\tc\n", ["wrong.tsv:2", "3 fields"]),
        ("pairs.txt", "a b c\n", ["--pairs takes a .jsonl, .csv, .tsv file"]),
        ("number.jsonl", '{"clean": 1, "corrupt": "b", "answer": "c", "distractor": "d"}\n', ["number.jsonl:1", "int"]),
        # a JSON escape of half a character, in any field: not text, as in a corpus (the tokenizer would fail on it)
        (
            "half.jsonl",
            '{"clean": "a", "corrupt": "b", "answer": "c \\ud800", "distractor": "d"}\n',
            ["half.jsonl:1", "lone surrogate"],
        ),
    ],
)
def test_unreadable_pairs_files_are_refused_before_loading(tmp_path, name, text, fragments):
    path = tmp_path / name
    path.write_text(text)
    result = run_cli("patch", "gpt2", "--pairs", path, loader=refuse_to_load)
    assert_one_line_error(result, *fragments, code=result.exit_code)
    assert result.exit_code in (1, 2)


def test_csv_and_tsv_pairs_give_the_jsonl_numbers(reader, pairs, tmp_path):
    frame = pd.DataFrame(READER_PAIRS, columns=["clean", "corrupt", "answer", "distractor"])
    frame.to_csv(tmp_path / "pairs.csv", index=False)
    frame.to_csv(tmp_path / "pairs.tsv", index=False, sep="\t")
    base = headscope.patch(reader, pairs, bootstrap=0).effects["effect"]
    for name in ("pairs.csv", "pairs.tsv"):
        assert headscope.patch(reader, tmp_path / name, bootstrap=0).effects["effect"].equals(base)


@pytest.mark.parametrize(
    ("args", "fragments", "code"),
    [
        (["--heads", "5.0"], ["--heads names 5.0", "layers 0-1"], 2),
        (["--heads", "0.0", "--layers", "1"], ["--heads or --layers, not both"], 2),
        (["--what", "keys"], ["--what"], 2),
        (["--direction", "sideways"], ["--direction"], 2),
        (["--metric", "probability"], ["--metric"], 2),
        (["--max-length", "4"], ["pairs.jsonl:1", "5 tokens, more than --max-length 4"], 1),
    ],
)
def test_bad_requests_are_one_line_errors(reader, pairs, args, fragments, code):
    assert_one_line_error(run_cli("patch", reader, "--pairs", pairs, *args, "--no-charts"), *fragments, code=code)


def test_positions_each_needs_one_length(reader, tmp_path):
    rows = [READER_PAIRS[0], ("w2 w3 w5 w6", "w2 w4 w5 w6", "w3", "w4")]
    pairs = write_reader_pairs(tmp_path / "pairs.jsonl", rows)
    result = run_cli(
        "patch", reader, "--pairs", pairs, "--positions", "each", "--out", tmp_path / "out", loader=refuse_to_load
    )  # the tokenizer alone refuses them: no weights are loaded
    assert_one_line_error(result, "pairs.jsonl:2: 4 tokens, but line 1 has 5", "--positions all")


def test_pairs_without_a_behaviour_are_flagged_and_give_no_effect(reader, tmp_path):
    rows = [("w2 w3 w5", "w2 w3 w5", "w3", "w4"), ("w2 w6 w5", "w2 w6 w5", "w3", "w4")]
    found = headscope.patch(reader, write_reader_pairs(tmp_path / "same.jsonl", rows), bootstrap=10)
    assert all(pair["no_difference"] for pair in found.record["per_pair"])
    assert found.effects["effect"].isna().all() and any("no behaviour" in note for note in found.notes)


def test_patch_shows_its_progress(reader, pairs):
    """One patched run per pair and head: the reporter is told the total and every run."""
    from headscope.progress import NullReporter

    class Counting(NullReporter):
        def __init__(self) -> None:
            self.total, self.done = None, 0

        def start(self, total_sentences: int, what: str = "measuring", unit: str = "sentences") -> None:
            self.total, self.unit = total_sentences, unit

        def advance(self, sentences: int, tokens: int) -> None:
            self.done += sentences

    counting = Counting()
    headscope.patch(reader, pairs, bootstrap=0, reporter=counting)
    assert counting.total == counting.done == 8 * len(READER_PAIRS) and counting.unit == "patched runs"
    fast = Counting()
    headscope.patch(reader, pairs, bootstrap=0, fast=True, reporter=fast)
    assert fast.total == fast.done == 8 * len(READER_PAIRS)


def test_the_pairs_file_is_never_replaced(reader, tmp_path):
    """An output folder that is the pairs file's own folder is refused, whatever --overwrite says."""
    folder = tmp_path / "inputs"
    folder.mkdir()
    pairs = write_reader_pairs(folder / "pairs.jsonl")
    before = snapshot(folder)
    result = run_cli("patch", reader, "--pairs", pairs, "--out", folder, "--overwrite", loader=refuse_to_load)
    assert_one_line_error(result, str(folder))
    assert snapshot(folder) == before


def test_a_half_precision_model_patches_the_same_head(reader, pairs):
    """--dtype reaches the model: in bfloat16 the replacements are cast to the model's dtype, and the copying head
    still carries the whole behaviour (to bfloat16's precision)."""
    found = headscope.patch(reader, pairs, dtype="bfloat16", bootstrap=0)
    assert found.record["dtype"] == "bfloat16"
    effects = found.effects.set_index(["layer", "head"])["effect"]
    assert abs(effects[0, 0] - 1.0) < 0.02 and effects.drop((0, 0)).abs().max() < 0.02


class CharacterTokenizer:
    """One token per character, as a tokenizer that gives a trailing space a token of its own."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in text] for text in texts]}

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_pair_text_is_kept_as_written(tmp_path):
    """A prompt ending in a space keeps that space's token (it used to be stripped: measured one token short), and an
    answer of one space is that one token, not "empty"."""
    from headscope.interventions.pairs import read_pairs, tokenize_pairs

    path = write_reader_pairs(tmp_path / "pairs.jsonl", [("the cat ", "the dog ", " ", "x")])
    pair = read_pairs(path).pairs[0]
    assert (pair.clean, pair.corrupt, pair.answer) == ("the cat ", "the dog ", " ")
    tokenized = tokenize_pairs(read_pairs(path), CharacterTokenizer(), max_length=None)[0]
    assert tokenized.length == len("the cat ") and tokenized.answer_id == ord(" ")
