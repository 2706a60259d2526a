"""Report folders with made-up tables of any shape, for the code that only reads reports (charts, page)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from headscope.columns import STATS
from headscope.config import RoleThresholds, Thresholds
from headscope.labels import label_heads
from headscope.layout import RUN_FILE
from headscope.tables import (
    EXAMPLES_SCHEMA,
    EXEMPLARS_SCHEMA,
    HEADS_SCHEMA,
    LAYERS_SCHEMA,
    heads_frame,
    layers_frame,
    write_json,
    write_table,
)


def synthetic_report(folder, layers: int, heads: int, example_tokens: int = 0, exemplars: int = 0):
    """A report folder with made-up heads and layers tables of the given shape (no model); with `example_tokens`
    an example sentence of that many tokens with every head's (causal) attention on it; with `exemplars` that many
    made-up exemplars per head and kind, each with a context of 9 tokens (a real corpus's mean)."""
    rng = np.random.default_rng(layers * 100 + heads)
    n = layers * heads
    sums = np.zeros((layers, heads, len(STATS)))  # every measured column, then overwritten with made-up values
    frame = heads_frame(sums, heads, intervals=None, probes=None)
    made_up = {
        "n_rows": 1000,
        "entropy": rng.uniform(0, 2.5, n) * np.linspace(1, 0.4, n),
        "entropy_std": rng.uniform(0, 0.5, n),
        "norm_entropy": rng.uniform(0, 1, n),
        "diagonal": rng.uniform(0.3, 1, n),
        "diagonal_uniform": np.full(n, 0.4),
        "sink": rng.uniform(0, 1, n),
        "prev_token": rng.uniform(0, 1, n),
        "max_weight": rng.uniform(0, 1, n),
        "sink_rate": rng.uniform(0, 1, n),
        "top_offset": rng.choice(["first", "0", "1", "2", "other"], n),
        "top_offset_share": rng.uniform(0, 1, n),
    }
    for pattern in ("induction", "duplicate", "previous"):
        made_up[f"probe_{pattern}"] = rng.uniform(0, 1, n) ** 4
        made_up[f"probe_{pattern}_chance"] = 0.02
    for name, values in made_up.items():
        frame[name] = values
    labelled = label_heads(frame, Thresholds(), RoleThresholds())
    folder.mkdir()
    write_table(labelled, folder / "heads.parquet", HEADS_SCHEMA)
    write_table(
        layers_frame(labelled, None, (("full", None),) * (int(labelled["layer"].max()) + 1)),
        folder / "layers.parquet",
        LAYERS_SCHEMA,
    )
    run = {"model": {"input": f"synthetic-{layers}x{heads}"}, "corpus": {"path": "c.txt", "sentences": 10}}
    write_json(run, folder / RUN_FILE)
    if example_tokens:
        write_table(made_up_examples(rng, layers, heads, example_tokens), folder / "examples.parquet", EXAMPLES_SCHEMA)
    if exemplars:
        write_table(made_up_exemplars(rng, layers, heads, exemplars), folder / "exemplars.parquet", EXEMPLARS_SCHEMA)


def made_up_exemplars(rng, layers: int, heads: int, count: int) -> pd.DataFrame:
    kinds = ("sharp", "write", "induction", "duplicate", "previous")
    layer, head, kind, rank = (a.ravel() for a in np.indices((layers, heads, len(kinds), count)))
    n = len(layer)
    row = rng.integers(6, 60, n)
    words = np.array([f"w{i}" for i in range(500)])
    return pd.DataFrame(
        {
            "layer": layer,
            "head": head,
            "kind": np.array(kinds)[kind],
            "rank": rank + 1,
            "sentence": rng.integers(0, 10_000, n),
            "row": row,
            "key": row - 1,
            "weight": rng.uniform(0, 1, n),
            "score": rng.uniform(0, 1, n),
            "query_token": words[rng.integers(0, 500, n)],
            "key_token": words[rng.integers(0, 500, n)],
            "context_start": row - 5,
            "context": list(words[rng.integers(0, 500, (n, 9))]),
        }
    )


def made_up_examples(rng, layers: int, heads: int, tokens: int) -> pd.DataFrame:
    query, key = (a.ravel() for a in np.tril_indices(tokens))
    weights = np.tril(rng.uniform(0, 1, (layers * heads, tokens, tokens)))
    weights /= weights.sum(axis=-1, keepdims=True)
    layer, head = np.divmod(np.arange(layers * heads), heads)
    words = [f"w{i}" for i in range(tokens)]
    pairs = len(query)
    return pd.DataFrame(
        {
            "source": "corpus",
            "sentence_id": 0,
            "layer": np.repeat(layer, pairs),
            "head": np.repeat(head, pairs),
            "query": np.tile(query, layers * heads),
            "key": np.tile(key, layers * heads),
            "query_token": np.tile(np.array(words)[query], layers * heads),
            "key_token": np.tile(np.array(words)[key], layers * heads),
            "weight": weights[:, query, key].ravel(),
        }
    )
