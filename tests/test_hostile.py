"""Every case a hostile user found (issue 8), through the CLI: no hangs, no tracebacks, no silent wrong
output, and nothing deleted or overwritten that headscope did not write."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer

from headscope.cli import app
from headscope.config import RunConfig

from helpers import (
    Interrupting,
    assert_one_line_error,
    hidden_leftovers,
    refuse_to_load,
    run_cli,
    run_measuring_script,
    snapshot,
    tiny_llama,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def corpus(tmp_path, corpus_lines) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus_lines[:20]) + "\n")
    return path


@pytest.fixture
def no_model_loading():
    """`headscope ARGS` with a loader that fails the test: the check under test must come before the weights."""
    return lambda *args: run_cli(*args, loader=refuse_to_load)


# ---------------------------------------------------------------- hangs


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


# ---------------------------------------------------------------- memory


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


# ---------------------------------------------------------------- never delete what is not ours


def test_the_model_folder_is_never_an_output_folder(planted_gpt2, tmp_path, no_model_loading):
    before = snapshot(planted_gpt2)
    assert_one_line_error(
        no_model_loading("analyze", planted_gpt2, "--out", planted_gpt2, "--overwrite"), "holds the model"
    )
    assert snapshot(planted_gpt2) == before


def test_overwrite_replaces_only_a_headscope_report(planted_gpt2, tmp_path, no_model_loading):
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("The cat sat.\n")
    (data / "notes.md").write_text("my notes\n")
    before = snapshot(data)
    assert_one_line_error(
        no_model_loading("analyze", planted_gpt2, "--corpus", data / "corpus.txt", "--out", data, "--overwrite"),
        "holds the corpus",
    )
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.md").write_text("my notes\n")
    assert_one_line_error(
        no_model_loading("analyze", planted_gpt2, "--out", other, "--overwrite"),
        "is not a headscope report",
        "notes.md",
    )
    assert snapshot(data) == before and (other / "notes.md").read_text() == "my notes\n"


def test_the_current_folder_is_refused_before_any_work(planted_gpt2, tmp_path, monkeypatch, no_model_loading):
    empty = tmp_path / "here"
    empty.mkdir()
    monkeypatch.chdir(empty)
    assert_one_line_error(no_model_loading("analyze", planted_gpt2, "--out", "."), "is the current folder")
    assert_one_line_error(no_model_loading("analyze", planted_gpt2, "--out", ".."), "is the current folder or holds it")
    assert list(empty.iterdir()) == []


def test_a_symlinked_output_folder_is_followed(planted_gpt2, corpus, tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    for extra in ((), ("--overwrite",)):  # a new report, then a replaced one
        result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", link, "--no-charts", *extra)
        assert result.exit_code == 0, result.output
        assert link.is_symlink() and (target / "heads.parquet").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "link", "real"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_text("a file"), "exists and is not a folder"),
        (lambda p: None, "cannot create the output folder"),
    ],
)
def test_unusable_output_paths_are_refused_before_loading(planted_gpt2, tmp_path, no_model_loading, make, message):
    out = tmp_path / "out"
    make(out)
    target = out if out.exists() else Path("/proc/headscope-cannot-write-here")
    assert_one_line_error(no_model_loading("analyze", planted_gpt2, "--out", target), message)


def headscope_process(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "headscope", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.slow  # a child process
def test_two_runs_into_one_folder_cannot_both_win(planted_gpt2, tmp_path, corpus_lines):
    corpora = []
    for name, lines in (("a", corpus_lines[:50]), ("b", corpus_lines[50:])):
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(lines * 40) + "\n")  # 2,000 sentences: a few seconds each
        corpora.append(path)
    out = tmp_path / "report"
    runs = [headscope_process("analyze", planted_gpt2, "--corpus", c, "--out", out, "--no-charts") for c in corpora]
    finished = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
    codes = sorted(code for code, _ in finished)
    assert codes == [0, 1], finished
    loser = next(err for code, err in finished if code == 1).strip()
    assert loser.startswith("Error: ") and "\n" not in loser and ("another" in loser or "filled" in loser), loser
    winner = corpora[[code for code, _ in finished].index(0)]
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["path"] == str(winner)
    assert len(pd.read_parquet(out / "sentences.parquet")) == 2000
    assert hidden_leftovers(tmp_path) == []


# ---------------------------------------------------------------- silent wrong output


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


@pytest.fixture
def interrupted(planted_gpt2, tmp_path, corpus_lines):
    """A --resume run over three chunks (8,200 sentences), interrupted (Ctrl-C) in the third."""
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n".join(corpus_lines * 82) + "\n")
    out = tmp_path / "report"
    ctrl_c = Interrupting(after=2 * RunConfig().chunk_sentences)
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume", "--no-charts", reporter=ctrl_c
    )
    assert result.exit_code == 130, result.output
    checkpoint = tmp_path / ".report.partial"
    assert json.loads((checkpoint / "checkpoint.json").read_text())["progress"]["chunks_done"] == 2
    return corpus, out, checkpoint


def test_a_checkpoint_with_a_part_missing_is_refused(planted_gpt2, interrupted):
    corpus, out, checkpoint = interrupted
    (checkpoint / "sentences.part-000001.parquet").unlink()
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume"),
        "is incomplete (sentences.part-000001.parquet is missing)",
    )
    assert not out.exists()


def test_a_checkpoint_planned_for_another_model_is_refused(planted_gpt2, interrupted):
    """The checkpoint keeps the resolved plan; a resume that resolves another one (here: the checkpoint says the
    model was 24 layers deep) is refused, not continued with sums of another shape or meaning."""
    corpus, out, checkpoint = interrupted
    record = json.loads((checkpoint / "checkpoint.json").read_text())
    record["plan"]["depth"] = 24
    (checkpoint / "checkpoint.json").write_text(json.dumps(record))
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume"),
        "was planned differently (depth: the model changed?)",
    )
    assert not out.exists()


def test_a_resumed_run_records_the_batching_it_used(planted_gpt2, interrupted):
    corpus, out, _ = interrupted
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume", "--batch-size", "7", "--no-charts"
    )
    assert result.exit_code == 0, result.output
    assert "resuming with the interrupted run's batching (--batch-size auto" in result.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["batch_size"] is None and run["batching"]["max_sentences"] == 256
    assert len(pd.read_parquet(out / "sentences.parquet")) == 8200


# ---------------------------------------------------------------- tracebacks


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


@pytest.fixture(scope="module")
def finished_report(planted_gpt2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "report"
    assert run_cli("analyze", planted_gpt2, "--out", out, "--no-charts").exit_code == 0
    return out


def test_classify_and_plot_refuse_a_heads_table_without_rows(finished_report, tmp_path):
    import shutil

    report = tmp_path / "report"
    shutil.copytree(finished_report, report)
    pq.write_table(pq.read_table(report / "heads.parquet").slice(0, 0), report / "heads.parquet")
    for command in ("classify", "plot"):
        assert_one_line_error(run_cli(command, report), "heads.parquet has no rows")


# ---------------------------------------------------------------- leftovers


@pytest.mark.slow  # a child process
def test_a_killed_runs_staging_folder_is_cleaned_by_the_next_run(planted_gpt2, tmp_path, corpus_lines):
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n".join(corpus_lines * 200) + "\n")
    out = tmp_path / "report"
    process = headscope_process("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts")
    deadline = time.monotonic() + 60
    while not hidden_leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert hidden_leftovers(tmp_path) == [f".report.staging-{process.pid}"]
    small = tmp_path / "small.txt"
    small.write_text("\n".join(corpus_lines[:10]) + "\n")
    result = run_cli("analyze", planted_gpt2, "--corpus", small, "--out", out, "--no-charts")
    assert result.exit_code == 0, result.output
    assert f"removed {tmp_path / f'.report.staging-{process.pid}'}" in result.stderr
    assert hidden_leftovers(tmp_path) == []


def test_a_checkpoint_belongs_to_the_run_that_wrote_it(planted_gpt2, interrupted):
    """Only the same command with --resume continues (and then consumes) a checkpoint: a run without --resume is
    refused, saying what is there, and the checkpoint is left for --resume."""
    corpus, out, checkpoint = interrupted
    before = snapshot(checkpoint)
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts")
    assert_one_line_error(result, str(checkpoint), "interrupted `headscope analyze --resume` run", "delete that folder")
    assert snapshot(checkpoint) == before and not out.exists()
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts", "--resume")
    assert result.exit_code == 0, result.output
    assert not checkpoint.exists() and hidden_leftovers(out.parent) == []


# ---------------------------------------------------------------- docs and messages


def cli_options() -> set[str]:
    command = typer.main.get_command(app)
    options = {"--help"}  # every command has it; it is not among the declared parameters
    for sub in command.commands.values():
        for param in sub.params:
            options.update(param.opts + param.secondary_opts)
    return options


FOREIGN_OPTIONS = {"--no-deps", "--nproc-per-node", "--nnodes", "--rdzv-"}  # pip's and torchrun's


def test_every_option_the_readme_mentions_exists():
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", (REPO / "README.md").read_text()))
    unknown = mentioned - cli_options() - FOREIGN_OPTIONS
    assert not unknown, f"README mentions options no command has: {sorted(unknown)}"


@pytest.mark.parametrize(
    "args",
    [
        ["analyze", "gpt2", "--window", "two"],
        ["analyze", "gpt2", "--no-such-option"],
        ["analyze"],
        ["no-such-command"],
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(args):
    assert_one_line_error(run_cli(*args), "--help", code=2)


@pytest.mark.slow
def test_tokens_that_split_a_character_are_labelled_with_their_bytes(smollm2):
    import headscope

    result = headscope.analyze(smollm2, ["I love 🍕 and 日本語 a lot."], sentence_heads=False, charts=None)
    labels = result.examples.drop_duplicates("query").sort_values("query")["query_token"].tolist()
    assert "\ufffd" not in "".join(labels)
    assert labels[2:5] == ["\\xf0\\x9f", "\\x8d", "\\x95"]  # 🍕 is F0 9F 8D 95, split over three tokens
    assert "本" in labels
