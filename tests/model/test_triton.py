"""headscope's Triton kernel (headscope.model.attention.cuda_kernel): on the CPU under Triton's interpreter, against the
float64 reference and sdpa, as the C++ kernel is tested; on CUDA (`python -m pytest -m cuda`), the same and a real
model's statistics through it.

Triton ships with torch's CUDA builds; the test extras install it on Linux x86-64 for the interpreter. Without it
the interpreter test is skipped with the reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SUPPORT = Path(__file__).resolve().parents[1] / "support"


@pytest.mark.slow
def test_the_triton_kernel_under_the_interpreter_equals_the_reference():
    """Every mask the kernel takes (causal, left padded, sliding window, a mask with holes), grouped KV heads (6 on
    2), softcap, selected rows, statistics alone: each statistic within 1e-5 of float64, the output within 1e-5 of
    sdpa's scale, the top keys equal, and the kernel's first-call check passed (it ran)."""
    pytest.importorskip("triton", reason="Triton is not installed (the test extras install it on Linux x86-64)")
    # CUDA hidden: on a GPU machine the child would otherwise run the compiled kernel (tested below), not this one
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT), *sys.path])}  # fmt: skip
    script = str(SUPPORT / "triton_interpreted.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for case, worst in json.loads(done.stdout.splitlines()[-1]).items():
        assert worst.pop("kernel ran") and worst.pop("top_key"), case
        assert all(math.isfinite(error) and error <= 1e-5 for error in worst.values()), (case, worst)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch sees no CUDA device)")


@pytest.mark.parametrize("softcap", [None, 10.0])
@pytest.mark.parametrize("mask_name", ["causal", "left padded", "sliding window"])
@pytest.mark.cuda
@needs_cuda
def test_the_triton_kernel_on_cuda_equals_the_reference(mask_name, softcap):
    from headscope.model.attention.dispatch import TileKernel

    from attention_cases import assert_matches_reference, assert_same_output, fused, hand_built, masks, sdpa_output

    query, key, value = hand_built(seed=22, t=700)
    mask, visible, seq_start = masks(t=700, window=300)[mask_name]
    kernel = TileKernel(native_from=0)
    on_gpu = [x.cuda() for x in (query, key, value)]
    gpu_mask = None if mask is None else mask.cuda()
    output, values = fused(
        *on_gpu, gpu_mask, seq_start.cuda(), softcap, row_state=kernel.row_state(on_gpu[0], gpu_mask)
    )
    assert kernel.native_runs == 1 and not kernel.failed_kernels, kernel.failed_kernels
    real = visible.any(-1)
    want = sdpa_output(query, key, value, visible, softcap)
    assert_same_output(output.cpu(), want, real, query, key, value, visible, seq_start, softcap)
    on_host = type(values)(**{name: value.cpu() for name, value in values.columns().items()})
    assert_matches_reference(on_host, query, key, value, visible, seq_start, softcap)


@pytest.mark.cuda
@needs_cuda
def test_a_long_text_on_cuda_takes_the_triton_kernel_and_matches_the_eager_path(corpus_lines):
    """SmolLM2 in float32 on the GPU, 700 tokens: the Triton kernel takes every layer past the first, and every
    head's statistics equal the eager weights' to 1e-5."""
    import headscope

    from helpers import assert_same_heads

    loaded = headscope.load_model("smollm2", device="cuda", dtype="float32")
    text = " ".join(corpus_lines)
    options = {"max_length": 700, "sentence_heads": False, "charts": None, "probes": False}
    eager = headscope.analyze(loaded, [text], **options)
    fused = headscope.analyze(loaded, [text], block_bytes=2**20, **options)
    assert "Triton kernel" in fused.run["attention_implementation"]["LlamaAttention"]
    assert_same_heads(fused.heads, eager.heads)
