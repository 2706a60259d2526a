"""The same numbers on CUDA: run with `python -m pytest -m cuda` on a machine with an NVIDIA GPU.

Skipped (with the reason) where torch sees no CUDA device; CI has none. Float32 on the GPU must equal the
CPU's float32 run within float32 rounding; bfloat16 must keep every head's type and stay within bfloat16's
resolution; batch size and the block-wise path change nothing on the GPU either.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headscope
from headscope.model.loading import load_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch sees no CUDA device)"),
]
METRICS = ("entropy", "norm_entropy", "diagonal", "sink", "prev_token", "max_weight", "sink_rate")
OPTIONS = {"probes": False, "bootstrap": 0, "charts": None, "page": False}
TINY_BLOCKS = 4096  # bytes: forces the block-wise path


def assert_heads_close(got, expected, atol):
    got, expected = got.sort_values(["layer", "head"]), expected.sort_values(["layer", "head"])
    for name in METRICS:
        np.testing.assert_allclose(got[name].to_numpy(), expected[name].to_numpy(), atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def planted_on_cpu(planted_gpt2, corpus_lines):
    return headscope.analyze(str(planted_gpt2), corpus_lines, device="cpu", dtype="float32", **OPTIONS)


def test_auto_picks_cuda(planted_gpt2):
    assert load_model(str(planted_gpt2)).device.type == "cuda"


def test_planted_gpt2_float32_on_cuda_equals_the_cpu(planted_gpt2, corpus_lines, planted_on_cpu):
    on_gpu = headscope.analyze(str(planted_gpt2), corpus_lines, device="cuda", dtype="float32", **OPTIONS)
    assert on_gpu.run["device"].startswith("cuda")
    assert_heads_close(on_gpu.heads, planted_on_cpu.heads, atol=1e-5)
    assert on_gpu.heads["head_type"].tolist() == planted_on_cpu.heads["head_type"].tolist()


def test_planted_gpt2_bfloat16_keeps_every_head_type(planted_gpt2, corpus_lines, planted_on_cpu):
    on_gpu = headscope.analyze(str(planted_gpt2), corpus_lines, device="cuda", dtype="bfloat16", **OPTIONS)
    assert on_gpu.run["dtype"] == "bfloat16"
    assert_heads_close(on_gpu.heads, planted_on_cpu.heads, atol=2e-2)  # bfloat16 keeps 8 bits of mantissa
    assert on_gpu.heads["head_type"].tolist() == planted_on_cpu.heads["head_type"].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_size_and_the_blockwise_path_change_nothing_on_cuda(planted_gpt2, corpus_lines, dtype):
    options = {**OPTIONS, "device": "cuda", "dtype": dtype}
    one = headscope.analyze(str(planted_gpt2), corpus_lines, batch_size=1, **options)
    many = headscope.analyze(str(planted_gpt2), corpus_lines, batch_size=32, **options)
    blocks = headscope.analyze(str(planted_gpt2), corpus_lines, block_bytes=TINY_BLOCKS, batch_size=7, **options)
    assert_heads_close(many.heads, one.heads, atol=1e-6 if dtype == "float32" else 1e-2)
    assert_heads_close(blocks.heads, one.heads, atol=1e-5 if dtype == "float32" else 2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_on_cuda_against_the_cpu(smollm2, shipped_corpus, dtype):
    on_cpu = headscope.analyze(smollm2, shipped_corpus, **OPTIONS)
    on_gpu_model = load_model("smollm2", device="cuda", dtype=dtype, lm_head=True)  # as the fixture: the dormant
    # check runs on both (without the LM head it cannot, and an unverified dormant head keeps its label)
    on_gpu = headscope.analyze(on_gpu_model, shipped_corpus, batch_size=16, **OPTIONS)
    assert_heads_close(on_gpu.heads, on_cpu.heads, atol=1e-4 if dtype == "float32" else 3e-2)
    if dtype == "float32":
        assert on_gpu.heads["role"].tolist() == on_cpu.heads["role"].tolist()


# ---------------------------------------------------------------- interventions on the GPU

INTERVENTION_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # nats; bfloat16 keeps 8 bits of mantissa


@pytest.fixture(scope="module")
def copier(planted_copier):
    """The planted copier (heads 0.0 and 0.1 carry the next token: removing both costs nats) and its texts."""
    from planted import copied_sentences

    return str(planted_copier), copied_sentences(24)


def on(device: str, dtype: str, folder: str):
    return load_model(folder, device=device, dtype=dtype, lm_head=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ablate_on_cuda_equals_the_cpu(copier, dtype):
    folder, texts = copier
    groups = {"heads": [[(0, 0), (0, 1)], [(1, 2)]], "bootstrap": 0}
    for mode in ("zero", "mean"):
        cpu = headscope.ablate(on("cpu", "float32", folder), texts, mode=mode, **groups).groups
        gpu = headscope.ablate(on("cuda", dtype, folder), texts, mode=mode, **groups).groups
        for column in ("clean_loss", "ablated_loss", "delta"):
            np.testing.assert_allclose(gpu[column], cpu[column], atol=INTERVENTION_TOLERANCE[dtype], err_msg=column)
        assert cpu["delta"][0] > 1.0  # the copiers matter: a removal the GPU ignored would show


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prune_on_cuda_finds_what_the_cpu_finds(copier, dtype):
    folder, texts = copier
    cpu = headscope.prune(on("cpu", "float32", folder), texts, budget=0.01, mode="zero")
    gpu = headscope.prune(on("cuda", dtype, folder), texts, budget=0.01, mode="zero")
    assert len(gpu.result.heads) == len(cpu.result.heads) == 7  # every head but one of the two copiers
    assert gpu.result.loss - gpu.result.clean_loss <= 0.01
    if dtype == "float32":
        assert gpu.result.heads == cpu.result.heads
        assert gpu.result.loss == pytest.approx(cpu.result.loss, abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_importance_on_cuda_equals_the_cpu(copier, dtype):
    folder, texts = copier
    options = {"importance": "exact", "charts": None, "page": False, "probes": False, "bootstrap": 0}
    cpu = headscope.analyze(on("cpu", "float32", folder), texts, **options).heads
    gpu = headscope.analyze(on("cuda", dtype, folder), texts, **options).heads
    for column in ("ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean"):
        scale = max(1.0, float(np.abs(cpu[column]).max()))
        np.testing.assert_allclose(gpu[column], cpu[column], atol=INTERVENTION_TOLERANCE[dtype] * scale, err_msg=column)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inspect_on_cuda_equals_the_cpu(copier, dtype):
    folder, texts = copier
    heads = [(0, 0), (1, 2)]
    cpu = headscope.inspect(load_model(folder, device="cpu", dtype="float32"), texts=texts[:3], heads=heads).attention
    gpu = headscope.inspect(load_model(folder, device="cuda", dtype=dtype), texts=texts[:3], heads=heads).attention
    assert len(gpu) == len(cpu)
    np.testing.assert_allclose(gpu["weight"], cpu["weight"], atol=1e-5 if dtype == "float32" else 2e-2)
