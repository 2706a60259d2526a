"""A report folder damaged (by hand, a crash of another tool, a bad copy) is refused in one line by every command
that reads it, before any value read from it sizes an array: a layer number of 10**9 once had classify run for
minutes and compare raise MemoryError."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from helpers import (
    assert_one_line_error,
    run_cli,
    snapshot,
)


@pytest.fixture(scope="module")
def report(planted_gpt2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("valid") / "report"
    assert (
        run_cli("analyze", planted_gpt2, "--out", out, "--no-charts", "--no-page", "--probe-seeds", "2").exit_code == 0
    )
    return out


def damage_heads(folder: Path, column: str, value) -> None:
    heads = pd.read_parquet(folder / "heads.parquet")
    heads.loc[0, column] = value
    heads.to_parquet(folder / "heads.parquet")


def damage_run(folder: Path, key: str, value) -> None:
    run = json.loads((folder / "run.json").read_text())
    run["model"]["architecture"][key] = value
    (folder / "run.json").write_text(json.dumps(run))


def truncate(folder: Path, name: str) -> None:
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])


DAMAGES = {
    "a layer of 10**9": (lambda f: damage_heads(f, "layer", 10**9), "lists head 1000000000.0"),
    "a head of 10**9": (lambda f: damage_heads(f, "head", 10**9), "beyond the model's 2 layers x 3 heads"),
    "10**12 layers": (lambda f: damage_run(f, "layers", 10**12), "says the model has 1000000000000 layers"),
    "a bool for heads": (lambda f: damage_run(f, "heads", True), "says the model has True heads"),
    "half a sentence_heads table": (lambda f: truncate(f, "sentence_heads.parquet"), "not a readable Parquet file"),
}
COMMANDS = {
    "classify": lambda damaged, other, out: ["classify", damaged, "--out", out],
    "plot": lambda damaged, other, out: ["plot", damaged, "--out", out, "--no-page", "--format", "svg"],
    "compare": lambda damaged, other, out: ["compare", other, damaged, "--out", out, "--no-charts"],
}


CASES = [(d, c) for d in DAMAGES for c in COMMANDS if c == "compare" or "sentence_heads" not in d]  # only compare
# reads the per-sentence table


@pytest.mark.parametrize(("damage", "command"), CASES)
def test_a_damaged_report_is_refused_in_one_line_at_once(report, tmp_path, damage, command):
    damaged = tmp_path / "damaged"
    shutil.copytree(report, damaged)
    make, fragment = DAMAGES[damage]
    make(damaged)
    before = snapshot(tmp_path)
    started = time.perf_counter()
    result = run_cli(*COMMANDS[command](damaged, report, tmp_path / "out"))
    assert time.perf_counter() - started < 10
    assert_one_line_error(result, fragment)
    assert snapshot(tmp_path) == before


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
