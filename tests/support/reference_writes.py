"""A deliberately plain computation of what heads write and do off the sink, for checking headscope.

One unpadded sentence at a time, float64, straight from the model: output_attentions=True for the probabilities,
forward hooks for each head's output (the input of the output projection), the residual stream entering each
decoder layer and the value vectors. Row by row, in numpy; nothing shared with headscope.measures.

What a head writes is what reaches the residual stream, written out per architecture from its modelling code:
Gemma 2/3 pass the attention output o through post_attention_layernorm, (1 + w) * o / sqrt(mean(o^2) + eps); OLMo 2
the same with gain w; Granite multiplies it by config.residual_multiplier. Head h's share freezes the norm's rms at
the row's value: g * (W_h z_h) / rms(o).
"""

from __future__ import annotations

import numpy as np
import torch

from reference import output_projection_of

ROW_METRICS = (
    "write_norm",
    "write_ratio",
    "sink_value_ratio",
    "logit_std",
    "active_rows",
    "offsink_prev_token",
    "offsink_norm_entropy",
)


def _attention(layer):
    return getattr(layer, "self_attn", None) or layer.attn


def _values_of(attention, output, heads: int, kv_heads: int, head_dim: int) -> np.ndarray:
    """(kv_heads, n, head_dim) value vectors from the value projection's output (Llama's v_proj, GPT-2's c_attn)."""
    x = output[0].double()
    if hasattr(attention, "v_proj"):
        return x.view(-1, kv_heads, head_dim).transpose(0, 1).numpy()
    return x[:, 2 * heads * head_dim :].reshape(-1, heads, head_dim).transpose(0, 1).numpy()


def write_path_of(model, layer):
    """(gain (hidden,) or None, eps, scale): how this architecture's attention output reaches the residual stream."""
    name = type(layer).__name__
    scale = float(getattr(model.config, "residual_multiplier", 1.0))
    if name.startswith(("Gemma2", "Gemma3")):
        norm = layer.post_attention_layernorm
        return 1.0 + norm.weight.detach().double().numpy(), norm.eps, scale
    if name.startswith(("Olmo2", "Olmo3")):
        norm = layer.post_attention_layernorm
        return norm.weight.detach().double().numpy(), norm.variance_epsilon, scale
    return None, 0.0, scale


def sentence_rows(model, layers, ids: list[int], heads: int, kv_heads: int, head_dim: int, only=None, threshold=0.3):
    """layer -> metric -> list of (heads,) per-row values (only the rows the metric averages), and layer ->
    list of off-sink top categories per row (rows t >= 4), for one sentence; of the layers `only` (default all)."""
    kept = {}
    hooks = []
    for index, layer in enumerate(layers):
        attention = _attention(layer)
        projection = output_projection_of(layer)
        hooks.append(projection.register_forward_pre_hook(lambda m, a, i=index: kept.__setitem__(("z", i), a[0])))
        hooks.append(
            layer.register_forward_pre_hook(
                lambda m, a, k, i=index: kept.__setitem__(("x", i), a[0] if a else k["hidden_states"]),
                with_kwargs=True,
            )
        )
        projection = getattr(attention, "v_proj", None) or attention.c_attn
        hooks.append(projection.register_forward_hook(lambda m, a, o, i=index: kept.__setitem__(("value", i), o)))
    try:
        with torch.inference_mode():
            attentions = model(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        for hook in hooks:
            hook.remove()
    n = len(ids)
    rows, categories = {}, {}
    for index, layer in enumerate(layers):
        if only is not None and index not in only:
            continue
        p_all = attentions[index][0].double().numpy()  # (heads, n, n)
        z = kept[("z", index)][0].double().numpy().reshape(n, heads, head_dim)
        x = kept[("x", index)][0].double().numpy()
        projection = output_projection_of(layer).weight.detach().double().numpy()
        if type(output_projection_of(layer)).__name__ == "Conv1D":
            projection = projection.T  # (hidden, heads * head_dim)
        values = _values_of(_attention(layer), kept[("value", index)], heads, kv_heads, head_dim)
        value_norms = np.linalg.norm(values, axis=-1)  # (kv_heads, n)
        groups = heads // kv_heads
        out = {name: [] for name in ROW_METRICS}
        cats = []
        columns = [z[:, h] @ projection[:, h * head_dim : (h + 1) * head_dim].T for h in range(heads)]  # (n, hidden)
        gain, eps, scale = write_path_of(model, layer)
        if gain is not None:  # the post-attention norm, its rms frozen at each row's o = sum of the columns (+ bias)
            bias = output_projection_of(layer).bias
            o = sum(columns) + (0.0 if bias is None else bias.detach().double().numpy())
            rms = np.sqrt(np.mean(o**2, axis=-1) + eps)  # (n,)
            columns = [gain * c / rms[:, None] for c in columns]
        written = abs(scale) * np.stack([np.linalg.norm(c, axis=-1) for c in columns], axis=-1)  # (n, heads)
        for t in range(n):
            writes = written[t]
            out["write_norm"].append(writes)
            if np.linalg.norm(x[t]) > 0:  # a token embedded as zeros has no ratio
                out["write_ratio"].append(writes / np.linalg.norm(x[t]))
            p = p_all[:, t, : t + 1]
            if t >= 1:
                mean_norm = value_norms[:, : t + 1].mean(axis=1)
                with np.errstate(invalid="ignore"):  # a head whose values are all 0 has no ratio (NaN)
                    out["sink_value_ratio"].append(np.repeat(value_norms[:, 0] / mean_norm, groups))
                out["logit_std"].append(np.log(p).std(axis=1))
                rest = p[:, 1:]
                mass = rest.sum(axis=1)
                out["active_rows"].append((p[:, 0] <= threshold).astype(float))
                renormalised = rest / mass[:, None]
                if t >= 2:
                    out["offsink_prev_token"].append(p[:, t - 1] / mass)
                    logs = np.log(np.where(renormalised > 0, renormalised, 1.0))
                    out["offsink_norm_entropy"].append(-(renormalised * logs).sum(axis=1) / np.log(t))
                if t >= 4:
                    row = []
                    for h in range(heads):
                        top = int(np.argmax(rest[h]))
                        if (rest[h] == rest[h, top]).sum() > 1:
                            row.append("other")
                        else:
                            offset = t - (top + 1)
                            row.append(str(offset) if offset <= 8 else "other")
                    cats.append(row)
        rows[index] = out
        categories[index] = cats
    return rows, categories


def corpus_means(model, layers, sentences: list[list[int]], heads: int, kv_heads: int, head_dim: int, only=None):
    """layer -> column -> (heads,) token-weighted means over every sentence, and offsink_top_offset (+ share); of
    the layers `only` (default all)."""
    pooled = {}
    for ids in sentences:
        rows, categories = sentence_rows(model, layers, ids, heads, kv_heads, head_dim, only)
        for layer, metrics in rows.items():
            into = pooled.setdefault(layer, {name: [] for name in (*ROW_METRICS, "categories")})
            for name, values in metrics.items():
                into[name].extend(values)
            into["categories"].extend(categories[layer])
    means = {}
    order = [*map(str, range(9)), "other"]  # ties between categories: the earlier one, as headscope
    for layer, metrics in pooled.items():
        out = {name: np.mean(metrics[name], axis=0) for name in ROW_METRICS}
        cats = np.array(metrics["categories"], dtype=object)  # (rows, heads)
        tops, shares = [], []
        for h in range(heads):
            counts = {c: int((cats[:, h] == c).sum()) for c in order}
            top = max(order, key=lambda c: (counts[c], -order.index(c)))
            tops.append(top)
            shares.append(counts[top] / len(cats))
        out["offsink_top_offset"] = np.array(tops, dtype=object)
        out["offsink_top_offset_share"] = np.array(shares)
        out["evidence_rows"] = len(cats)
        means[layer] = out
    return means
