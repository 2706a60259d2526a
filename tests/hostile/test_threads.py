"""Threads: headscope calls from several threads at once, on model paths (loading is serialised: transformers'
is not thread-safe) and on one shared model (calls on it take turns), give what one call alone gives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest

import headscope
from headscope.errors import ConfigError
from headscope.model.capture import attached

QUICK = {"probes": False, "bootstrap": 0, "sentence_heads": False, "check_dormant": False}


def numbers(report) -> pd.DataFrame:
    return report.heads.select_dtypes("number")


@pytest.mark.slow  # over 1.5 s on two cores
def test_threads_loading_models_at_once_all_finish(planted_gpt2, corpus_lines):
    alone = headscope.analyze(str(planted_gpt2), corpus_lines[:6], **QUICK)
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: headscope.analyze(str(planted_gpt2), corpus_lines[:6], **QUICK), range(4)))
    for report in found:
        pd.testing.assert_frame_equal(numbers(report), numbers(alone))
    again = headscope.analyze(str(planted_gpt2), corpus_lines[:6], **QUICK)  # the process is not left broken
    pd.testing.assert_frame_equal(numbers(again), numbers(alone))


def test_threads_sharing_one_model_take_turns(planted_gpt2, corpus_lines):
    loaded = headscope.load_model(str(planted_gpt2), device="cpu", lm_head=True)
    texts = [corpus_lines[i : i + 5] for i in range(4)]
    alone = [headscope.analyze(loaded, chosen, **QUICK) for chosen in texts]
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda chosen: headscope.analyze(loaded, chosen, **QUICK), texts))
    for got, want in zip(found, alone, strict=True):
        pd.testing.assert_frame_equal(numbers(got), numbers(want))


def test_a_call_inside_a_call_on_the_same_model_is_one_line(planted_gpt2, corpus_lines):
    loaded = headscope.load_model(str(planted_gpt2), device="cpu")
    with attached(loaded.model), pytest.raises(ConfigError, match="already in use by a headscope call in this thread"):
        headscope.analyze(loaded, corpus_lines[:2], **QUICK)


def test_a_load_names_a_gguf_files_tensors_once_per_architecture():
    """transformers builds gguf's tensor-name map once per module of the model it loads (395 times for SmolLM2,
    13 s of its load); within one load the same architecture gives the same map, and the load's end drops it."""
    gguf = pytest.importorskip("gguf")
    from headscope.model.once import one_load

    arch = gguf.MODEL_ARCH.LLAMA
    with one_load():
        first = gguf.get_tensor_name_map(arch, 30)
        assert gguf.get_tensor_name_map(arch, 30) is first
        assert gguf.get_tensor_name_map(arch, 2) is not first
        assert first.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert gguf.get_tensor_name_map(arch, 30) is not first
