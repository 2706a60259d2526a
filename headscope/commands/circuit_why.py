"""circuit --why N: why the heads the N strongest q and k edges feed attend, at each pair's END row, to each role's
token, clean against corrupt: which senders move that attention (docs/why.md has the split, docs/circuit.md the
command).

the heads     a q edge's receiver L.H; a k edge's receiver L.kvG stands for every query head reading that KV head
the split     each pair's clean and corrupt prompt run alone through inspect's sender pass (interventions.qk_senders);
              at END, each marked role's token as the key: its weight, and the contrast of every (query sender, key
              sender) pair (why_rows.explain), summed per side
the output    why.parquet: layer, head, role, side, sender, clean, corrupt, change (clean - corrupt), each the mean over
              pairs of that sender's side of the contrast; circuit.json `why`: per head and role the weights and
              contrasts, clean and corrupt, and the senders that move the contrast most on each side
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from headscope.commands import why_rows
from headscope.errors import ConfigError
from headscope.interventions.pairs import END_ROLE, TokenizedPair
from headscope.interventions.qk_senders import SenderPass
from headscope.measures.heads import HeadAttention, by_layer

RUNS = ("clean", "corrupt")


def check_count(why: int) -> None:
    """Before anything loads: --why N takes a whole number of edges, 0 (none) or more."""
    if why < 0:
        raise ConfigError(f"--why takes how many of the strongest q and k edges to explain, 0 or more; got {why}")


def check_roles(why: int, roles: list[str]) -> None:
    """Once the pairs are tokenized (before the weights load): --why needs roles marked besides END."""
    if why and not [role for role in roles if role != END_ROLE]:
        raise ConfigError("--why explains attention to each role's token: the pairs must mark roles, as "
                          "[[IO:Mary]] and [[S1:John]] in corpora/ioi-pairs-roles.jsonl")  # fmt: skip


def explained_heads(edges: pd.DataFrame, count: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """The query heads the `count` strongest q and k edges feed (by |score|), in layer order: a q edge's receiver,
    and every query head reading a k edge's KV head."""
    qk = edges[edges["channel"].isin(["q", "k"])]
    strongest = qk.reindex(qk["score"].abs().sort_values(ascending=False, kind="stable").index).head(count)
    group = heads // kv_heads
    found = set()
    for receiver in strongest["receiver"]:
        layer, part = receiver.split(".")
        if part.startswith("kv"):
            found |= {(int(layer), int(part[2:]) * group + h) for h in range(group)}
        else:
            found.add((int(layer), int(part)))
    return sorted(found)


def explain_pairs(capture, loaded, plan, pairs: list[TokenizedPair], heads: list[tuple[int, int]],
                  roles: list[str]) -> tuple[pd.DataFrame, list[dict]]:  # fmt: skip
    """why.parquet's rows and circuit.json's entries: for each head, at each pair's END row, each role's token as
    the key, on the clean and the corrupt prompt, each run alone."""
    keyed = [role for role in roles if role != END_ROLE]
    splitter = SenderPass(capture, loaded, plan)
    sums: dict[tuple, np.ndarray] = {}  # (layer, head, role, run, side) -> each sender's side, summed over pairs
    figures: dict[tuple, np.ndarray] = {}  # (layer, head, role, run) -> (weight, contrast) summed over pairs
    names: dict[tuple[int, int], list[str]] = {}
    for pair in pairs:
        end = pair.positions[END_ROLE]
        asked = [(end, pair.positions[role]) for role in keyed]
        for run, ids in zip(RUNS, (pair.clean_ids, pair.corrupt_ids), strict=True):
            keeper = HeadAttention(by_layer(heads))
            kept, rotation = splitter.run(plan.collate([0], [ids], loaded.device), [keeper])
            attention, visible = keeper.finish()
            for (layer, head), matrix in attention.items():
                senders = splitter.senders(kept, rotation, layer, head)
                names[(layer, head)] = senders.names
                explained = [terms for block in why_rows.explain(senders, matrix, visible[layer], asked)
                             for terms in block]  # fmt: skip
                for role, terms in zip(keyed, explained, strict=True):
                    for side, axis in (("query", 1), ("key", 0)):
                        key = (layer, head, role, run, side)
                        sums[key] = sums.get(key, 0) + terms.contrast.sum(axis)
                    key = (layer, head, role, run)
                    figures[key] = figures.get(key, 0) + np.array([terms.weight, terms.contrast.sum()])
            del kept, rotation
    count = len(pairs)
    frames, entries = [], []
    for layer, head in heads:
        sender_names = names[(layer, head)]
        for role in keyed:
            for side in ("query", "key"):
                clean, corrupt = (sums[(layer, head, role, run, side)] / count for run in RUNS)
                frames.append(pd.DataFrame({"layer": layer, "head": head, "role": role, "side": side,
                                            "sender": sender_names, "clean": clean, "corrupt": corrupt,
                                            "change": clean - corrupt}))  # fmt: skip
            (weight_clean, contrast_clean), (weight_corrupt, contrast_corrupt) = (
                figures[(layer, head, role, run)] / count for run in RUNS
            )
            entries.append({
                "layer": layer, "head": head, "role": role,
                "weight": {"clean": float(weight_clean), "corrupt": float(weight_corrupt)},
                "contrast": {"clean": float(contrast_clean), "corrupt": float(contrast_corrupt)},
                **{f"{side}_moved": why_rows.strongest(sender_names, _change(sums, (layer, head, role), side, count))
                   for side in ("query", "key")},
            })  # fmt: skip
    return pd.concat(frames, ignore_index=True), entries


def _change(sums: dict, at: tuple, side: str, count: int) -> np.ndarray:
    """Each sender's side of the contrast, clean minus corrupt, mean over pairs."""
    return (sums[(*at, "clean", side)] - sums[(*at, "corrupt", side)]) / count
