"""model/projection.py's `linear_weight`: the one place a Conv1D's (in, out) weight and a Linear's (out, in) meet."""

from __future__ import annotations

import torch
from transformers.pytorch_utils import Conv1D

from headscope.model.projection import linear_weight


def test_both_projections_compute_their_output_from_the_linear_weight_and_write_through_it():
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    for module in (torch.nn.Linear(5, 7), Conv1D(7, 5)):  # Conv1D(out, in): weight (5, 7)
        weight = linear_weight(module)
        assert weight.shape == (7, 5)
        torch.testing.assert_close(x @ weight.T + module.bias, module(x))
        with torch.no_grad():
            linear_weight(module)[:, 2].zero_()  # a view: the module's own weight changes
        assert not module(torch.eye(5)[2:3] * 1.0).sub(module.bias).any(), type(module).__name__
