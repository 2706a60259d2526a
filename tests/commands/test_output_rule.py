"""One rule for every command that writes a folder: it writes only into an empty or missing folder, replaces
(with --overwrite) only a headscope folder of its own kind, and deletes nothing it cannot prove it made.
Every case goes through the CLI, and every byte of the user's files is checked after it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from headscope.registry import commands

from helpers import (
    HANG,
    Interrupting,
    assert_one_line_error,
    hidden_leftovers,
    refuse_to_load,
    run_cli,
    snapshot,
)

QUICK = ("--no-probes", "--bootstrap", "0")


@pytest.fixture(scope="module")
def folders(planted_gpt2, tmp_path_factory, corpus_lines) -> dict[str, Path]:
    """A report, a comparison and a folder of charts drawn with plot --out, made once."""
    root = tmp_path_factory.mktemp("kinds")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:12]) + "\n")
    report, comparison, charts = root / "report", root / "comparison", root / "charts"
    assert run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", report, *QUICK).exit_code == 0
    assert run_cli("compare", report, report, "--out", comparison, "--replicates", "20").exit_code == 0
    assert run_cli("plot", report, "--out", charts).exit_code == 0
    words = [word for line in corpus_lines for word in line.split() if word.isalpha()][:6]
    pairs = root / "pairs.jsonl"
    row = {"clean": " ".join(words[:4]), "corrupt": " ".join([words[4], *words[1:4]]), "answer": words[0],
           "distractor": words[4]}  # fmt: skip
    pairs.write_text(json.dumps(row) + "\n" + json.dumps(row | {"clean": row["corrupt"], "corrupt": row["clean"]}))
    return {"report": report, "comparison": comparison, "charts": charts, "corpus": corpus, "pairs": pairs}


def users_folder(path: Path) -> Path:
    """A user's folder holding files named like headscope's own (report.html, a chart) and one of their own."""
    path.mkdir(parents=True)
    (path / "report.html").write_text("<p>my own page</p>")
    (path / "entropy_heatmap.png").write_bytes(b"my own picture")
    (path / "notes.md").write_text("my notes\n")
    return path


def command(name: str, folders: dict[str, Path], planted: Path, out: Path, overwrite: bool) -> list:
    flag = ["--overwrite"] if overwrite else []
    report = folders["report"]
    return {
        "analyze": ["analyze", planted, "--corpus", folders["corpus"], "--out", out, *QUICK, "--no-charts", *flag],
        "compare": ["compare", report, report, "--out", out, "--replicates", "20", "--no-charts", *flag],
        "plot --out": ["plot", report, "--out", out, "--no-page", *flag],
        "classify --out": ["classify", report, "--out", out, *flag],
    }[name]


WRITES = {"analyze": "report", "compare": "comparison", "plot --out": "charts", "classify --out": "report"}


@pytest.mark.slow  # every command into six kinds of folder, 72 CLI runs
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("state", ["missing", "empty", "users", "report", "comparison", "charts"])
@pytest.mark.parametrize("name", list(WRITES))
def test_one_rule_for_every_command_that_writes(name, state, overwrite, folders, planted_gpt2, tmp_path):
    out = tmp_path / "out"
    if state == "empty":
        out.mkdir()
    elif state == "users":
        users_folder(out)
    elif state in ("report", "comparison", "charts"):
        shutil.copytree(folders[state], out)
    before = snapshot(tmp_path)
    result = run_cli(*command(name, folders, planted_gpt2, out, overwrite))
    same_kind = state == WRITES[name]
    if state in ("missing", "empty") or (same_kind and overwrite):
        assert result.exit_code == 0, result.output
        assert (
            out / {"report": "run.json", "comparison": "compare.json", "charts": "plot.json"}[WRITES[name]]
        ).is_file()
    else:
        reason = "pass --overwrite to replace it" if same_kind else "is not a headscope"
        assert_one_line_error(result, reason)
        assert snapshot(tmp_path) == before  # every byte of every file as it was
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder left


@pytest.mark.slow  # over 1.5 s on two cores
def test_a_users_look_alike_folders_beside_the_output_survive(planted_gpt2, folders, tmp_path):
    """Only work folders whose marker proves headscope made them for this output are cleaned up; a user's
    .rep.old-20240101/, a bare .rep.staging-123/ and a sibling that a glob of "rep*" would match all survive."""
    mine = {
        ".rep.old-20240101": "a backup",
        ".rep.staging-123": "not ours: no marker",
        ".rep.partial": "a user's partial notes",
        ".repX.staging-1": "another name: rep* must not widen",
    }
    for name, text in mine.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "keep.txt").write_text(text)
    before = snapshot(tmp_path)
    for out in (tmp_path / "rep", tmp_path / "rep*"):
        result = run_cli("analyze", planted_gpt2, "--corpus", folders["corpus"], "--out", out, *QUICK, "--no-charts")
        assert result.exit_code == 0, result.output
        assert "note: removed" not in result.output
    assert {k: v for k, v in snapshot(tmp_path).items() if k.startswith(".")} == before


@pytest.mark.slow  # four commands through the CLI
@pytest.mark.parametrize("command", ["analyze", "prune", "patch", "ablate"])
def test_a_killed_runs_marked_work_folder_is_removed_and_said(command, planted_gpt2, folders, tmp_path):
    """A staging folder with headscope's marker, whose process is gone, is removed by the next run into the same
    output (and only that one), and every command says so."""
    stale = tmp_path / f".rep.staging-{os.getpid() + 100000}"
    stale.mkdir()
    (stale / ".headscope-work").write_text(json.dumps({"target": "rep", "pid": os.getpid() + 100000}))
    (stale / "heads.parquet").write_bytes(b"half written")
    asked = {"analyze": ["--corpus", folders["corpus"], *QUICK], "prune": ["--corpus", folders["corpus"], "--budget",
             "0.05", "--no-charts"], "patch": ["--pairs", folders["pairs"], "--bootstrap", "0", "--no-charts"],
             "ablate": ["--corpus", folders["corpus"], "--heads", "0.0", "--bootstrap", "0"]}[command]  # fmt: skip
    result = run_cli(command, planted_gpt2, *asked, "--out", tmp_path / "rep")
    assert result.exit_code == 0, result.output
    assert not stale.exists() and f"removed {stale}, left behind by an interrupted run" in result.output


@pytest.mark.slow  # the module's report, comparison and charts: 4 s to make
def test_compare_overwrite_replaces_only_a_comparison(folders, tmp_path):
    report = tmp_path / "a-report"
    shutil.copytree(folders["report"], report)
    before = snapshot(report)
    result = run_cli("compare", folders["report"], folders["report"], "--out", report, "--overwrite", "--no-charts")
    assert_one_line_error(result, "it holds a headscope report, and this command writes a headscope comparison")
    assert snapshot(report) == before


@pytest.mark.slow  # over 1.5 s on two cores
def test_plot_in_place_and_classify_in_place_rewrite_only_their_own_files(folders, tmp_path):
    """Without --out, plot and classify write into the report itself: only the files they write change, and a
    user's notes kept in the report folder are left alone."""
    report = tmp_path / "report"
    shutil.copytree(folders["report"], report)
    (report / "notes.md").write_text("my notes\n")
    assert run_cli("plot", report, "--no-page").exit_code == 0
    assert run_cli("classify", report, "--role-probe-min", "0.9").exit_code == 0
    assert (report / "notes.md").read_text() == "my notes\n"


@pytest.mark.slow  # the module's report, comparison and charts: 4 s to make
def test_a_work_folder_in_the_way_that_headscope_did_not_make_is_refused(planted_gpt2, folders, tmp_path):
    """--resume uses a fixed work folder name (.OUT.partial): a user's folder of that name is not taken over."""
    (tmp_path / ".rep.partial").mkdir()
    (tmp_path / ".rep.partial" / "mine.txt").write_text("mine")
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", folders["corpus"], "--out", tmp_path / "rep", "--resume", *QUICK
    )
    assert_one_line_error(result, "is in the way and headscope did not make it")
    assert (tmp_path / ".rep.partial" / "mine.txt").read_text() == "mine"


# ---------------------------------------------------------------- a checkpoint belongs to its run


@pytest.fixture
def checkpointed(planted_gpt2, tmp_path, corpus_lines):
    """`analyze --resume --chunk-sentences 5 --out shared` on 15 sentences, Ctrl-C after its first checkpoint."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:15]) + "\n")
    out = tmp_path / "shared"
    args = ("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume", "--chunk-sentences", "5", *QUICK)
    result = run_cli(*args, "--no-charts", reporter=Interrupting(after=5))
    assert result.exit_code == 130, result.output
    checkpoint = tmp_path / ".shared.partial"
    assert json.loads((checkpoint / "checkpoint.json").read_text())["progress"]["chunks_done"] == 1
    return args, out, checkpoint


@pytest.mark.slow  # an interrupted run, then every command
def test_no_other_command_removes_a_checkpoint(checkpointed, folders, planted_gpt2):
    """Every other command (and analyze without --resume) that wants the checkpoint's folder name says what is
    there and stops; the checkpoint is byte for byte as it was, and --resume then finishes from it."""
    args, out, checkpoint = checkpointed
    report = folders["report"]
    others = {
        "analyze": ["analyze", planted_gpt2, "--out", out, *QUICK, "--no-charts"],
        "ablate": ["ablate", planted_gpt2, "--heads", "0.0", "--out", out, "--bootstrap", "0"],
        "prune": ["prune", planted_gpt2, "--budget", "0.1", "--out", out, "--no-charts"],
        "prune --resume": ["prune", planted_gpt2, "--budget", "0.1", "--out", out, "--no-charts", "--resume"],
        "patch": ["patch", planted_gpt2, "--pairs", folders["pairs"], "--out", out, "--no-charts"],
        "inspect": ["inspect", planted_gpt2, "--text", "the cat", "--out", out, "--no-page"],
        "classify --out": ["classify", report, "--out", out],
        "compare --out": ["compare", report, report, "--out", out, "--replicates", "20", "--no-charts"],
        "plot --out": ["plot", report, "--out", out, "--no-page"],
    }
    before = snapshot(checkpoint)
    for name, command in others.items():
        result = run_cli(*command, loader=refuse_to_load)
        assert_one_line_error(result, str(checkpoint), "interrupted `headscope analyze` run")
        assert snapshot(checkpoint) == before, name
        assert not out.exists(), name
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    assert not checkpoint.exists() and (out / "run.json").is_file()


# ---------------------------------------------------------------- interrupted publishing


def interrupt_when_writing(monkeypatch, wanted) -> None:
    """Ctrl-C the moment a file whose name `wanted(name)` accepts is about to be put in place (every file
    headscope writes goes through os.replace, from its temporary name)."""
    real = os.replace

    def replace(source, destination, *args, **kwargs):
        if wanted(Path(destination).name):
            raise KeyboardInterrupt
        return real(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


DRAWN = (".png", ".svg", ".pdf", ".html")


@pytest.mark.slow  # nine commands run to their charts or page
@pytest.mark.parametrize(
    "name", ["analyze", "compare", "plot --out", "plot", "classify", "classify --out", "inspect", "prune", "patch"]
)
def test_an_interrupted_command_leaves_the_previous_output_whole(name, folders, planted_gpt2, tmp_path, monkeypatch):
    """Ctrl-C while a command draws its charts or page (classify: while it writes run.json) over an existing
    output, with --overwrite: exit 130 and the previous output is byte for byte as it was, with no work folder
    left beside it. (Before, analyze and compare published their tables first and lost the old charts.)"""
    report, corpus = folders["report"], folders["corpus"]
    out = tmp_path / "out"
    commands = {
        "analyze": ["analyze", planted_gpt2, "--corpus", corpus, "--out", out, *QUICK, "--overwrite"],
        "compare": ["compare", report, report, "--out", out, "--replicates", "20", "--overwrite"],
        "plot --out": ["plot", report, "--out", out, "--overwrite"],
        "plot": ["plot", out],
        "classify": ["classify", out, "--role-probe-min", "0.9"],
        "classify --out": ["classify", report, "--out", out, "--role-probe-min", "0.9", "--overwrite"],
        "inspect": ["inspect", planted_gpt2, "--text", "the cat sat", "--out", out, "--overwrite"],
        "prune": ["prune", planted_gpt2, "--corpus", corpus, "--budget", "0.05", "--out", out, "--overwrite"],
        "patch": ["patch", planted_gpt2, "--pairs", folders["pairs"], "--out", out, "--overwrite", "--bootstrap", "0"],
    }
    first = {"plot": ["analyze", planted_gpt2, "--corpus", corpus, "--out", out, *QUICK],
             "classify": ["analyze", planted_gpt2, "--corpus", corpus, "--out", out, *QUICK]}  # fmt: skip
    assert run_cli(*first.get(name, commands[name])).exit_code == 0
    before = snapshot(tmp_path)
    wanted = (lambda file: file == "run.json") if name.startswith("classify") else (lambda file: file.endswith(DRAWN))
    interrupt_when_writing(monkeypatch, wanted)
    result = run_cli(*commands[name])
    assert result.exit_code == 130, result.output
    assert "existing outputs were left as they were" in result.stderr
    kept = tmp_path / ".out.partial"  # every prune keeps its search's journal: --resume finishes the drawing
    assert snapshot(tmp_path, skip=(kept,) if name == "prune" else ()) == before
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert left == ([kept.name] if name == "prune" else [])
    if name == "prune":
        assert (kept / "prune-journal.json").is_file() and "--resume continues it" in result.stderr


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
        ("/", "is the root of the file system"),
    ],
)
def test_unusable_output_paths_are_refused_before_loading(
    planted_gpt2, folders, tmp_path, no_model_loading, make, message
):
    out = tmp_path / "out"
    if isinstance(make, str):  # a path as it is
        target = Path(make)
    else:
        make(out)
        target = out if out.exists() else Path("/proc/headscope-cannot-write-here")
    assert_one_line_error(no_model_loading("analyze", planted_gpt2, "--out", target), message)
    assert_one_line_error(run_cli("plot", folders["report"], "--out", target), message)  # and every other writer


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
    finished = [(run.wait(timeout=HANG), run.stderr.read()) for run in runs]
    codes = sorted(code for code, _ in finished)
    assert codes == [0, 1], finished
    loser = next(err for code, err in finished if code == 1).strip()
    assert loser.startswith("Error: ") and "\n" not in loser and ("another" in loser or "filled" in loser), loser
    winner = corpora[[code for code, _ in finished].index(0)]
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["path"] == str(winner)
    assert len(pd.read_parquet(out / "sentences.parquet")) == 2000
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.slow  # a child process
def test_a_killed_runs_staging_folder_is_cleaned_by_the_next_run(planted_gpt2, tmp_path, corpus_lines):
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n".join(corpus_lines * 200) + "\n")
    out = tmp_path / "report"
    process = headscope_process("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts")
    deadline = time.monotonic() + HANG
    while not hidden_leftovers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=HANG)
    assert hidden_leftovers(tmp_path) == [f".report.staging-{process.pid}"]
    small = tmp_path / "small.txt"
    small.write_text("\n".join(corpus_lines[:10]) + "\n")
    result = run_cli("analyze", planted_gpt2, "--corpus", small, "--out", out, "--no-charts")
    assert result.exit_code == 0, result.output
    assert f"removed {tmp_path / f'.report.staging-{process.pid}'}" in result.stderr
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.slow  # analyze with every chart
def test_a_chart_that_fails_leaves_the_report_and_says_what_was_not_drawn(planted_gpt2, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    real = Figure.savefig

    def failing(self, path, *args, **kwargs):  # the example chart cannot be drawn, as a renderer bug would
        if "examples" in str(path):
            raise RuntimeError("renderer exploded")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", failing)
    out = tmp_path / "report"
    result = run_cli("analyze", planted_gpt2, "--out", out, *QUICK)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: could not draw")]
    assert len(warnings) == 1 and "examples.png (RuntimeError: renderer exploded)" in warnings[0]
    assert {"heads.parquet", "run.json", "report.html", "entropy_heatmap.png"} <= {p.name for p in out.iterdir()}
    assert not (out / "examples.png").exists() and hidden_leftovers(tmp_path) == []
    monkeypatch.undo()
    assert run_cli("plot", out).exit_code == 0 and (out / "examples.png").is_file()  # plot draws it again


@pytest.mark.slow  # every model command that writes a folder through the CLI, every output on
@pytest.mark.parametrize("name", [entry.name for entry in commands() if entry.library and entry.kind])
def test_a_folder_each_command_writes_is_one_its_own_overwrite_replaces(name, folders, planted_gpt2, tmp_path):
    """Every file a command writes, charts and page included, is one its kind names: otherwise --overwrite refuses
    the command's own folder as "not a headscope ..." (circuit.html once was)."""
    from headscope.output import kind_of, why_not_replaceable

    asked = {
        "analyze": ["--corpus", folders["corpus"], *QUICK],
        "inspect": ["--text", "the cat sat on the mat"],
        "ablate": ["--corpus", folders["corpus"], "--heads", "0.0", "--bootstrap", "0"],
        "patch": ["--pairs", folders["pairs"], "--bootstrap", "0"],
        "prune": ["--corpus", folders["corpus"], "--budget", "0.5", "--mode", "window", "--max-rounds", "1"],
        "circuit": ["--pairs", folders["pairs"], "--steps", "2"],
    }[name]
    out = tmp_path / "out"
    assert run_cli(name, planted_gpt2, *asked, "--out", out).exit_code == 0
    kind = kind_of(out)
    assert kind is not None and why_not_replaceable(out, kind) is None
    again = run_cli(name, planted_gpt2, *asked, "--out", out, "--overwrite")
    assert again.exit_code == 0, again.output
