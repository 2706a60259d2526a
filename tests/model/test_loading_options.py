"""--revision and --trust-remote-code reach transformers' own loading, proven by what they change: a revision
picks another snapshot of a hub repository (from a hub cache built here, offline), and remote code is the only
way a model of an unknown type loads. In a child process: the hub cache and the modules cache are read from the
environment when transformers is first imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from helpers import HANG
from planted import build_planted_gpt2

pytestmark = pytest.mark.slow  # child processes that import torch

REPO = "headscope-test/tiny"
COMMITS = {"main": "a" * 40, "other": "b" * 40}
QUICK = ["--no-probes", "--bootstrap", "0", "--no-charts", "--no-page"]


def headscope_child(tmp_path: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_MODULES_CACHE": str(tmp_path / "modules")}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "headscope", *map(str, args)], capture_output=True, text=True,
                          env=env, check=False, timeout=HANG)  # fmt: skip
    return done


@pytest.fixture
def hub(tmp_path, corpus_lines) -> Path:
    """A hub cache holding REPO at two revisions whose weights differ (planted scores 4 and 8)."""
    repo = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    for (branch, commit), beta in zip(COMMITS.items(), (4.0, 8.0), strict=True):
        build_planted_gpt2(repo / "snapshots" / commit, corpus_lines, beta=beta)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    return repo


def test_a_revision_reaches_the_hub_download(hub, tmp_path):
    entropies = {}
    for branch in COMMITS:
        out = tmp_path / branch
        done = headscope_child(tmp_path, "analyze", REPO, "--revision", branch, "--out", out, *QUICK)
        assert done.returncode == 0, done.stderr
        assert json.loads((out / "run.json").read_text())["model"]["revision"] in (branch, COMMITS[branch])
        entropies[branch] = pd.read_parquet(out / "heads.parquet")["entropy"].to_numpy()
    assert not (entropies["main"] == entropies["other"]).all()  # another snapshot's weights were measured
    done = headscope_child(tmp_path, "analyze", REPO, "--out", tmp_path / "default", *QUICK)
    assert (pd.read_parquet(tmp_path / "default" / "heads.parquet")["entropy"].to_numpy() == entropies["main"]).all()


CUSTOM = """from transformers import GPT2Config, GPT2Model


class CustomConfig(GPT2Config):
    model_type = "headscope-custom"


class CustomModel(GPT2Model):
    config_class = CustomConfig
"""


def test_remote_code_runs_only_when_trusted(planted_gpt2, tmp_path):
    """A model type transformers does not know, whose code ships in its folder: refused in one line without
    --trust-remote-code, measured with it (the same numbers as the planted GPT-2 it wraps)."""
    folder = tmp_path / "custom"
    shutil.copytree(planted_gpt2, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "headscope-custom", "architectures": ["CustomModel"],
               "auto_map": {"AutoConfig": "custom.CustomConfig", "AutoModel": "custom.CustomModel",
                            "AutoModelForCausalLM": "custom.CustomLM"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(CUSTOM)
    refused = headscope_child(tmp_path, "analyze", folder, "--out", tmp_path / "refused", *QUICK)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("Error: "), refused.stderr
    assert "runs only with --trust-remote-code" in refused.stderr
    trusted = headscope_child(tmp_path, "analyze", folder, "--trust-remote-code", "--out", tmp_path / "t", *QUICK)
    assert trusted.returncode == 0, trusted.stderr
    plain = headscope_child(tmp_path, "analyze", planted_gpt2, "--out", tmp_path / "plain", *QUICK)
    assert plain.returncode == 0, plain.stderr
    measured = [pd.read_parquet(tmp_path / name / "heads.parquet")["entropy"] for name in ("t", "plain")]
    pd.testing.assert_series_equal(*measured)
