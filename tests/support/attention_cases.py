"""Hand-built attention for the fused pass and its kernels (tests/measures/test_fused.py, model/test_native.py,
model/test_triton.py, support/triton_interpreted.py): queries, keys and values of known seed, the masks a layer may
get, the float64 reference of every statistic, the fused pass with small tiles, and sdpa's output to hold the
kernels' output against."""

from __future__ import annotations

import functools
import hashlib
import math

import torch

from headscope.model.attention.tile_loop import _tile_step, fused_attention
from headscope.model.masks import TileVisibility

from tolerances import UNIT, entropy_error, gamma, logit_error

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


def _by_content(compute):
    """`compute` once per distinct inputs (tensors by their bytes): the float64 reference and the bounds of one set
    of inputs are asked for by every kernel, tiling and block size a test holds against them (each call about a
    second on the long cases). Returns copies: a caller may not change what the next one reads."""
    found: dict = {}

    def key_of(value):
        if isinstance(value, torch.Tensor):
            return (str(value.dtype), tuple(value.shape), hashlib.blake2b(value.numpy().tobytes()).hexdigest())
        return value

    @functools.wraps(compute)
    def cached(*args, **kwargs):
        key = (tuple(key_of(a) for a in args), tuple(sorted((k, key_of(v)) for k, v in kwargs.items())))
        if key not in found:
            if len(found) >= 16:  # a few inputs at a time: the long cases' results are tens of MB
                found.pop(next(iter(found)))
            found[key] = compute(*args, **kwargs)
        return {name: tensor.clone() for name, tensor in found[key].items()}

    return cached


@_by_content
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
        "rest_max_weight": rest.amax(-1),
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


@_by_content
def bounds(query, key, value, visible, seq_start, softcap=None, window=WINDOW):
    """How far each per-row statistic computed in float32 (any kernel, any tiling, any BLAS) may be from
    `reference`'s float64 one, for these inputs (tests/support/tolerances.py): each logit is within its logit_error
    eps_j (tanh is 1-Lipschitz: a softcap adds only its own rounding), so each probability within (e^(2 delta) - 1) of
    itself, delta the row's largest eps_j over the keys it sees, plus float32's rounding of the exponentials and of
    the row's sums. (batch, heads, t) float64 each, like the reference's; `output` (batch, t, heads, head_dim)."""
    groups = HEADS // KV_HEADS
    t = query.shape[2]
    errors = logit_error(query, key, HEAD_DIM**-0.5)
    if softcap is not None:
        errors = errors + 2 * UNIT * softcap
    exact = reference(query, key, value, visible, seq_start, softcap, window)
    shown = visible[:, None].expand(-1, HEADS, -1, -1)
    delta = torch.where(shown, errors, 0.0).amax(-1)  # (batch, heads, t)
    moved = torch.expm1(2 * delta)  # the largest relative change of a probability
    rounding = gamma(t) + 4 * UNIT  # the exponentials' and the division's rounding, and the sums'
    mass = moved + rounding  # any sum of a row's probabilities: <= 1 of them
    probs = _probabilities(query, key, visible, softcap)
    rest = probs.masked_fill((torch.arange(t)[None, :] == seq_start[:, None])[:, None, None, :], 0.0)
    renormalised = rest / exact["rest_mass"][..., None].clamp(min=1e-300)
    magnitude = probs @ value.double().abs().repeat_interleave(groups, 1)  # sum_j p_j |v_j|, per dimension
    scores = torch.where(shown, _scores(query, key, softcap), 0.0).abs().amax(-1)
    return {
        "entropy": entropy_error(probs, errors),
        "rest_entropy": entropy_error(renormalised, errors),
        "max_weight": mass,
        "diagonal": mass,
        "sink": mass,
        "prev_token": mass,
        "rest_mass": mass,
        "rest_max_weight": mass,
        # the logits' spread moves at most as far as the logits; its float32 sums of n terms of size |s| + spread
        "logit_std": delta + 2 * gamma(t) * (scores + exact["logit_std"] + 1),
        "output": ((moved + rounding)[..., None] * magnitude).transpose(1, 2),
        "n_visible": torch.zeros(()),
        "band_visible": torch.zeros(()),
    }


def _scores(query, key, softcap):
    k = key.double().repeat_interleave(HEADS // KV_HEADS, 1)
    scores = query.double() @ k.transpose(-1, -2) * HEAD_DIM**-0.5
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _probabilities(query, key, visible, softcap):
    return torch.softmax(_scores(query, key, softcap).masked_fill(~visible[:, None], -math.inf), -1)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, where: torch.Tensor, name: str) -> None:
    """|got - want| <= bound wherever `where` (all broadcast together), naming the statistic and the worst excess."""
    got, want, bound, where = torch.broadcast_tensors(got.double(), want.double(), bound.double(), where)
    error = (got - want).abs()[where]
    limit = bound[where]
    assert (error <= limit).all(), f"{name}: {float((error - limit).max()):.3g} over its bound"


def assert_matches_reference(values, query, key, value, visible, seq_start, softcap=None, *, names=None,
                             window=WINDOW, factor: float = 1.0) -> None:  # fmt: skip
    """Each statistic of `names` (default STATISTICS) within `factor` times its float32 bound (`bounds`) of the
    float64 reference, on every row that sees a key: 1 for values computed once in float32, 2 for values held
    against another float32 computation's."""
    expected = reference(query, key, value, visible, seq_start, softcap, window)
    bound = bounds(query, key, value, visible, seq_start, softcap, window)
    real = visible.any(-1)[:, None]  # (batch, 1, t): padding rows see nothing, and may hold anything
    for name in names or STATISTICS:
        assert_within(getattr(values, name), expected[name], factor * bound[name], real, name)


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
    patterns=None,
):
    """fused_attention on a test case: (output, values), and with `patterns` their PatternRows too."""
    output, values, read = fused_attention(
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
        patterns=patterns,
    )
    return (output, values) if patterns is None else (output, values, read)


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


def assert_same_output(got, want, real, query, key, value, visible, seq_start, softcap=None):
    """Two float32 outputs (batch, t, heads, head_dim) each within its bound of the exact one (`bounds`), so within
    twice that of each other, on the rows that see some key (real: (batch, t))."""
    bound = 2 * bounds(query, key, value, visible, seq_start, softcap)["output"]
    assert_within(got, want, bound, real[..., None, None], "output")
