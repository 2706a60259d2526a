"""copying(): what each head's weights copy, with no data: the OV copying score of every head (the map and its
gains: interventions/ov_circuits.py; the maths: measures/ov_copying.py). analyze's ov_copying column is the same
score, cached per model (`cached_copying`).

The cache: one small JSON file per model under the cache folder (files.cache_folder: $HEADSCOPE_CACHE, else
$XDG_CACHE_HOME/headscope, else ~/.cache/headscope), named by a sha256 of the weights' fingerprint (run.json's
weights_sha256), the unembedding's bytes where it is not the tied embeddings, and CACHE_VERSION. The same weights
loaded again, from any folder, read it back; any edit of any weight misses it. Written under a temporary name,
then renamed: concurrent runs never read half a file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from headscope.config import RunConfig
from headscope.errors import ConfigError, HeadscopeError, OutputError, one_line
from headscope.files import atomic_path, cache_folder
from headscope.interventions.ov_circuits import ov_copying, unembedding
from headscope.measures.ov_copying import DEFINITION
from headscope.model.capture import attached
from headscope.model.identity import parameter_digest, weights_fingerprint
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.progress import Reporter
from headscope.run.setup import CommandRun, record_header
from headscope.summary import model_name

CACHE_VERSION = 1  # bumped when the score's computation changes: every cached score is computed again


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


def cached_copying(loaded: LoadedModel, capture, architecture: dict) -> tuple[np.ndarray | None, str]:
    """(layers, heads) copying scores of every layer on the whole vocabulary, from the cache when these weights were
    scored before; or (None, why not): no unembedding, weights not all in memory (offloaded to disk), or an
    attention or norm whose OV circuit headscope cannot read (interventions.edge_layers)."""
    fingerprint = weights_fingerprint(loaded.model)
    try:
        unembed, where = unembedding(loaded)
    except ConfigError as err:
        return None, str(err)
    if fingerprint is None or unembed.device.type == "meta":
        return None, "some weights are offloaded to disk (a device map): they are not in memory to score"
    tied = unembed.data_ptr() == (loaded.lm or loaded.model).get_input_embeddings().weight.data_ptr()
    key = hashlib.sha256(f"{CACHE_VERSION}|{fingerprint}|".encode() + (b"tied" if tied else parameter_digest(unembed)))
    path = cache_folder() / "ov_copying" / f"{key.hexdigest()}.json"
    cached = _read_cached(path, architecture)
    if cached is not None:
        return cached, f"{where}, cached ({path})"
    try:
        scores, where = ov_copying(loaded, capture, architecture)
    except HeadscopeError as err:  # an attention or a norm the OV circuit cannot be read from: the column stays NaN
        return None, one_line(err)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as temporary:
            temporary.write_text(json.dumps({"definition": DEFINITION, "scores": scores.tolist()}))
    except (OSError, OutputError):  # a cache folder that cannot be written costs the next run the computation, no more
        pass
    return scores, where


def _read_cached(path, architecture: dict) -> np.ndarray | None:
    """The cached scores, or None when there are none or they are not of this model's shape (a damaged file)."""
    try:
        scores = np.array(json.loads(path.read_text())["scores"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return scores if scores.shape == (architecture["layers"], architecture["heads"]) else None
