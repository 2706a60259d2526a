"""A plain computation of head importance (tests/measures/test_smollm2.py, tests/interventions/test_importance.py):
hooks on a layer's output projection, one sentence at a time, float64 losses, nothing shared with headscope."""

from __future__ import annotations

import torch


def straightforward_importance(loaded, sentences, layer, head):
    """ablation_zero, ablation_mean, attribution_zero, attribution_mean, the mean removal's curvature term
    (1/2 sum over positions of ((mean - x) . g)^2) and the zero removal's (1/2 sum of (x . g)^2) of one head, one
    sentence at a time, with a hook that edits the input of the layer's output projection (nothing shared with
    headscope)."""
    lm, tokenizer = loaded.lm, loaded.tokenizer
    dim = loaded.architecture["head_dim"]
    columns = slice(head * dim, (head + 1) * dim)
    o_proj = lm.model.layers[layer].self_attn.o_proj
    inputs = [torch.tensor([tokenizer(s)["input_ids"]]) for s in sentences]

    def loss(ids, edit=None):
        handle = o_proj.register_forward_pre_hook(edit) if edit else None
        try:
            logits = lm(ids).logits[0].double()
        finally:
            if handle:
                handle.remove()
        return torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")

    seen = []
    with torch.inference_mode():
        clean = [loss(ids, lambda m, args: seen.append(args[0][0, :, columns].double())) for ids in inputs]
    mean = torch.cat(seen).mean(0)  # over every position of every sentence
    predicted = sum(ids.shape[1] - 1 for ids in inputs)

    def replaced_by(vector):
        def edit(module, args):
            x = args[0].clone()
            x[0, :, columns] = vector.to(x.dtype)
            return (x,)

        return edit

    with torch.inference_mode():
        zero = sum(loss(ids, replaced_by(torch.zeros(dim))) - c for ids, c in zip(inputs, clean, strict=True))
        ablated_mean = sum(loss(ids, replaced_by(mean)) - c for ids, c in zip(inputs, clean, strict=True))
    attribution_zero = attribution_mean = curvature_mean = curvature_zero = 0.0
    kept = {}

    def differentiable(module, args):
        kept["x"] = args[0].detach().requires_grad_()
        return (kept["x"],)

    for ids in inputs:
        with torch.enable_grad():
            loss(ids, differentiable).backward()
        x, g = kept["x"][0, :, columns].detach().double(), kept["x"].grad[0, :, columns].double()
        attribution_zero += float(((0 - x) * g).sum())
        attribution_mean += float(((mean - x) * g).sum())
        curvature_mean += 0.5 * float((((mean - x) * g).sum(-1) ** 2).sum())
        curvature_zero += 0.5 * float((((0 - x) * g).sum(-1) ** 2).sum())
    found = (zero, ablated_mean, attribution_zero, attribution_mean, curvature_mean, curvature_zero)
    return [float(v) / predicted for v in found]
