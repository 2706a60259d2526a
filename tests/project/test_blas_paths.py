"""The numeric tests under another of MKL's sgemm code paths, so that a tolerance holding on this machine's BLAS
only fails here, not on a user's: MKL picks its AVX2 sgemm on some CPUs and its AVX-512 one on others, and the last
bits of every float32 product differ between them (FINDINGS: a 1e-5 tolerance held on AVX2 and failed on AVX-512).
MKL_CBWR=COMPATIBLE runs MKL's most conservative path on any x86 CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The tests that compare float32 computations with float64 references or with each other.
NUMERIC = (
    "measures/test_fused.py",
    "model/test_native.py",
    "measures/test_metrics.py",
    "measures/test_writes.py",
    "model/test_fast_path.py",
    "measures/test_layer_attention.py",
    "interventions/test_dormant.py",
    "measures/test_kernel_sums.py",
)


@pytest.mark.slow
@pytest.mark.parametrize("code_path", ["COMPATIBLE"])
def test_the_numeric_tests_hold_under_another_sgemm(code_path):
    here = Path(__file__).resolve().parents[1]  # tests/
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *NUMERIC],
        cwd=here,
        env={**os.environ, "MKL_CBWR": code_path, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
