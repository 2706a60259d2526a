"""Data parallel: `torchrun --nproc-per-node 2 -m headscope analyze` on the CPU (gloo) against one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import HANG, LOG_LINE

TABLES = ("heads", "layers", "sentences", "sentence_heads", "examples", "probes", "exemplars")
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
pytestmark = [
    pytest.mark.skipif(TORCHRUN is None, reason="torchrun (installed with torch) not found"),
    pytest.mark.slow,  # spawns torchrun
]

# Loaded at start-up (sitecustomize) on rank 1 only when HEADSCOPE_TEST_FAIL_AT is set: the default loader
# hands back a model whose Nth forward pass fails, as a device error would. Test-only: nothing in headscope
# knows about it.
FAULT = """
import json
import os
if os.environ.get("RANK") == "1" and os.environ.get("HEADSCOPE_TEST_FAIL_AT"):
    import headscope.model.loading as loading
    real, calls = loading.load_for_run, [0]
    def fail_at_nth(module, args):
        calls[0] += 1
        if calls[0] == int(os.environ["HEADSCOPE_TEST_FAIL_AT"]):
            raise RuntimeError("injected device failure")
    def failing_loader(*args, **kwargs):
        loaded = real(*args, **kwargs)
        loaded.model.register_forward_pre_hook(fail_at_nth)
        return loaded
    loading.load_for_run = failing_loader
"""


def analyze(model: Path, out: Path, *extra: str, ranks: int = 1, env: dict | None = None):
    # One thread per process in both runs: float32 reductions then add up in the same order everywhere,
    # so the two runs can be compared exactly (torchrun sets OMP_NUM_THREADS=1 for its workers too).
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    options = ["--out", str(out), "--chunk-sentences", "7", "--no-charts", "--no-page", "--probe-seeds", "2", *extra]
    if ranks == 1:
        command = [sys.executable, "-m", "headscope", "analyze", str(model), *options]
    else:
        command = [TORCHRUN, f"--nproc-per-node={ranks}", "-m", "headscope", "analyze", str(model), *options]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=HANG)


def assert_same_tables(a: Path, b: Path) -> None:
    for name in TABLES:
        left, right = pd.read_parquet(a / f"{name}.parquet"), pd.read_parquet(b / f"{name}.parquet")
        assert list(left.columns) == list(right.columns) and len(left) == len(right), name
        numbers = left.select_dtypes("number").columns
        np.testing.assert_allclose(
            right[numbers].to_numpy(float), left[numbers].to_numpy(float), rtol=1e-12, atol=0, err_msg=name
        )
        others = [c for c in left.columns if c not in numbers]
        pd.testing.assert_frame_equal(left[others], right[others], obj=name)


@pytest.fixture(scope="module")
def one_process(planted_gpt2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "report"
    result = analyze(planted_gpt2, out)
    assert result.returncode == 0, result.stderr
    return out


def test_two_ranks_on_gloo_equal_one_process(planted_gpt2, one_process, tmp_path):
    out = tmp_path / "report"
    result = analyze(planted_gpt2, out, ranks=2)
    assert result.returncode == 0, result.stderr
    assert_same_tables(one_process, out)
    assert result.stdout.count("mean attention entropy per layer") == 1  # one summary: rank 0 speaks
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"{t}.parquet" for t in TABLES), "run.json"])
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging or checkpoint left


def test_a_failure_on_one_rank_stops_both_with_one_message_and_resume_continues(planted_gpt2, one_process, tmp_path):
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAULT)
    out = tmp_path / "report"
    env = {"PYTHONPATH": str(fault), "HEADSCOPE_TEST_FAIL_AT": "4"}
    failed = analyze(planted_gpt2, out, "--resume", ranks=2, env=env)
    assert failed.returncode != 0
    ours = [line for line in failed.stderr.splitlines() if line.startswith("Error:")]
    assert ours == ["Error: rank 1 of 2 failed: RuntimeError: injected device failure"]
    assert not out.exists()  # nothing published; the checkpoint waits in the staging folder

    # The chunks were dealt among 2 ranks: another count is one line (here one process, which, like a third rank,
    # finds no checkpoint of its own, only the others'), never a collective that waits or a gloo traceback.
    other = analyze(planted_gpt2, out, "--resume", ranks=1)
    assert other.returncode == 1, other.stderr
    *log, message = other.stderr.strip().splitlines()  # off a terminal, the stages before it are log lines
    assert all(LOG_LINE.match(line) for line in log), other.stderr
    assert message.startswith("Error: the checkpoint in") and "was written by 2 process(es), and this run has 1" in (
        message
    )
    assert "--nproc-per-node 2" in other.stderr

    resumed = analyze(planted_gpt2, out, "--resume", ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    assert_same_tables(one_process, out)


def test_what_a_data_parallel_run_cannot_do_is_refused_once(planted_gpt2, tmp_path):
    result = analyze(planted_gpt2, tmp_path / "report", "--device-map", "auto", ranks=2)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert ours == [
        "Error: --device-map spreads one model over the devices; it cannot be combined with torchrun "
        "(see headscope analyze --help)"
    ]


def test_a_refusal_on_rank_0_stops_every_rank_at_once(planted_gpt2, one_process):
    """An existing report without --overwrite: every rank refuses before any of them waits for the others."""
    started = time.perf_counter()
    result = analyze(planted_gpt2, one_process, ranks=2)
    assert time.perf_counter() - started < 60  # rank 1 used to wait in a broadcast until torchrun killed it
    ours = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.returncode != 0 and ours == [
        f"Error: output folder {one_process} holds a headscope report; pass --overwrite to replace it"
    ]


# ---------------------------------------------------------------- interventions across ranks


def command(*args: str, ranks: int = 1, env: dict | None = None):
    """`headscope ARGS` in one process or under torchrun, one thread per process (as `analyze` above)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    launcher = [sys.executable, "-m"] if ranks == 1 else [TORCHRUN, f"--nproc-per-node={ranks}", "-m"]
    return subprocess.run([*launcher, "headscope", *map(str, args)], capture_output=True, text=True,
                          env=environment, timeout=HANG)  # fmt: skip


def published(folder: Path, record: str) -> dict:
    """A record as written, less what differs between any two runs (when, how long)."""
    data = json.loads((folder / record).read_text())
    data.pop("created"), data.pop("seconds", None)
    return data


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    """The planted copier (its heads 0.0 and 0.1 carry the next token) and a corpus of 40 repeated words: sentences
    of 3 to 8 tokens, in several batches of different lengths with --max-memory 2MiB, dealt to both ranks."""
    from planted import build_planted_copier, copy_words

    folder = tmp_path_factory.mktemp("copier")
    model = build_planted_copier(folder / "model", copiers=(0, 1), logit=20.0)
    words = copy_words()
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join([words[i % 7]] * (3 + i % 6)) for i in range(40)) + "\n")
    return model, corpus


def test_ablate_and_prune_on_two_ranks_equal_one_process(copier, tmp_path):
    mode = "mean"  # the mode with a pass of its own (the means, all-reduced) before the removals
    model, corpus = copier
    common = ["--corpus", corpus, "--mode", mode, "--max-memory", "2MiB"]  # several batches, dealt to both ranks
    ablate = ["ablate", model, "--heads", "0.0,0.1", "--heads", "1.2", *common, "--bootstrap", "200"]
    prune = ["prune", model, "--budget", "0.01", *common, "--no-charts"]
    # window mode: each rank computes its layers' attention again under the window
    windowed = ["ablate", model, "--heads", "0.0,0.1", "--corpus", corpus, "--mode", "window", "--window", "1",
                "--sink", "0", "--max-memory", "2MiB", "--bootstrap", "50"]  # fmt: skip
    for name, args, record in (("ablate", ablate, "ablation.json"), ("prune", prune, "prune.json"),
                               ("windowed", windowed, "ablation.json")):  # fmt: skip
        one_out, two_out = tmp_path / f"one-{name}", tmp_path / f"two-{name}"
        one = command(*args, "--out", one_out)
        two = command(*args, "--out", two_out, ranks=2)
        assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
        assert published(two_out, record) == published(one_out, record)
        assert sorted(p.name for p in two_out.iterdir()) == sorted(p.name for p in one_out.iterdir())
        assert two.stdout.replace("two-", "one-") == one.stdout  # one summary: rank 0 speaks
    assert published(tmp_path / "one-ablate", "ablation.json")["planned"]["forwards"] >= 6  # 3 batches at least
    removed = published(tmp_path / "two-prune", "prune.json")["heads"]
    assert len(removed) == 7 and ("0.0" in removed) != ("0.1" in removed)  # every head but one of the copiers


def test_importance_on_two_ranks_equals_one_process(copier, tmp_path):
    model, corpus = copier
    args = ["analyze", model, "--corpus", corpus, "--importance", "exact", "--max-memory", "2MiB", "--no-charts",
            "--no-page", "--no-probes", "--bootstrap", "50"]  # fmt: skip
    one = command(*args, "--out", tmp_path / "one")
    two = command(*args, "--out", tmp_path / "two", ranks=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    importance = ["ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean"]
    left, right = (pd.read_parquet(tmp_path / name / "heads.parquet") for name in ("one", "two"))
    np.testing.assert_allclose(right[importance].to_numpy(float), left[importance].to_numpy(float), rtol=1e-12)
    runs = [json.loads((tmp_path / name / "run.json").read_text()) for name in ("one", "two")]
    assert runs[1]["importance"]["roles"] == runs[0]["importance"]["roles"] != []  # each role removed together
    tokens = [run["importance"]["predicted_tokens"] for run in runs]
    assert tokens[0] == tokens[1] == sum(3 + i % 6 - 1 for i in range(40))  # every sentence, whichever rank ran it


def test_a_failure_on_one_rank_stops_prune_on_both_with_one_message(copier, tmp_path):
    model, corpus = copier
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAULT)
    env = {"PYTHONPATH": str(fault), "HEADSCOPE_TEST_FAIL_AT": "6"}  # rank 1's sixth forward pass fails
    args = ["prune", model, "--budget", "0.01", "--corpus", corpus, "--max-memory", "2MiB", "--no-charts"]
    failed = command(*args, "--out", tmp_path / "p", ranks=2, env=env)
    assert failed.returncode != 0
    ours = [line for line in failed.stderr.splitlines() if line.startswith("Error:")]
    assert ours == ["Error: rank 1 of 2 failed: RuntimeError: injected device failure"]
    assert not (tmp_path / "p").exists()


# Loaded at start-up (sitecustomize) on rank 1: its command line is edited as a launcher script gone wrong would give
# it (HEADSCOPE_TEST_RANK1 holds "OLD=NEW" replacements of its arguments). Test-only.
SKEW = """
import os
import sys
if os.environ.get("RANK") == "1" and os.environ.get("HEADSCOPE_TEST_RANK1"):
    for change in os.environ["HEADSCOPE_TEST_RANK1"].split(";"):
        old, new = change.split("=", 1)
        sys.argv = [new if argument == old else argument for argument in sys.argv]
"""


@pytest.mark.parametrize(
    ("args", "skew", "named"),
    [
        (["ablate", "{model}", "--corpus", "{corpus}", "--heads", "0.0", "--mode", "zero"], "0.0=0.1", "groups"),
        (["ablate", "{model}", "--corpus", "{corpus}", "--heads", "0.0", "--mode", "zero"], "zero=mean", "mode"),
        (["prune", "{model}", "--corpus", "{corpus}", "--budget", "0.05"], "0.05=0.5", "budget"),
        (["prune", "{model}", "--corpus", "{corpus}", "--budget", "0.05"], "{corpus}={other}", "corpus"),
    ],
    ids=["heads", "mode", "budget", "corpus"],
)
def test_ranks_started_with_different_requests_stop_in_one_line(copier, tmp_path, args, skew, named):
    """Every rank agrees on the command, its settings and request, and its inputs' fingerprints before any work:
    a rank asked something else stops every rank with one line naming what differs (it used to give wrong numbers
    with exit 0, hang, or a numpy traceback)."""
    model, corpus = copier
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text().replace("w2", "w3"))  # as many sentences, other words
    site = tmp_path / "skew"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SKEW)
    names = {"model": model, "corpus": corpus, "other": other}
    filled = [a.format(**names) for a in args]
    env = {"PYTHONPATH": str(site), "HEADSCOPE_TEST_RANK1": skew.format(**names)}
    result = command(*filled, "--out", tmp_path / "out", ranks=2, env=env)
    ours = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.returncode != 0 and len(ours) == 1, result.stderr  # every rank stops; rank 0 speaks for them
    assert "the ranks were not started alike: rank 1 has " in ours[0] and named in ours[0], ours
    assert not (tmp_path / "out").exists()


def test_patch_under_torchrun_is_refused_before_any_work(copier, tmp_path):
    from planted import write_reader_pairs

    model, _ = copier
    pairs = write_reader_pairs(tmp_path / "pairs.jsonl")
    result = command("patch", model, "--pairs", pairs, "--out", tmp_path / "out", ranks=2)
    ours = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert result.returncode != 0 and ours == [
        "Error: patch runs in one process (it does not split its work between ranks): run it without torchrun "
        "(see headscope patch --help)"
    ], result.stderr
    assert not (tmp_path / "out").exists()


def test_circuit_on_two_ranks_equals_one_process(tmp_path):
    """torchrun deals the pairs to the ranks (pair i to rank i % 2) and gathers every pair's scores and patched
    passes: the tables and the record are one process's. Five pairs of two lengths: the ranks' batches differ from
    one process's, so the float32 sums may round apart (the batching test's bound); the ranks, the circuit and the
    strings are equal."""
    from planted import build_planted_induction

    model = build_planted_induction(tmp_path / "model", predicts=True)
    rows = [("w5 w9 w12 w20 w5", "w7 w9 w12 w20 w5", "w9", "w12"), ("w3 w4 w6 w3", "w2 w4 w6 w3", "w4", "w6"),
            ("w8 w10 w11 w14 w8", "w15 w10 w11 w14 w8", "w10", "w11"), ("w6 w2 w9 w6", "w4 w2 w9 w6", "w2", "w9"),
            ("w12 w13 w5 w12", "w16 w13 w5 w12", "w13", "w5")]  # fmt: skip
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(dict(zip(("clean", "corrupt", "answer", "distractor"), row, strict=True)))
                             + "\n" for row in rows))  # fmt: skip
    args = ["circuit", model, "--pairs", pairs, "--steps", "2", "--verify", "3", "--bootstrap", "50", "--no-charts"]
    one = command(*args, "--out", tmp_path / "one")
    two = command(*args, "--out", tmp_path / "two", ranks=2)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    for table in ("edges", "nodes"):
        left, right = (pd.read_parquet(tmp_path / run / f"{table}.parquet") for run in ("one", "two"))
        numbers = [c for c in left.select_dtypes("number").columns if c != "rank"]
        np.testing.assert_allclose(right[numbers].to_numpy(float), left[numbers].to_numpy(float), rtol=1e-5,
                                   atol=1e-6, err_msg=table)  # fmt: skip
        others = [c for c in left.columns if c not in numbers]
        pd.testing.assert_frame_equal(left[others], right[others], obj=table)
    records = [published(tmp_path / run, "circuit.json") for run in ("one", "two")]
    assert records[0]["pairs"] == records[1]["pairs"] and records[0]["pairs"]["count"] == 5
    assert records[0]["circuit"]["edges"] == records[1]["circuit"]["edges"]
    np.testing.assert_allclose([p["clean"] for p in records[1]["m"]["per_pair"]],
                               [p["clean"] for p in records[0]["m"]["per_pair"]], rtol=1e-6)  # fmt: skip
