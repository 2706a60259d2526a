"""What a decoder layer returns (a tensor, or a tuple holding tensors and other things), taken apart along the batch
axis or detached, whatever its form: the capture keeps layer outputs, and replicated passes hand them on."""

from __future__ import annotations

import torch


def detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(detached(v) for v in value)
    return value


def replicate(value, times: int):
    """A layer output (tensor, or tuple of them) repeated `times` along the batch axis, like Batch.replicated."""
    if isinstance(value, torch.Tensor):
        return value.repeat(times, *[1] * (value.dim() - 1))
    if isinstance(value, tuple):
        return tuple(replicate(v, times) for v in value)
    return value


def rows_of(value, rows: slice):
    """The rows `rows` (along the batch axis) of a layer output (tensor, or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, tuple):
        return tuple(rows_of(v, rows) for v in value)
    return value
