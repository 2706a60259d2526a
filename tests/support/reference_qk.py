"""A plain computation of a head's attention logit split into pairs of senders (tests/commands/test_why.py), in
float64, sharing nothing with headscope.interventions.qk_*: the model's modules read by name (GPT-2: ln_1, c_attn,
c_proj; Llama and Gemma 2: input_layernorm, q_proj, k_proj, o_proj, Gemma 2's post_attention_layernorm), each
earlier MLP's write taken as what the stream gains across it, the norms written out with their scale at the run,
RoPE computed from the config's base, the softcap's secant and the contrast from their definitions (docs/why.md)."""

from __future__ import annotations

import copy
import math

import torch


def rope_base(config) -> float:
    base = getattr(config, "rope_theta", None)
    if base is None:
        base = config.rope_parameters["rope_theta"]
    return float(base)


def split_by_hand(lm, ids: list[int], layer: int, head: int, row: int, key: int) -> dict:
    """{"names", "term" (senders, senders), "contrast", "logits" (the row's, over its visible keys), "keys"}."""
    model = copy.deepcopy(lm).double().eval().requires_grad_(False)
    config = model.config
    gpt2 = hasattr(model, "transformer")
    gemma = type(model).__name__.startswith("Gemma")
    blocks = list(model.transformer.h if gpt2 else model.model.layers)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inputs, z, attn_out = {}, {}, {}
    hooks = []
    for index, block in enumerate(blocks):
        out = block.attn.c_proj if gpt2 else block.self_attn.o_proj
        hooks.append(block.register_forward_pre_hook(
            lambda m, args, kwargs, i=index: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]),
            with_kwargs=True))  # fmt: skip
        hooks.append(out.register_forward_pre_hook(lambda m, args, i=index: z.__setitem__(i, args[0][0])))
        hooks.append(out.register_forward_hook(lambda m, args, output, i=index: attn_out.__setitem__(i, output[0])))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()

    def rms_norm(norm, at):
        eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps  # Llama's, Gemma's
        scale = 1.0 / torch.sqrt(at.square().mean(-1, keepdim=True) + eps)
        gain = (1.0 + norm.weight) if gemma else norm.weight
        return lambda x: x * scale * gain

    # every sender's write into the stream layer `layer` reads, (t, hidden) each
    names, writes = ["embed"], [inputs[0]]
    bias = torch.zeros_like(inputs[0])
    for earlier in range(layer):
        block = blocks[earlier]
        out = block.attn.c_proj if gpt2 else block.self_attn.o_proj
        columns = out.weight.T if gpt2 else out.weight  # (hidden, heads * head_dim): Conv1D stores (in, out)
        out_bias = out.bias
        per_head = [z[earlier][:, h * head_dim : (h + 1) * head_dim] @ columns[:, h * head_dim : (h + 1) * head_dim].T
                    for h in range(heads)]  # fmt: skip
        constant = torch.zeros(hidden, dtype=torch.float64) if out_bias is None else out_bias
        attention_write = attn_out[earlier]
        if gemma:  # the post-attention norm, its scale at the run: each head's share of its input, scaled alike
            post = rms_norm(block.post_attention_layernorm, attn_out[earlier])
            per_head, constant = [post(w) for w in per_head], post(constant.expand_as(bias))
            attention_write = post(attn_out[earlier])
        names += [f"{earlier}.{h}" for h in range(heads)]
        writes += per_head
        bias = bias + constant
        names.append(f"mlp{earlier}")
        writes.append(inputs[earlier + 1] - inputs[earlier] - attention_write)  # what the MLP adds
    names.append("bias")
    writes.append(bias)
    stream = inputs[layer]
    assert torch.allclose(sum(writes), stream, atol=1e-9 * stream.abs().max())

    # layer `layer`'s input norm, q and k projections of the head and of the KV head it reads
    block = blocks[layer]
    kv = head // (heads // kv_heads)
    if gpt2:
        norm = block.ln_1
        var = stream.var(-1, keepdim=True, unbiased=False)

        def normed(x, constant):
            centred = (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + norm.eps) * norm.weight
            return centred + (norm.bias if constant else 0.0)

        weight, proj_bias = block.attn.c_attn.weight, block.attn.c_attn.bias
        q_cols = slice(head * head_dim, (head + 1) * head_dim)
        k_cols = slice(hidden + kv * head_dim, hidden + (kv + 1) * head_dim)
        q_w, q_b, k_w, k_b = weight[:, q_cols], proj_bias[q_cols], weight[:, k_cols], proj_bias[k_cols]
        scaling = head_dim**-0.5
    else:
        norm = rms_norm(block.input_layernorm, stream)

        def normed(x, constant):
            return norm(x)

        attention = block.self_attn
        q_w = attention.q_proj.weight[head * head_dim : (head + 1) * head_dim].T
        k_w = attention.k_proj.weight[kv * head_dim : (kv + 1) * head_dim].T
        q_b = 0.0 if attention.q_proj.bias is None else attention.q_proj.bias[head * head_dim : (head + 1) * head_dim]
        k_b = 0.0 if attention.k_proj.bias is None else attention.k_proj.bias[kv * head_dim : (kv + 1) * head_dim]
        scaling = (config.query_pre_attn_scalar if gemma else head_dim) ** -0.5
    queries = torch.stack([normed(w, name == "bias") @ q_w + (q_b if name == "bias" else 0.0)
                           for name, w in zip(names, writes, strict=True)])  # fmt: skip
    keys = torch.stack([normed(w, name == "bias") @ k_w + (k_b if name == "bias" else 0.0)
                        for name, w in zip(names, writes, strict=True)])  # fmt: skip
    if not gpt2:  # RoPE from the config's base: x cos + rotate_half(x) sin at each position
        t = len(ids)
        inverse = 1.0 / rope_base(config) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.arange(t, dtype=torch.float64)[:, None] * inverse[None]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

        def rotate(x):
            half = head_dim // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

        queries, keys = rotate(queries), rotate(keys)

    visible = list(range(row + 1))
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if gemma and window and types is not None and types[layer] == "sliding_attention":
        visible = [s for s in visible if row - s < window]
    terms = scaling * torch.einsum("ad,bsd->abs", queries[:, row], keys[:, visible])  # (senders, senders, keys)
    logits = terms.sum((0, 1))
    softcap = getattr(config, "attn_logit_softcapping", None) if gemma else None
    if softcap:
        capped = softcap * torch.tanh(logits / softcap)
        terms = terms * (capped / logits)
        logits = capped
    weights = torch.softmax(logits, -1)
    at = visible.index(key)
    others = weights.clone()
    others[at] = 0.0
    others = others / others.sum() if others.sum() > 0 else others
    contrast = terms[..., at] - torch.einsum("abs,s->ab", terms, others)
    assert math.isclose(float(terms[..., at].sum()), float(logits[at]), rel_tol=1e-9, abs_tol=1e-9)
    return {"names": names, "term": terms[..., at], "contrast": contrast, "logits": logits, "keys": visible,
            "weights": weights}  # fmt: skip
