"""analyze's ov_copying column: every head's OV copying score (measures/ov_circuits.py), cached per model.

The cache: one small JSON file per model under the cache folder (files.cache_folder: $HEADSCOPE_CACHE, else
$XDG_CACHE_HOME/headscope, else ~/.cache/headscope), named by a sha256 of the weights' fingerprint (run.json's
weights_sha256), the unembedding's bytes where it is not the tied embeddings, and CACHE_VERSION. The same weights
loaded again, from any folder, read it back; any edit of any weight misses it. Written under a temporary name,
then renamed: concurrent runs never read half a file.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from headscope.errors import ConfigError, HeadscopeError, OutputError, one_line
from headscope.files import atomic_path, cache_folder
from headscope.measures.ov_circuits import ov_copying, unembedding
from headscope.measures.ov_copying import DEFINITION
from headscope.model.identity import parameter_digest, weights_fingerprint
from headscope.model.loading import LoadedModel

CACHE_VERSION = 1  # bumped when the score's computation changes: every cached score is computed again


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
