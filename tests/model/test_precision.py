"""Float32 products stay IEEE float32 inside headscope's passes, whatever the process asked for (TF32 products on an
H200 were off by 2.8e-4 relative, against 3.3e-7 in IEEE float32), and the process gets its setting back.

The flags are process-wide and readable without a GPU, so this runs on every machine; the GPU's numbers themselves are
checked by the tests marked `cuda`.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import headscope
from headscope.model.precision import ieee_float32
from headscope.progress import NullReporter


class PrecisionSeen(NullReporter):
    """Records the float32 product precision each time the pass reports progress (that is, mid-pass)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def advance(self, sentences: int, tokens: int) -> None:
        self.seen.append(torch.get_float32_matmul_precision())


def test_a_pass_runs_ieee_float32_and_gives_the_process_its_tf32_back(planted_gpt2, corpus_lines):
    seen = PrecisionSeen()
    torch.set_float32_matmul_precision("high")  # TF32, as a notebook or a training script may leave it
    try:
        headscope.analyze(str(planted_gpt2), corpus_lines[:20], probes=False, bootstrap=0, charts=None, page=False,
                          reporter=seen)  # fmt: skip
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen.seen and set(seen.seen) == {"highest"}
    assert after == "high"


def test_overlapping_calls_share_one_switch_and_the_last_out_restores():
    torch.set_float32_matmul_precision("high")
    try:
        inside, release = threading.Event(), threading.Event()

        def other_call():
            with ieee_float32():
                inside.set()
                release.wait(10)

        thread = threading.Thread(target=other_call)
        thread.start()
        inside.wait(10)
        with ieee_float32():
            assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_float32_matmul_precision() == "highest"  # the other call is still inside
        release.set()
        thread.join(10)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")


@pytest.mark.slow  # over 1.5 s on two cores
def test_a_process_on_the_new_interface_keeps_to_it():
    """torch >= 2.9 refuses to read the old interface once `fp32_precision` was set: the switch must use the new one
    (run apart: the state it leaves would trip later tests)."""
    script = (
        "import torch\n"
        "from headscope.model.precision import ieee_float32\n"
        "matmul = torch.backends.cuda.matmul\n"
        "matmul.fp32_precision = 'tf32'\n"
        "with ieee_float32():\n"
        "    assert matmul.fp32_precision == 'ieee', matmul.fp32_precision\n"
        "assert matmul.fp32_precision == 'tf32', matmul.fp32_precision\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
