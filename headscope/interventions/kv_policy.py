"""kv-policy.json: a window-mode pruning as a per-head KV-cache policy, and the memory it can really free
(`policy_record`; the pure counting in `kv_heads_freed`, `cache_bytes` and `kv_policy`).

A windowed query head sees only the sentence's first `sink` keys and its last `window` (interventions/removal.py's
Window). Its KV head can drop the keys in between only if every query head that reads it is windowed: grouped KV
heads (GQA) are shared, so one full query head keeps the whole cache of its KV head. The policy therefore says,
per layer, each query head's keys (`full` or {sink, window}) and each KV head's (`full` or `windowed`), and counts
the memory twice: the query heads windowed, and the KV heads whose cache can really shrink.

The cache of one KV head holds a key and a value vector (2 x head_dim numbers of the model's dtype) per token it
keeps: at a length of T tokens, T for a full head (min(T, w) on a layer the model itself windows at w), and
min(that, sink + window) for a windowed one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from headscope.interventions.removal import Head, Window
from headscope.layout import SCHEMA_VERSION
from headscope.model.architecture import architecture_of, layer_attention, model_max_length
from headscope.model.identity import weights_fingerprint
from headscope.model.placement import dtype_name
from headscope.run.record import versions

if TYPE_CHECKING:
    from headscope.interventions.loss_model import LossModel
    from headscope.interventions.search import PruneResult


def kv_heads_freed(windowed: Iterable[Head], depth: int, heads: int, kv_heads: int) -> list[list[bool]]:
    """Per layer and KV head: can its cache keep only the window? Only if every query head reading it is windowed
    (query head h reads KV head h // (heads // kv_heads), as transformers' repeat_kv lays them out)."""
    windowed, group = set(windowed), heads // kv_heads
    return [
        [all((layer, kv * group + j) in windowed for j in range(group)) for kv in range(kv_heads)]
        for layer in range(depth)
    ]


def cache_bytes(
    freed: Sequence[Sequence[bool]], tokens: int, window: Window, own_windows: Sequence[int | None], per_token: int
) -> tuple[int, int]:
    """(full attention's, the policy's) KV-cache bytes at `tokens` tokens: per layer and KV head, the tokens it keeps
    times `per_token` (2 x head_dim x the dtype's bytes). own_windows: per layer, the model's own sliding window (None:
    full attention)."""
    full = policy = 0
    for layer, kv_row in enumerate(freed):
        own = tokens if own_windows[layer] is None else min(tokens, own_windows[layer])
        for is_freed in kv_row:
            full += own * per_token
            policy += (min(own, window.sink + window.size) if is_freed else own) * per_token
    return full, policy


def kv_policy(
    windowed: Sequence[Head], *, depth: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
    own_windows: Sequence[int | None], window: Window, lengths: dict[str, int],
) -> dict:  # fmt: skip
    """The policy's body (what kv-policy.json holds besides the model, its fingerprint and the loss): each layer's
    query and KV heads, the counts, and the memory at each of `lengths` (name -> tokens)."""
    chosen = set(windowed)
    freed = kv_heads_freed(chosen, depth, heads, kv_heads)
    kept = {"sink": window.sink, "window": window.size}
    layers = [
        {
            "layer": layer,
            "own_window": own_windows[layer],
            "heads": [kept if (layer, head) in chosen else "full" for head in range(heads)],
            "kv_heads": ["windowed" if is_freed else "full" for is_freed in freed[layer]],
        }
        for layer in range(depth)
    ]
    per_token = 2 * head_dim * dtype_bytes
    memory = {}
    for name, tokens in lengths.items():
        full, policy = cache_bytes(freed, tokens, window, own_windows, per_token)
        memory[name] = {"tokens": tokens, "full_bytes": full, "policy_bytes": policy,
                        "freed_share": 1 - policy / full if full else 0.0}  # fmt: skip
    freed_count = sum(map(sum, freed))
    return {
        "sink": window.sink,
        "window": window.size,
        "query_heads": {"windowed": len(chosen), "total": depth * heads, "share": len(chosen) / (depth * heads)},
        "kv_heads": {"windowed": freed_count, "total": depth * kv_heads, "share": freed_count / (depth * kv_heads)},
        "memory": memory,
        "layers": layers,
    }


def policy_record(lm: LossModel, result: PruneResult, window: Window) -> dict:
    """kv-policy.json: the model, its weights' fingerprint, the windowed heads as a per-head policy with the loss it
    was verified at, and the KV memory it keeps at the corpus's longest text and at the model's context length."""
    loaded, plan = lm.loaded, lm.plan
    architecture = architecture_of(loaded.model.config)
    longest = max((len(ids) for index in range(len(lm.feed)) for ids in lm.feed.chunk(index).ids), default=0)
    lengths = {"longest_text": longest}
    context = model_max_length(loaded.model.config)
    if context is not None:
        lengths["context_length"] = context
    body = kv_policy(
        result.heads, depth=plan.depth, heads=plan.heads, kv_heads=architecture["kv_heads"],
        head_dim=architecture["head_dim"], dtype_bytes=loaded.dtype.itemsize, window=window, lengths=lengths,
        own_windows=[size if kind == "sliding" else None for kind, size in layer_attention(loaded.model.config)],
    )  # fmt: skip
    loss = {"clean": result.clean_loss, "verified": result.loss, "delta": result.loss - result.clean_loss,
            "budget": result.budget}  # fmt: skip
    return {"schema_version": SCHEMA_VERSION, "model": {"input": loaded.source.display, "name": loaded.source.name},
            "weights_sha256": weights_fingerprint(loaded.model), "dtype": dtype_name(loaded.dtype), "loss": loss,
            **body, "versions": versions()}  # fmt: skip
