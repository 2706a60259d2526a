"""Parts of a block of attention rows the row sums share: each sentence's first key, the keys off the sink, and a
row's spread over the keys it sees. Pure functions on (batch, heads, rows, keys) tensors."""

from __future__ import annotations

import torch

from headscope.model.masks import count_visible


def first_key(seq_start: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """(batch, heads, rows, 1) long: each sentence's first key, for `gather` on a (batch, heads, rows, keys) block.
    A block of padding rows before a left-padded sentence may end before its first key: clamped (ignored rows)."""
    batch, heads, rows, keys = shape
    return seq_start.clamp(max=keys - 1).view(batch, 1, 1, 1).expand(batch, heads, rows, 1)


def without_first(
    x: torch.Tensor, seq_start: torch.Tensor, first_at_zero: bool | None, fill: float = 0.0
) -> tuple[torch.Tensor, int]:
    """The keys off the sink of a (batch, heads, rows, keys) block, and what to add to an index into them to get
    the key: a view of keys 1.. when every sentence starts at 0 (right padding), else a copy with each
    sentence's first key set to `fill` (its weight 0, or the lowest logit)."""
    if first_at_zero is None:
        first_at_zero = bool((seq_start == 0).all())
    if first_at_zero and x.shape[-1] > 1:
        return x[..., 1:], 1
    keys = torch.arange(x.shape[-1], device=x.device)
    is_first = (keys[None, :] == seq_start[:, None])[:, None, None, :]  # (batch, 1, 1, keys)
    return x.masked_fill(is_first, fill), 0


def first_visible(key_visible: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(batch, 1 or heads, rows) bool: may the row see its sentence's first key? key_visible: (batch or 1, 1 or
    heads, rows, keys)."""
    shown = key_visible.expand(first.shape[0], -1, -1, -1)
    return shown.gather(-1, first[:, : shown.shape[1]]).squeeze(-1)


def masked_std(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Standard deviation (over n, not n - 1) of each row of x (..., keys) over its visible keys: (...). Two
    passes (the mean, then the squares about it), so that a large mean costs no digits."""
    count = count_visible(visible).clamp(min=1)
    mean = x.masked_fill(~visible, 0.0).sum(-1) / count
    deviation = (x - mean[..., None]).masked_fill_(~visible, 0.0)
    return torch.sqrt(torch.linalg.vecdot(deviation, deviation) / count)
