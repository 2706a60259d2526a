"""Helpers for driving the CLI in tests and checking what it left behind."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from typer.testing import CliRunner

from headscope.cli import app
from headscope.measures.statistics import AttentionStatistics
from headscope.progress import NullReporter

runner = CliRunner()


def run_cli(*args, **seams):
    """`headscope ARGS`; seams (a `loader` or a `reporter`, as `headscope.analyze` takes them) reach analyze."""
    return runner.invoke(app, [str(a) for a in args], obj=seams or None)


LOG_LINE = re.compile(r"\d\d:\d\d:\d\d |note: |warning: ")


def assert_one_line_error(result, *fragments: str, code: int = 1) -> str:
    """The command failed with exit `code`, one line `Error: ...` holding every fragment, and no traceback. Off a
    terminal the log lines of the stages before it (time-stamped, or notes) may precede it."""
    assert result.exit_code == code, result.output
    *log, message = result.stderr.strip().splitlines() or [""]
    assert message.startswith("Error: "), result.stderr
    assert all(LOG_LINE.match(line) for line in log), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in message, message
    return message


def hidden_leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def previous_report(folder: Path) -> Path:
    """A stand-in for an earlier report: files headscope writes and a run.json that says headscope wrote it."""
    folder.mkdir()
    (folder / "run.json").write_text('{"schema_version": 1}')
    (folder / "heads.parquet").write_bytes(b"the previous run")
    return folder


def snapshot(folder: Path, *, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int, bytes]]:
    """Every file under `folder` (outside `skip`) with its size, modification time and first bytes."""
    state = {}
    for path in sorted(folder.rglob("*")):
        if any(path == s or s in path.parents for s in skip) or not path.is_file():
            continue
        stat = path.stat()
        state[str(path.relative_to(folder))] = (stat.st_size, stat.st_mtime_ns, path.read_bytes()[:64])
    return state


def tiny_model_folder(folder: Path, config, model_class, corpus_lines: list[str], adjust: Callable | None = None):
    """Save a random model of `model_class` built from `config`, with a word-level tokenizer of the corpus's
    words, into `folder`; `adjust(model)` may hand-set weights before it is saved."""
    import torch

    from planted import build_tokenizer

    tokenizer = build_tokenizer([w for line in corpus_lines for w in line.split()])
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = model_class(config)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Interrupting(NullReporter):
    """A progress reporter that presses Ctrl-C (raises KeyboardInterrupt) as soon as more than `after` sentences
    are measured: with `after` = two chunks, on the first batch of the third."""

    def __init__(self, after: int) -> None:
        self.after, self.done = after, 0

    def advance(self, sentences: int, tokens: int) -> None:
        self.done += sentences
        if self.done > self.after:
            raise KeyboardInterrupt


def refuse_to_load(source, settings, model_config, lm_head):
    """A loader that fails the test: the check under test must come before the weights load."""
    raise AssertionError("the model was loaded before the bad option was refused")


def tiny_lm_config(kind: str, layers: int, **gemma2):
    """(config, LM class) of a tiny GPT-2 (biases, a fused q|k|v projection, learned positions), grouped-KV Llama
    (RoPE, 8 query heads on 4 KV heads) or grouped-KV Gemma 2 (post-attention and post-MLP norms, (1 + w) RMS norms,
    a sliding window of 4; `gemma2`: its softcaps), with weights ten times the default's spread: scores of order 1,
    where an error shows against rounding."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        return GPT2Config(n_layer=layers, n_embd=32, n_head=4, initializer_range=0.2), GPT2LMHeadModel
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 8,
             "num_key_value_heads": 4, "initializer_range": 0.2}  # fmt: skip
    if kind == "gemma2":
        config = Gemma2Config(**shape, head_dim=8, query_pre_attn_scalar=8, sliding_window=4, **gemma2)
        return config, Gemma2ForCausalLM
    return LlamaConfig(**shape), LlamaForCausalLM


def tiny_llama(folder: Path, corpus_lines: list[str]) -> Path:
    """A 2-layer Llama (standard eager attention, 8 heads on 4 KV heads) that takes 8,192 positions."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    return tiny_model_folder(folder, config, LlamaModel, corpus_lines)


def run_measuring_script(script: str, *args) -> dict:
    """Run `script` (which prints one JSON line last) in a fresh Python, offline, so that its ru_maxrss is its own;
    return that line."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=False,
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# How long a test waits for a child process before calling it hung: a guard against hangs, never a speed limit. A child
# that imports torch and loads a model took 120 s on a loaded two-core machine where it takes 10 alone.
HANG = 600  # seconds


QUICK = ("--no-probes", "--bootstrap", "0")  # analyze's cheapest complete run, for tests about something else


def gpt2_folder(path: Path, lines: list[str], **config) -> Path:
    """A tiny random GPT-2 (2 layers of 2 heads) with a word-level tokenizer of `lines`' words."""
    from transformers import GPT2Config, GPT2Model

    options = {"n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 64, **config}
    return tiny_model_folder(path, GPT2Config(**options), GPT2Model, lines)


# ---------------------------------------------------------------- heads compared, measures built

# The per-head columns two paths (eager and fused, kernel and torch) must agree on.
METRICS = ("entropy", "entropy_std", "norm_entropy", "diagonal", "diagonal_uniform", "sink", "prev_token", "max_weight")
METRICS += ("logit_std", "write_norm", "write_ratio", "sink_value_ratio", "active_rows", "offsink_prev_token")
METRICS += ("offsink_norm_entropy",)


def assert_same_heads(got, expected, names=METRICS, atol=1e-5):
    got, expected = got.sort_values(["layer", "head"]), expected.sort_values(["layer", "head"])
    assert got["layer"].tolist() == expected["layer"].tolist()
    for name in names:
        np.testing.assert_allclose(got[name].to_numpy(), expected[name].to_numpy(), atol=atol, err_msg=name)


def statistics() -> AttentionStatistics:
    return AttentionStatistics(window=2, sink_threshold=0.3, accum_dtype=torch.float64)


# ---------------------------------------------------------------- exemplars compared across batchings

# How far one row's exemplar score may move when it is computed in a batch of another shape (or on another attention
# path): float32 rounding of the model's own activations, which differ by up to 5.5e-6 of a row between batch shapes
# (docs/tests.md), and of the score's own sum.
EXEMPLAR_RTOL, EXEMPLAR_ATOL = 1e-5, 1e-6


def assert_same_exemplars(a, b, rtol: float = EXEMPLAR_RTOL, atol: float = EXEMPLAR_ATOL) -> None:
    """Two exemplars tables of one corpus computed with other batches (or paths) agree as docs/exemplars.md
    guarantees: rank by rank the same scores within float32 rounding (so rows that trade ranks are tied within it);
    a row kept in one table and not in the other tied within that rounding with the other's weakest kept row (a
    border tie, as a repeated sentence makes); and a row kept in both with the same key."""
    group = ["layer", "head", "kind"]
    a, b = (frame.sort_values([*group, "rank"], ignore_index=True) for frame in (a, b))
    pd.testing.assert_frame_equal(a[[*group, "rank"]], b[[*group, "rank"]], check_dtype=False)
    np.testing.assert_allclose(b["score"], a["score"], rtol=rtol, atol=atol)
    for keys, mine in a.groupby(group, observed=True):
        other = b.loc[mine.index]
        for one, two in ((mine, other), (other, mine)):
            both = one.merge(two, on=["sentence", "row"], suffixes=("", "_other"))
            assert (both["key"] == both["key_other"]).all(), f"{keys}: a row kept in both names two keys"
            alone = one[~one.set_index(["sentence", "row"]).index.isin(both.set_index(["sentence", "row"]).index)]
            weakest = two["score"].iloc[-1]  # the row's own score moves by the rounding, and the tie by as much again
            assert np.isclose(alone["score"], weakest, rtol=2 * rtol, atol=2 * atol).all(), (
                f"{keys}: rows kept by one table alone are not tied with the other's weakest: "
                f"{alone[['rank', 'sentence', 'row', 'score']].to_dict('records')} against {weakest}"
            )
