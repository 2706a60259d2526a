"""A deliberately plain re-implementation of the metric definitions, for checking headscope.

One unpadded sentence at a time, one query row at a time, in float64 numpy:
no masks, no diagonals tricks, nothing shared with headscope.measures.row_sums.
"""

from __future__ import annotations

import numpy as np
import torch

METRIC_NAMES = ("entropy", "norm_entropy", "diagonal", "diagonal_uniform", "sink", "prev_token", "max_weight")


def sentence_rows(attn: np.ndarray, window: int = 2) -> dict[str, list[np.ndarray]]:
    """Per-row values of every metric for one causal sentence.

    attn: (heads, n, n) attention of one sentence without padding. Row t sees keys 0..t.
    Returns metric -> list of (heads,) arrays, one per row that the metric averages over.
    """
    heads, n, _ = attn.shape
    rows: dict[str, list[np.ndarray]] = {name: [] for name in METRIC_NAMES}
    for t in range(n):
        p = attn[:, t, : t + 1].astype(np.float64)  # the keys row t can see
        logs = np.log(np.where(p > 0, p, 1.0))
        entropy = -(p * logs).sum(axis=-1)
        rows["entropy"].append(entropy)
        if t >= 1:
            rows["norm_entropy"].append(entropy / np.log(t + 1))
        first_in_band = max(0, t - window)
        rows["diagonal"].append(p[:, first_in_band:].sum(axis=-1))
        rows["diagonal_uniform"].append(np.full(heads, (t + 1 - first_in_band) / (t + 1)))
        rows["sink"].append(p[:, 0])
        if t >= 1:
            rows["prev_token"].append(p[:, t - 1])
        rows["max_weight"].append(p.max(axis=-1))
    return rows


def corpus_means(sentences: list[np.ndarray], window: int = 2) -> dict[str, np.ndarray]:
    """Token-weighted means over all rows of all sentences, per head; plus entropy_std and n_rows."""
    pooled: dict[str, list[np.ndarray]] = {name: [] for name in METRIC_NAMES}
    for attn in sentences:
        for name, values in sentence_rows(attn, window).items():
            pooled[name].extend(values)
    out = {}
    for name, values in pooled.items():
        heads = sentences[0].shape[0]
        out[name] = np.mean(values, axis=0) if values else np.full(heads, np.nan)
    out["entropy_std"] = np.std(pooled["entropy"], axis=0)
    out["n_rows"] = np.full(sentences[0].shape[0], len(pooled["entropy"]))
    return out


def role_evidence(sentences: list[np.ndarray], threshold: float = 0.3) -> dict[str, np.ndarray]:
    """sink_rate, top_offset and top_offset_share per head, straight from the definitions.

    Over rows t >= 4 of every sentence: a sink row puts more than `threshold` on key 0; a row's top key is
    its largest weight's key when no other key ties it; "first" if that is key 0, else the offset t - key
    when it is 0..8, else "other".
    """
    heads = sentences[0].shape[0]
    sink_rows, counts = np.zeros(heads), [dict() for _ in range(heads)]
    rows = 0
    for attn in sentences:
        for t in range(4, attn.shape[-1]):
            rows += 1
            for h in range(heads):
                p = attn[h, t, : t + 1]
                sink_rows[h] += p[0] > threshold
                top = int(np.argmax(p))
                if (p == p[top]).sum() > 1:
                    category = "other"
                elif top == 0:
                    category = "first"
                else:
                    category = str(t - top) if t - top <= 8 else "other"
                counts[h][category] = counts[h].get(category, 0) + 1
    order = ["first", *map(str, range(9)), "other"]  # ties between categories: the earlier one, as headscope
    top = [max(order, key=lambda c, h=h: (counts[h].get(c, 0), -order.index(c))) for h in range(heads)]
    return {
        "sink_rate": sink_rows / rows,
        "top_offset": np.array(top, dtype=object),
        "top_offset_share": np.array([counts[h][top[h]] / rows for h in range(heads)]),
    }


def probe_scores(attentions: list[np.ndarray], prefix: int, length: int) -> dict[str, np.ndarray]:
    """Mean over seeds of each probe score, from each seed's (heads, t, t) attention, row by row; and, as
    "<pattern>_offsink", the same with each row renormalised without position 0, over the rows whose target is
    not position 0.

    A sequence is prefix + r + r: induction rows are the second copy (key t - length + 1), duplicate rows
    the same (key t - length), previous rows every random row but the first (key t - 1).
    """
    targets = {
        "induction": [(t, t - length + 1) for t in range(prefix + length, prefix + 2 * length)],
        "duplicate": [(t, t - length) for t in range(prefix + length, prefix + 2 * length)],
        "previous": [(t, t - 1) for t in range(prefix + 1, prefix + 2 * length)],
    }
    per_seed = {name: [] for name in (*targets, *(f"{name}_offsink" for name in targets))}
    for attn in attentions:
        for name, pairs in targets.items():
            per_seed[name].append(np.mean([attn[:, t, key] for t, key in pairs], axis=0))
            off = [attn[:, t, key] / attn[:, t, 1 : t + 1].sum(axis=-1) for t, key in pairs if key >= 1]
            per_seed[f"{name}_offsink"].append(np.mean(off, axis=0))
    return {name: np.mean(values, axis=0) for name, values in per_seed.items()}


# ---------------------------------------------------------------- heads removed together, by hooks


def output_projection_of(layer):
    """The attention's output projection, named per architecture (Llama: self_attn.o_proj, GPT-2: attn.c_proj)."""
    attention = getattr(layer, "self_attn", None) or layer.attn
    return getattr(attention, "o_proj", None) or attention.c_proj


def repeat_positions(ids: list[int]) -> list[bool]:
    """Brute force: t counts iff some j < t - 1 has ids[j] == ids[t-1] and ids[j+1] == ids[t]."""
    return [
        any(ids[j] == ids[t - 1] and ids[j + 1] == ids[t] for j in range(t - 1)) if t >= 2 else False
        for t in range(len(ids))
    ]


def hooked_losses(lm, layers, sentences: list[list[int]], heads, mode: str, scoring: str, head_dim: int):
    """(clean loss, ablated loss, scored tokens) of `heads` removed together, one sentence at a time, by forward
    pre-hooks on each layer's output projection (its input is the heads' outputs side by side); float64 loss."""
    import torch

    projections = [output_projection_of(layer) for layer in layers]
    means = {}
    if mode == "mean":
        sums, count = {}, 0

        def summer(index):
            def hook(module, args):
                sums[index] = sums.get(index, 0) + args[0][0].double().sum(0)

            return hook

        hooks = [p.register_forward_pre_hook(summer(i)) for i, p in enumerate(projections)]
        with torch.no_grad():
            for ids in sentences:
                lm(torch.tensor([ids]))
                count += len(ids)
        for hook in hooks:
            hook.remove()
        means = {index: total / count for index, total in sums.items()}

    def remover(index, removed):
        def hook(module, args):
            x = args[0].clone()
            for head in removed:
                columns = slice(head * head_dim, (head + 1) * head_dim)
                x[..., columns] = 0.0 if mode == "zero" else means[index][columns].to(x.dtype)
            return (x, *args[1:])

        return hook

    def total(with_hooks: bool) -> tuple[float, int]:
        hooks = []
        if with_hooks:
            for index in sorted({layer for layer, _ in heads}):
                removed = [head for layer, head in heads if layer == index]
                hooks.append(projections[index].register_forward_pre_hook(remover(index, removed)))
        loss, tokens = 0.0, 0
        with torch.no_grad():
            for ids in sentences:
                logp = torch.log_softmax(lm(torch.tensor([ids])).logits[0].double(), -1)
                flags = repeat_positions(ids)
                for p in range(len(ids) - 1):
                    if scoring == "all" or flags[p + 1]:
                        loss -= float(logp[p, ids[p + 1]])
                        tokens += 1
        for hook in hooks:
            hook.remove()
        return loss, tokens

    clean, tokens = total(False)
    ablated, _ = total(True)
    return clean / tokens, ablated / tokens, tokens


def eager_attention(loaded, texts):
    """Each sentence's attention, float64, from the model's own eager function, one sentence at a time."""
    model = loaded.model
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        for text in texts:
            ids = loaded.tokenizer(text)["input_ids"]
            with torch.no_grad():
                attentions = model(torch.tensor([ids]), output_attentions=True).attentions
            yield ids, [a[0].double().numpy() for a in attentions]
    finally:
        model.config._attn_implementation = implementation
