"""Float32 products in float32: no TensorFloat-32 inside headscope's passes.

On Ampere and later NVIDIA GPUs, PyTorch runs float32 matrix products in TF32 (10 bits of mantissa) once anything in
the process asks for it (`torch.set_float32_matmul_precision("high")`, `torch.backends.cuda.matmul.allow_tf32 = True`
or the newer `fp32_precision = "tf32"`; notebooks and training code often do). Measured on an H200 (2026-11-27): a
512 x 512 float32 product of standard normals is off by 2.8e-4 of its largest entry under "high" against 3.3e-7 under
"highest"; a logit of 8 then carries some 2e-3 of error. headscope's numbers are defined in float32
(docs/measures.md), so every attached pass switches products to IEEE float32 for its length and gives the process
its setting back after.

The setting is process-wide: several threads' calls (on several models) share one switch, taken by the first call
in and given back by the last out. bfloat16 and float16 models are unaffected (their products never were float32).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

import torch

_log = logging.getLogger(__name__)
_GUARD = threading.Lock()
_holders = 0
_restore = None  # how to give the process its setting back, while some call holds the switch

# cuBLAS reads this when torch creates its handle, and then uses TF32 whatever the flags say.
FORCING_VARIABLE = "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"


def tf32_forced() -> bool:
    """Does the environment force TF32 on cuBLAS whatever headscope asks (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1)?"""
    return os.environ.get(FORCING_VARIABLE, "0") not in ("", "0")


def _switch_to_ieee():
    """Ask for IEEE float32 products through whichever of torch's two interfaces the process used (mixing them is an
    error in torch >= 2.9); return how to undo it."""
    matmul = torch.backends.cuda.matmul
    try:
        previous = torch.get_float32_matmul_precision()
    except RuntimeError:  # the process set `fp32_precision` (the new interface): keep to it
        before = matmul.fp32_precision
        matmul.fp32_precision = "ieee"
        return lambda: setattr(matmul, "fp32_precision", before)
    torch.set_float32_matmul_precision("highest")
    return lambda: torch.set_float32_matmul_precision(previous)


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matrix products in IEEE float32 for the block's length (see the module's docstring)."""
    global _holders, _restore
    with _GUARD:
        if _holders == 0:
            _restore = _switch_to_ieee()
            if tf32_forced() and torch.cuda.is_available():
                _log.warning(
                    "%s is set: cuBLAS runs float32 products in TF32 whatever headscope asks, so float32 "
                    "numbers on this GPU carry about 1e-3 of error; unset it for exact ones",
                    FORCING_VARIABLE,
                )
        _holders += 1
    try:
        yield
    finally:
        with _GUARD:
            _holders -= 1
            if _holders == 0:
                _restore()
                _restore = None
