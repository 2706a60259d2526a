"""Run by test_triton.py in a process of its own with TRITON_INTERPRET=1 (Triton picks its interpreter when a kernel
is defined): the Triton kernel on CPU tensors against the float64 reference, printed as one JSON line of the worst
error of each statistic and the output, per case."""

from __future__ import annotations

import json
import math

import torch

from headscope.model.attention import cuda_kernel
from headscope.model.attention.dispatch import TileKernel

from attention_cases import HEAD_DIM, HEADS, KV_HEADS, fused, hand_built, masks, reference

T = 150  # three blocks of 64 rows and of 64 keys
STATISTICS = ("entropy", "max_weight", "diagonal", "sink", "prev_token", "rest_entropy", "rest_mass", "logit_std")
SELECTED = torch.tensor([0, 5, 6, 63, 64, 100, T - 1])


def expected_output(query, key, value, visible, softcap):
    """The output in float64, as the eager functions compute it: (batch, t, heads, head_dim)."""
    groups = HEADS // KV_HEADS
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    scores = query.double() @ key.transpose(-1, -2) * HEAD_DIM**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return (torch.softmax(scores.masked_fill(~visible[:, None], -math.inf), -1) @ value).transpose(1, 2)


def case_masks(name: str):
    """(the mask the attention function gets, (batch, t, t) visibility, seq_start) of a case."""
    if name == "holes":  # every fifth key hidden: rows that are not one run of keys
        holes = (torch.ones(T, T).tril().bool() & (torch.arange(T) % 5 != 1)) | torch.eye(T, dtype=torch.bool)
        return holes[None, None], holes.repeat(2, 1, 1), torch.zeros(2, dtype=torch.long)
    return masks(t=T, window=40)[name]


def worst_errors(mask_name: str, softcap: float | None, *, positions=None, with_output: bool = True) -> dict:
    query, key, value = hand_built(seed=21, t=T)
    mask, visible, seq_start = case_masks(mask_name)
    kernel = TileKernel(native_loader=lambda: cuda_kernel, native_from=0)  # CPU tensors: the interpreter
    row_state = kernel.row_state(query, mask)
    output, values = fused(query, key, value if with_output else None, mask, seq_start, softcap,
                           positions=positions, row_state=row_state)  # fmt: skip
    expected = reference(query, key, value, visible, seq_start, softcap)
    rows = slice(None) if positions is None else positions
    real = visible.any(-1)[:, rows]
    worst = {"kernel ran": kernel.native_runs == 1 and not kernel.failed_kernels}
    for name in STATISTICS:
        got, want = torch.broadcast_tensors(getattr(values, name).double(), expected[name][..., rows].double())
        got, want = got.transpose(1, 2)[real], want.transpose(1, 2)[real]
        defined = ~want.isnan()  # the entropy off the sink of a row that sees only the first key
        worst[name] = float((got - want)[defined].abs().max())
    top, want_top = values.top_key.transpose(1, 2)[real], expected["top_key"][..., rows].transpose(1, 2)[real]
    worst["top_key"] = bool(torch.equal(top, want_top))
    if output is not None:
        want = expected_output(query, key, value, visible, softcap)[:, rows][real]
        worst["output"] = float((output[real].double() - want).abs().max() / want.abs().max())
    return worst


if __name__ == "__main__":
    errors = {
        f"{name}, softcap {softcap}": worst_errors(name, softcap)
        for name in ("causal", "left padded", "sliding window")
        for softcap in (None, 10.0)
    }
    errors["holes"] = worst_errors("holes", None)
    errors["selected rows"] = worst_errors("left padded", None, positions=SELECTED)
    errors["statistics alone"] = worst_errors("left padded", None, with_output=False)
    print(json.dumps(errors))
