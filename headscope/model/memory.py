"""How much fits: free device memory and per-token activation estimates. Imports torch only to ask a GPU, so
commands that read reports can check their own memory needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_AUTO_SENTENCES = 256  # more sentences per batch gain nothing measurable on CPU or GPU at these lengths


def free_memory(device: torch.device) -> int:
    """Bytes free on `device` now: CUDA's own count, or what the host has available."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_free_memory()


def host_free_memory() -> int:
    """MemAvailable of the host, in bytes (4 GiB if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


def default_budget(device: torch.device) -> int:
    """Half of what is free: room for the allocator's slack and whatever else runs."""
    return free_memory(device) // 2


def bytes_per_token(hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> int:
    """Activation memory one token needs while one layer runs (weights excluded).

    About ten hidden-size vectors (residual stream, norms, q/k/v, attention output, projections) and
    three intermediate-size ones (gate, up, product) in the model dtype, plus float32 copies of the
    hidden state: generous on purpose, since running out of memory costs far more than a smaller batch.
    """
    element = dtype.itemsize
    return element * (10 * hidden_size + 3 * intermediate_size) + 4 * 2 * hidden_size


def importance_bytes_per_token(
    hidden_size: int, intermediate_size: int, layers: int, vocab: int, dtype: torch.dtype, *, grad: bool
) -> int:
    """Memory one token needs in an importance pass: with `grad`, every layer's activations are kept for the
    backward pass; either way the logits over the vocabulary and the loss's float32 copies of them."""
    activations = bytes_per_token(hidden_size, intermediate_size, dtype) * (layers if grad else 1)
    return activations + vocab * 4 * (4 if grad else 3)


def tokens_per_batch(budget: int, per_token: int, attention_bytes: int) -> int:
    """Padded tokens one batch may hold after setting aside memory for attention blocks and their temporaries."""
    usable = budget - 4 * attention_bytes
    if usable < per_token:
        return 1
    return usable // per_token


def readable(nbytes: float) -> str:
    """A size as a user reads it: 512.0 MiB, 2.0 GiB."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
