"""copying(): what each head's weights copy, with no data: the OV copying score of every head (the map and its
gains: measures/ov_circuits.py; the maths: measures/ov_copying.py). analyze's ov_copying column is the same
score, cached per model (interventions/copying_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from headscope.config import RunConfig
from headscope.measures.ov_circuits import ov_copying
from headscope.measures.ov_copying import DEFINITION
from headscope.model.capture import attached
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.progress import Reporter
from headscope.run.setup import CommandRun, record_header
from headscope.summary import model_name


@dataclass
class Copying:
    """What `copying` found: `heads` (layer, head, kv_head, ov_copying) and `record`."""

    heads: pd.DataFrame
    record: dict

    def __repr__(self) -> str:
        return f"Copying(model={model_name(self.record)!r}, {len(self.heads)} heads)"

    def _repr_html_(self) -> str:
        """In a notebook: the heads that copy most and those that suppress most."""
        from headscope.report.notebook import block, facts, table

        ordered = self.heads.sort_values("ov_copying", ascending=False)
        rows = [(r.layer, r.head, f"{r.ov_copying:+.3f}") for r in (*ordered.head(8).itertuples(),
                                                                     *ordered.tail(8).itertuples())]  # fmt: skip
        return block(
            f"headscope copying: {model_name(self.record)}",
            facts(
                [
                    ("score", DEFINITION),
                    ("unembedding", self.record["unembedding"]),
                    ("embedding scale", self.record["embedding_scale"]),
                ]
            ),
            table(["layer", "head", "ov_copying"], rows, caption="the most copying and the most suppressing heads"),
        )

    def to_html(self) -> str:
        return self._repr_html_()


def copying(
    model: str | LoadedModel,
    *,
    tokens: Sequence[int] | None = None,
    config: RunConfig | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Copying:
    """Every head's OV copying score, from the weights alone.

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model (its LM head, where the
            embeddings are not tied).
        tokens: the token ids the OV circuit maps between (default: the whole vocabulary).
        config: the settings as a RunConfig (device, dtype...).
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        A Copying: heads (layer, head, kv_head, ov_copying) and the record.
    """
    run = CommandRun.prepare(model, config=config, options=options, reporter=reporter, reads_corpus=False)
    with run.session(model, loader, what="copying", lm_head="if-present") as opened:
        loaded, plan = opened.loaded, opened.plan
        with attached(loaded.lm or loaded.model) as capture:
            found, where = ov_copying(loaded, capture, plan.architecture, tokens)
    layers, heads = found.shape
    kv_heads = plan.architecture["kv_heads"]
    frame = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                          "kv_head": np.tile(np.arange(heads) // (heads // kv_heads), layers),
                          "ov_copying": found.reshape(-1)})  # fmt: skip
    record = record_header(loaded, run.settings, ("device", "dtype"), None) | {
        "definition": DEFINITION,
        "unembedding": where,
        "tokens": "every token" if tokens is None else len(tokens),
    }
    run.done(opened)
    return Copying(frame, record)
