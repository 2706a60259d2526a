"""prune.html: a pruning's heads on the (layer, head) grid, coloured by what the search did to each, and the
search's verified loss curve; self-contained like report.html (page.py fills the shell; assets/prune.js draws it
with Plotly). Never imports torch."""

from __future__ import annotations

import bisect
from pathlib import Path

from headscope.report import palette
from headscope.report.page import page_html
from headscope.summary import model_name

KEPT, REMOVED = "kept", "removed"
FULL, WINDOWED, FREED = "full", "windowed, its KV head still full", "windowed, its KV head freed"


def head_states(record: dict, policy: dict | None = None) -> dict[str, list]:
    """Every query head of a pruning, as the page's columns: its layer, head and KV head; its state (zero and mean:
    kept or removed; window mode: full, windowed with its KV head still full because another query head reads it,
    or windowed with its KV head freed); and for a head the search took, its place in the removal order (1 first)
    and the accepted step of the verified curve that took it (1 first) with that step's verified loss."""
    architecture = record["model"]["architecture"]
    layers, heads = architecture["layers"], architecture["heads"]
    group = heads // architecture.get("kv_heads", heads)  # query heads per KV head
    order = {name: rank for rank, name in enumerate(record["heads"], start=1)}
    counts = [step["heads_removed"] for step in record["curve"]]
    columns: dict[str, list] = {name: [] for name in ("layer", "head", "kv_head", "state", "order", "step", "loss")}
    for layer in range(layers):
        freed = policy["layers"][layer]["kv_heads"] if policy is not None else None
        for head in range(heads):
            rank = order.get(f"{layer}.{head}")
            # the first accepted step whose cumulative count covers this head's place in the order
            step = None if rank is None else bisect.bisect_left(counts, rank)
            if rank is None:
                state = KEPT if policy is None else FULL
            elif policy is None:
                state = REMOVED
            else:
                state = FREED if freed[head // group] == "windowed" else WINDOWED
            for name, value in (("layer", layer), ("head", head), ("kv_head", head // group), ("state", state),
                                ("order", rank), ("step", step),
                                ("loss", None if step is None else record["curve"][step]["loss"])):  # fmt: skip
                columns[name].append(value)
    return columns


def prune_page(record: dict, policy: dict | None = None) -> str:
    """The whole prune.html of prune.json's `record` (and, in window mode, kv-policy.json's `policy`)."""
    done = "windowed" if record["mode"] == "window" else "removed"
    title = (f"{model_name(record)}: {len(record['heads'])} of {record['total_heads']} heads {done} "
             f"on {Path(record['corpus']['path']).name}")  # fmt: skip
    states = (FULL, WINDOWED, FREED) if policy is not None else (KEPT, REMOVED)
    data = {
        "title": title,
        "model": model_name(record),
        "mode": record["mode"],
        "window": record.get("window"),
        "budget": record["budget"],
        "clean_loss": record["clean_loss"],
        "pruned_loss": record["pruned_loss"],
        "total_heads": record["total_heads"],
        "curve": record["curve"],
        "search": {key: record["search"][key] for key in ("rounds", "stopped", "candidates", "gradient_passes")},
        "seconds": record["seconds"],
        "heads": head_states(record, policy),
        "states": {state: palette.PRUNING[state] for state in states},
        "policy": None if policy is None else {key: policy[key] for key in ("query_heads", "kv_heads", "memory")},
        "palette": palette.as_dict(),
    }
    return page_html("headscope prune", "prune.html", "prune.js", title, data)
