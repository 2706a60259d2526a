"""Hand-built attention for the fused pass and its kernels (tests/test_fused.py, test_native.py, test_triton.py,
triton_interpreted.py): queries, keys and values of known seed, the masks a layer may get, the float64 reference of
every statistic, the fused pass with small tiles, and sdpa's output to hold the kernels' output against."""

from __future__ import annotations

import math

import torch

from headscope.model.attention.tile_loop import _tile_step, fused_attention
from headscope.model.masks import TileVisibility

HEADS, KV_HEADS, HEAD_DIM, T = 6, 2, 8, 23
WINDOW = 2


def hand_built(seed: int = 0, batch: int = 2, logit_scale: float = 3.0, t: int = T):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, HEADS, t, HEAD_DIM, generator=generator) * logit_scale
    key = torch.randn(batch, KV_HEADS, t, HEAD_DIM, generator=generator)
    value = torch.randn(batch, KV_HEADS, t, HEAD_DIM, generator=generator)
    return query, key, value


def masks(batch: int = 2, t: int = T, window: int = 3) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """name -> (the mask the attention function gets, (batch, t, t) bool visibility, seq_start)."""
    causal = torch.ones(t, t).tril().bool()
    left_padded = causal.repeat(batch, 1, 1)
    left_padded[1, :, :5] = False  # sentence 1 starts at position 5
    sliding = causal & ~torch.ones(t, t).tril(-window - 1).bool()  # each row sees itself and `window` keys before
    return {
        "causal": (None, causal.repeat(batch, 1, 1), torch.zeros(batch, dtype=torch.long)),
        "left padded": (left_padded[:, None], left_padded, torch.tensor([0, 5])),
        "sliding window": (sliding[None, None], sliding.repeat(batch, 1, 1), torch.zeros(batch, dtype=torch.long)),
    }


def reference(query, key, value, visible, seq_start, softcap=None, window=WINDOW):
    """Per-row statistics from the full float64 probabilities, as the eager functions compute them."""
    groups = HEADS // KV_HEADS
    q, k, v = query.double(), key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * HEAD_DIM**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    probs = torch.softmax(scores, -1)
    t = query.shape[2]
    rows = torch.arange(t)
    offset = rows[None, :] - rows[:, None]  # key - query
    is_first = (rows[None, :] == seq_start[:, None])[:, None, None, :]  # (batch, 1, 1, keys)
    rest = probs.masked_fill(is_first, 0.0)
    rest_mass = rest.sum(-1)
    shown = visible[:, None].expand_as(scores)
    logits = torch.where(shown, scores, 0.0)
    count = shown.sum(-1)
    mean = logits.sum(-1) / count
    return {
        "rest_mass": rest_mass,
        "rest_entropy": torch.special.entr(rest / rest_mass[..., None]).sum(-1),
        "rest_top_key": rest.argmax(-1),
        "logit_std": (torch.where(shown, scores - mean[..., None], 0.0).square().sum(-1) / count).sqrt(),
        "output": (probs @ v).transpose(1, 2),
        "entropy": torch.special.entr(probs).sum(-1),
        "max_weight": probs.amax(-1),
        "top_key": probs.argmax(-1),
        "diagonal": (probs * (offset.abs() <= window)).sum(-1),
        "sink": probs.gather(-1, seq_start.view(-1, 1, 1, 1).expand(-1, HEADS, t, 1)).squeeze(-1),
        "prev_token": (probs * (offset == -1)).sum(-1),
        "n_visible": visible.sum(-1)[:, None],
        "band_visible": (visible & (offset.abs() <= window)).sum(-1)[:, None],
    }


def fused(
    query,
    key,
    value,
    mask,
    seq_start,
    softcap=None,
    step=_tile_step,
    block_rows=5,
    tile_keys=7,
    positions=None,
    row_state=None,
    window=WINDOW,
):
    return fused_attention(
        query,
        key,
        value,
        TileVisibility(mask),
        scaling=HEAD_DIM**-0.5,
        softcap=softcap,
        seq_start=seq_start,
        window=window,
        step=step,
        positions=positions,
        block_rows=block_rows,
        tile_keys=tile_keys,
        row_state=row_state,
    )


STATISTICS = ("entropy", "max_weight", "diagonal", "sink", "prev_token", "n_visible", "band_visible")


def sdpa_output(query, key, value, visible, softcap=None):
    """The output as torch's sdpa computes it (float64 maths where sdpa cannot softcap): (batch, t, heads, head_dim)."""
    groups = HEADS // KV_HEADS
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    if softcap is None:
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible[:, None])
        return output.transpose(1, 2)
    scores = torch.tanh(query.double() @ key.double().transpose(-1, -2) * HEAD_DIM**-0.5 / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~visible[:, None], -math.inf), -1)
    return (probs @ value.double()).transpose(1, 2)


def assert_same_output(got, want, real):
    """Equal within 1e-5 of the output's largest magnitude, on the rows that see some key (batch, t)."""
    got, want = got[real].double(), want[real].double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), float((got - want).abs().max())
