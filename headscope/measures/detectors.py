"""Detectors a researcher defines: which keys a head "should" attend to from each query row, as a target matrix
P (rows x keys) per sentence, and how much of each row's attention lands there. Pure functions on tensors.

A detector is a built-in family with its parameters, or a Python callable (TransformerLens's `detect_head`
patterns):
    offset:K            P[t, t-K] = 1                          rows t >= K
    same-token          P[t, s] = 1 where token s == token t   (s < t: earlier occurrences of the query's token)
    after-same-token    P[t, s] = 1 where token s-1 == token t (s <= t: the token after each; induction)
    token:REGEX         P[t, s] = 1 where token s's text matches REGEX (re.search), s <= t
    first               P[t, 0] = 1                            (the sentence's first token)
    far:S,W             P[t, s] = 1 where s >= S and t - s >= W (the keys a streaming cache of the first S and the
                        last W drops; rows t >= S + W)
    a callable          tokens -> a (T, T) array P, scored in its mode: `mul` (default) or `abs`
Positions count from the sentence's first token, as everywhere in headscope.

Scores, per head, over the corpus (A the head's attention, rows t of every sentence):
    a family   mean over the rows with at least one target key they may see of sum_s A[t,s] P[t,s];
               chance: the same mean for uniform attention over the keys each row sees (targets / keys)
    mul        sum_t sum_s A[t,s] P[t,s] / sum_t sum_s A[t,s] over every row: TransformerLens's `mul` mode applied
               to the whole corpus at once (for one prompt, exactly its formula, without its rounding)
    abs        1 - sum_t sum_s |A[t,s] - P[t,s]| / rows: TransformerLens's `abs` mode, likewise
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch

from headscope.detector_specs import Detector
from headscope.errors import ConfigError
from headscope.model.attention.key_patterns import NO_REACH


def targets(
    detector: Detector,
    input_ids: torch.Tensor,
    real: torch.Tensor,
    seq_start: torch.Tensor,
    rows: slice,
    keys: int,
    token_text: Callable[[int], str],
    patterns: torch.Tensor | None = None,
) -> torch.Tensor:
    """The detector's target matrix for query rows `rows` of every sentence of a batch and its first `keys` keys:
    (batch, rows, keys) float32, P[b, row, key] in the batch's positions (0 outside each sentence and after each row).

    input_ids, real: (batch, t) ids and bool real-token mask; seq_start: (batch,) first real position;
    token_text(id) -> the text of one token (token:REGEX); patterns: a callable's (batch, t, t) targets
    (`callable_targets`), computed once a batch."""
    batch, device = input_ids.shape[0], input_ids.device
    row = torch.arange(rows.start, rows.stop, device=device)[:, None]  # (rows, 1)
    key = torch.arange(keys, device=device)[None, :]  # (1, keys)
    causal = (key <= row)[None]  # (1, rows, keys): s <= t
    inside = real[:, rows, None] & real[:, None, :keys] & causal  # both in the sentence, the key not after the row
    family = detector.family
    if family == "offset":
        hit = (key == row - detector.parameter)[None]
    elif family == "same-token":
        hit = (input_ids[:, rows, None] == input_ids[:, None, :keys]) & (key < row)[None]
    elif family == "after-same-token":
        before = torch.cat([input_ids.new_full((batch, 1), -1), input_ids[:, : keys - 1]], dim=1)  # token s-1 at s
        after_start = (key > seq_start[:, None])[:, None, :]  # s-1 is in the sentence
        hit = (input_ids[:, rows, None] == before[:, None, :]) & after_start
    elif family == "token":
        hit = _matching_tokens(detector.parameter, input_ids[:, :keys], token_text)[:, None, :]
    elif family == "first":
        hit = (key == seq_start[:, None])[:, None, :]
    elif family == "far":
        sink, window = detector.parameter
        hit = (key >= seq_start[:, None, None] + sink) & (row - key >= window)[None]
    elif family == "callable":
        return patterns[:, rows, :keys] * inside
    else:  # make_detector admits no other
        raise ValueError(f"unknown detector family {family!r}")
    return (hit & inside).float()


def target_classes(
    detector: Detector,
    input_ids: torch.Tensor,
    real: torch.Tensor,
    seq_start: torch.Tensor,
    token_text: Callable[[int], str],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A built-in family's targets on a batch as classes (headscope.model.attention.key_patterns): (key_class,
    row_class, lag), the classes (batch, t) long each, such that key s is a target of row t where key_class[s] ==
    row_class[t] >= 0 and s <= t - lag: exactly `targets`' keys (tested). Keys of no row's target are -1, rows
    without targets -2. A callable has no classes (ValueError)."""
    batch, t = input_ids.shape
    position = torch.arange(t, device=input_ids.device).expand(batch, t)
    starts = seq_start[:, None]
    family = detector.family
    if family == "offset":  # the key at t - K, by its position
        key_class, row_class = position, position - detector.parameter
    elif family in ("same-token", "after-same-token"):
        before = torch.cat([input_ids.new_full((batch, 1), -1), input_ids[:, :-1]], dim=1)  # token s-1 at s
        key_class = input_ids if family == "same-token" else torch.where(position > starts, before, -1)
        row_class = input_ids
    elif family == "token":
        key_class = torch.where(_matching_tokens(detector.parameter, input_ids, token_text), 0, -1)
        row_class = torch.zeros_like(input_ids)
    elif family == "first":
        key_class, row_class = torch.where(position == starts, 0, -1), torch.zeros_like(input_ids)
    elif family == "far":  # every key past the first S, for the rows that have one at least W back
        sink, window = detector.parameter
        key_class = torch.where(position >= starts + sink, 0, -1)
        row_class = torch.where(position >= starts + sink + window, 0, -2)
    else:
        raise ValueError(f"detector family {family!r} has no target classes")
    key_class = torch.where(real & (key_class >= 0), key_class, -1)
    row_class = torch.where(real & (row_class >= 0), row_class, -2)
    return key_class, row_class, _lag(detector)


def kept_classes(
    detector: Detector, input_ids: torch.Tensor, real: torch.Tensor, seq_start: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, int, int]]:
    """far:S,W's complement on a batch: the keys its rows keep, as two patterns of classes (key_class, row_class,
    lag, reach) with `target_classes`' conventions and a reach (key s is a target of row t where t - reach <= s):
    the sentence's first S keys, and its last W keys up to the row's own. On far's rows (t >= S + W) the two are
    disjoint and, with far's own targets, are every key the row sees: so a row's far mass is 1 less their masses,
    read over S + W keys a row where far's own run is as long as the row."""
    if detector.family != "far":
        raise ValueError(f"only far:S,W has kept classes; got {detector.spec!r}")
    sink, window = detector.parameter
    position = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    starts = seq_start[:, None]
    rows = torch.where(real & (position >= starts + sink + window), 0, -2)
    first = torch.where(real & (position < starts + sink), 0, -1)
    recent = torch.where(real, 0, -1)
    return [(first, rows, 0, NO_REACH), (recent, rows, 0, window - 1)]


def _lag(detector: Detector) -> int:
    """How far back a built-in family's targets begin: same-token's are earlier keys, far's at least W back."""
    if detector.family == "far":
        return detector.parameter[1]
    return 1 if detector.family == "same-token" else 0


def _matching_tokens(regex: str, input_ids: torch.Tensor, token_text: Callable[[int], str]) -> torch.Tensor:
    """(batch, t) bool: each token's text matches `regex` (each distinct id decoded once)."""
    ids, where = torch.unique(input_ids, return_inverse=True)
    pattern = re.compile(regex)
    matches = torch.tensor([bool(pattern.search(token_text(int(i)))) for i in ids.tolist()], device=ids.device)
    return matches[where]


def callable_targets(
    detector: Detector, input_ids: torch.Tensor, real: torch.Tensor, seq_start: torch.Tensor, token_strings
) -> torch.Tensor:
    """The callable's (T, T) pattern of each sentence, placed at its positions in the batch: (batch, t, t) float32.
    token_strings(ids) -> the sentence's tokens, as the callable is given them."""
    batch, t = input_ids.shape
    out = torch.zeros(batch, t, t)
    starts, lengths = seq_start.tolist(), real.sum(-1).tolist()
    for b, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        ids = input_ids[b, start : start + length].tolist()
        pattern = detector.pattern(token_strings(ids))
        array = np.asarray(pattern.detach().cpu() if isinstance(pattern, torch.Tensor) else pattern, dtype=np.float32)
        if array.shape != (length, length):
            raise ConfigError(
                f"detector {detector.name!r}: the callable returned a pattern of shape {array.shape} for a sentence "
                f"of {length} tokens; expected ({length}, {length})"
            )
        out[b, start : start + length, start : start + length] = torch.from_numpy(array)
    return out.to(input_ids.device)


def all_row_matches(probs: torch.Tensor, targets: torch.Tensor, detectors) -> torch.Tensor:
    """`row_matches` of every detector, (detectors, batch, heads, rows) float64, from targets (detectors, batch,
    rows, keys): the family and mul detectors in one product per row (one small matrix product, not one each)."""
    product = torch.matmul(probs.transpose(1, 2), targets.permute(1, 2, 3, 0))  # (batch, rows, heads, detectors)
    matches = product.permute(3, 0, 2, 1).double()
    for i, detector in enumerate(detectors):
        if detector.mode == "abs":
            matches[i] = row_matches(probs, targets[i], detector)
    return matches


def row_matches(probs: torch.Tensor, target: torch.Tensor, detector: Detector) -> torch.Tensor:
    """Each row's match with the pattern: sum_s A[t,s] P[t,s] (family, mul) or 1 - sum_s |A[t,s] - P[t,s]| (abs).

    probs: (batch, heads, rows, keys) float32; target: (batch, rows, keys). Returns (batch, heads, rows) float64."""
    if detector.mode == "abs":
        return 1.0 - (probs - target[:, None]).abs().sum(-1, dtype=torch.float64)
    # (batch, rows, heads, keys) @ (batch, rows, keys, 1): one small product per row, not a (heads x keys) temporary
    product = torch.matmul(probs.transpose(1, 2), target[..., None])[..., 0]  # (batch, rows, heads)
    return product.transpose(1, 2).double()
