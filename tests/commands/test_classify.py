"""The head-type rule on synthetic per-head tables and on exact attention patterns of every length."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from headscope.config import Thresholds
from headscope.errors import ConfigError
from headscope.labels import HEAD_TYPES, classify_heads, label_counts, most_typical
from headscope.measures.row_sums import head_row_sums
from headscope.model.batch import collate
from headscope.model.masks import causal_visible_keys
from headscope.tables import heads_frame

DEFAULT = Thresholds()


def table(**columns) -> pd.DataFrame:
    n = len(next(iter(columns.values())))
    base = {"layer": [0] * n, "head": list(range(n)), "diagonal_uniform": [0.5] * n}
    return pd.DataFrame({**base, **columns})


def labels(frame: pd.DataFrame, thresholds: Thresholds = DEFAULT) -> list[str]:
    return classify_heads(frame, thresholds)["head_type"].tolist()


def test_every_branch():
    # locality = (diagonal - 0.5) / 0.5
    frame = table(diagonal=[0.9, 0.5, 0.5, 0.5], norm_entropy=[0.5, 0.1, 0.9, 0.5])
    assert labels(frame) == ["local", "copy", "broad", "mixed"]


def test_locality_is_checked_before_entropy():
    # A sharply peaked previous-token head: low entropy *and* high locality. It is local, not copy.
    frame = table(diagonal=[1.0], norm_entropy=[0.05])
    result = classify_heads(frame, DEFAULT)
    assert result["head_type"].tolist() == ["local"]
    assert result["type_reason"].iloc[0] == "locality 1.000 >= 0.5"


def test_threshold_edges_are_inclusive():
    frame = table(diagonal=[0.75, 0.5, 0.5], norm_entropy=[0.5, 0.3, 0.7])  # locality 0.5 exactly
    assert labels(frame) == ["local", "copy", "broad"]
    just_outside = table(diagonal=[0.7499, 0.5, 0.5], norm_entropy=[0.5, 0.3001, 0.6999])
    assert labels(just_outside) == ["mixed", "mixed", "mixed"]


def test_changed_thresholds_change_labels():
    frame = table(diagonal=[0.5, 0.5], norm_entropy=[0.4, 0.65])
    assert labels(frame) == ["mixed", "mixed"]
    assert labels(frame, Thresholds(copy_max_norm_entropy=0.45, broad_min_norm_entropy=0.6)) == ["copy", "broad"]


def test_no_room_for_locality_means_not_local():
    # Sentences of at most window + 1 tokens: uniform attention fills the band, locality is undefined.
    frame = table(diagonal=[1.0], norm_entropy=[0.9])
    frame["diagonal_uniform"] = 1.0
    result = classify_heads(frame, DEFAULT)
    assert np.isnan(result["locality"].iloc[0])
    assert result["head_type"].tolist() == ["broad"]


def test_input_is_not_modified():
    frame = table(diagonal=[0.9], norm_entropy=[0.5])
    before = frame.copy()
    classify_heads(frame, DEFAULT)
    pd.testing.assert_frame_equal(frame, before)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"copy_max_norm_entropy": 0.8, "broad_min_norm_entropy": 0.7},
        {"copy_max_norm_entropy": -0.1},
        {"broad_min_norm_entropy": 1.5},
        {"local_min_locality": 2.0},
    ],
)
def test_bad_thresholds_are_refused(kwargs):
    with pytest.raises(ConfigError, match="--"):
        Thresholds(**kwargs)


def pattern_metrics(n: int, pattern: str) -> pd.DataFrame:
    """The heads table a single head with an exact pattern gives on one n-token sentence."""
    attn = torch.zeros(n, n)
    for t in range(n):
        if pattern == "uniform":
            attn[t, : t + 1] = 1.0 / (t + 1)
        elif pattern == "previous":
            attn[t, max(t - 1, 0)] = 1.0
        elif pattern == "first":
            attn[t, 0] = 1.0
    batch = collate([0], [[1] * n])
    sums = head_row_sums(
        attn[None, None],
        key_visible=causal_visible_keys(batch.attention_mask.bool()),
        query_valid=batch.attention_mask.bool(),
        seq_start=batch.seq_start,
        window=2,
    )
    return heads_frame(sums.numpy()[None, 0], kv_heads=1)


@pytest.mark.parametrize("n", range(5, 41))
def test_types_do_not_flip_with_sentence_length(n):
    assert labels(pattern_metrics(n, "uniform")) == ["broad"]
    assert labels(pattern_metrics(n, "previous")) == ["local"]
    assert labels(pattern_metrics(n, "first")) == ["copy"]


def test_most_typical_and_counts():
    frame = table(diagonal=[0.9, 1.0, 0.5, 0.5, 0.5, 0.5], norm_entropy=[0.5, 0.5, 0.2, 0.05, 0.95, 0.5])
    frame["layer"] = [0, 0, 0, 1, 1, 1]
    classified = classify_heads(frame, DEFAULT)
    assert most_typical(classified, DEFAULT) == {"local": (0, 1), "copy": (1, 3), "broad": (1, 4), "mixed": (1, 5)}
    counts = label_counts(classified, "head_type", HEAD_TYPES, {"first": range(0, 1), "second": range(1, 2)})
    assert counts.columns.tolist() == list(HEAD_TYPES)
    assert counts.loc["first"].tolist() == [2, 1, 0, 0]
    assert counts.loc["second"].tolist() == [0, 1, 1, 1]
