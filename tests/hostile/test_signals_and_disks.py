"""What the operating system does to a run: a signal before the command's own handlers are in place (while it
imports torch), and a file system that refuses a write (a full disk). Each is one line and an exit code, and
nothing already written changes. Run in a child process: these limits and signals apply to a whole process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import HANG, previous_report, snapshot

pytestmark = pytest.mark.slow  # child processes that import torch


def headscope_child(*args, file_size_limit: int | None = None) -> subprocess.Popen:
    """`python -m headscope ARGS`, with writes past `file_size_limit` bytes refused by the kernel (RLIMIT_FSIZE:
    the file system answers EFBIG, as a full disk answers ENOSPC; Python ignores the SIGXFSZ that comes with it)."""
    import resource

    def limits() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen(
        [sys.executable, "-m", "headscope", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"},
        preexec_fn=limits,
    )


def catches(pid: int, sig: int) -> bool:
    """Has process `pid` installed a handler for `sig` (the SigCgt mask of /proc/PID/status)?"""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_sigterm_while_the_command_imports_torch_is_one_line_and_143(planted_gpt2, tmp_path):
    """SIGTERM the moment headscope's handler is in place: the command is still importing torch (about two
    seconds), before any of its own code runs; it exits 143 with one line, not 1 with a traceback."""
    out = tmp_path / "report"
    previous_report(out)
    before = snapshot(tmp_path)
    child = headscope_child("analyze", planted_gpt2, "--out", out, "--overwrite")
    deadline = time.monotonic() + HANG
    while not catches(child.pid, signal.SIGTERM) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert "torch" not in Path(f"/proc/{child.pid}/maps").read_text()  # torch's libraries are not loaded yet
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=HANG)
    assert child.returncode == 143, stderr
    assert stderr.strip().splitlines() == ["Terminated; existing outputs were left as they were."], stderr
    assert snapshot(tmp_path) == before


LIMIT = 200_000  # bytes: more than prune.json, the curve and the tokenizer files; less than any model's weights


def test_a_full_disk_while_inspect_writes_is_one_line(planted_gpt2, tmp_path):
    """inspect streams every head's attention on a long text into attention.parquet: past the limit the write is
    refused, and the command says so in one line and leaves no work folder (the previous inspection stays)."""
    out = tmp_path / "inspection"
    text = " ".join(["the cat sat on the mat"] * 10)
    first = headscope_child("inspect", planted_gpt2, "--text", "the cat", "--out", out)
    assert first.wait(timeout=HANG) == 0, first.stderr.read()
    before = snapshot(tmp_path)
    child = headscope_child("inspect", planted_gpt2, "--text", text, "--out", out, "--overwrite",
                            file_size_limit=20_000)  # fmt: skip
    _, stderr = child.communicate(timeout=HANG)
    assert child.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1].startswith(f"Error: cannot write {out}"), stderr
    assert "File too large" in stderr and "Traceback" not in stderr
    assert snapshot(tmp_path) == before


def test_a_full_disk_while_prune_saves_the_model_keeps_the_search(tmp_path):
    """The pruned checkpoint does not fit: prune.json and the mask are still published (the search is verified
    and took the time), prune.json says the save failed, and no half-written model folder is left."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers import tiny_model_folder

    words = [f"w{i}" for i in range(40)]
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64)
    model = tiny_model_folder(tmp_path / "gpt2", config, GPT2LMHeadModel, [" ".join(words)])
    assert (model / "model.safetensors").stat().st_size > LIMIT
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[i : i + 8]) for i in range(0, 32, 4)) + "\n")
    out, saved = tmp_path / "prune", tmp_path / "pruned-model"
    child = headscope_child("prune", model, "--corpus", corpus, "--budget", "0.05", "--mode", "zero", "--out", out,
                            "--save-model", saved, "--no-charts", file_size_limit=LIMIT)  # fmt: skip
    _, stderr = child.communicate(timeout=HANG)
    assert child.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Error: the pruned model was not saved") and "File too large" in last, stderr
    assert f"were written to {out}" in last and "Traceback" not in stderr
    # the page (plotly.js inside) is over the limit too: said, and left out, and the search is still published
    assert "could not write prune.html" in stderr and not (out / "prune.html").exists()
    record = json.loads((out / "prune.json").read_text())
    assert "File too large" in record["saved_model"]["error"] and (out / "head_mask.parquet").is_file()
    assert not saved.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


PAGE_COMMANDS = {  # a command, its page, its record, and its arguments after the model (planted induction LM)
    "analyze": ("report.html", "run.json", ("--no-probes", "--bootstrap", "0", "--no-charts")),
    "inspect": ("inspect.html", "inspect.json", ("--text", "w5 w9 w12 w5 w9", "--heads", "1.0")),
    "circuit": ("circuit.html", "circuit.json", ("--verify", "0", "--no-curve", "--no-charts", "--bootstrap", "0")),
    "prune": ("prune.html", "prune.json", ("--budget", "0.05", "--mode", "zero", "--no-charts", "--max-rounds", "1")),
}


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(PAGE_COMMANDS))
def test_a_page_that_cannot_be_written_never_loses_the_result(command, tmp_path):
    """Every page carries plotly.js (about 4.5 MB); a disk too full for it (here a file-size limit under it) costs
    the page alone, said in a warning: the command succeeds and publishes its tables and record."""
    from planted import build_planted_induction

    model = build_planted_induction(tmp_path / "induction-lm", predicts=True)
    page, record, arguments = PAGE_COMMANDS[command]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w5 w9 w12 w5 w9 w12\nw7 w9 w12 w7 w9 w12\n", encoding="utf-8")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"clean": "w5 w9 w12 w5", "corrupt": "w7 w9 w12 w5", "answer": "w9",
                                 "distractor": "w12"}) + "\n")  # fmt: skip
    inputs = ("--pairs", pairs) if command == "circuit" else ("--corpus", corpus) if command != "inspect" else ()
    out = tmp_path / "out"
    child = headscope_child(command, model, *inputs, *arguments, "--out", out, file_size_limit=LIMIT)
    _, stderr = child.communicate(timeout=HANG)
    assert child.returncode == 0, stderr
    said = f"could not draw {page} (" if command == "analyze" else f"could not write {page} ("  # analyze: with charts
    assert said in stderr and "File too large" in stderr and "Traceback" not in stderr
    assert (out / record).is_file() and not (out / page).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-written beside it
