"""Exemplars: the corpus rows where each head does its thing most, streamed.

For every (layer, head, kind) the `count` query rows of the corpus with the highest score are kept; the kinds are
    sharp      the row's largest attention weight off the sentence's first token
    write      the row's write norm ||W_h z_h(t)||, as the write statistics measure it (measures.writes)
    <name>     a probe's or detector's match on the row (measures.detectors): induction, duplicate and previous
               are the probes' patterns read on corpus text (after-same-token, same-token, offset:1)
Each kept row records its sentence (corpus id), row (position from the sentence's first token), a key and its
weight: for sharp and write the row's most attended key off the first token, for a pattern the target key it
attends to most. Equal scores go to the earlier sentence, then the earlier row, so merging batches, checkpoints or
ranks keeps what one sort of every row would. (The same row computed in a batch of another shape scores the same only
within float32 rounding: docs/exemplars.md says what holds across batchings.)

The state is fixed in size, (layers, kinds, heads, count, fields) float64 (`STATE_FIELDS`), whatever the corpus: it
checkpoints and gathers across ranks like the sums. A batch's candidates are found on its device (a top-k per head
and every row tied with the k-th), then merged into the state on the host: the offers of a batch's layers together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from headscope.columns import EVIDENCE_FROM

SHARP, WRITE = "sharp", "write"
# The probes' patterns, read on the corpus as detectors (measures.detectors SPECs).
PROBE_KINDS = {"induction": "after-same-token", "duplicate": "same-token", "previous": "offset:1"}
STATE_FIELDS = ("score", "sentence", "row", "key", "weight")


def evidence_rows(first_row: int, rows: int, seq_start: torch.Tensor) -> torch.Tensor:
    """(batch, rows) bool: the rows of a block (query positions first_row, first_row + 1, ...) at EVIDENCE_FROM or
    after in their sentence, the rows every kind counts (earlier rows see so few keys that any head is sharp
    there), as top_offset counts its evidence."""
    positions = torch.arange(first_row, first_row + rows, device=seq_start.device)
    return positions[None, :] - seq_start[:, None] >= EVIDENCE_FROM


def empty_state(layers: int, kinds: int, heads: int, count: int) -> np.ndarray:
    """No row kept yet: every score -inf, every sentence -1."""
    state = np.zeros((layers, kinds, heads, count, len(STATE_FIELDS)))
    state[..., 0] = -np.inf
    state[..., 1] = -1
    return state


# Scores (kinds x batch x heads x rows) whose offers wait to be taken together: a batch's offers (every layer's, every
# measure's) are some ten small tensor operations each whatever their size, more than their arithmetic on short
# sentences, so they wait and go through those operations once (or when this many wait: a few MiB, whatever the depth).
WAITING_SCORES = 2**20


@dataclass(frozen=True)
class _Offer:
    """One offer waiting (TopRows.offer's arguments, `groups` the (layer, kind) of each of its kinds)."""

    groups: torch.Tensor  # (kinds,) long: layer index x kinds + kind index, into the state
    scores: torch.Tensor  # (kinds, batch, heads, rows)
    counted: torch.Tensor  # broadcastable to it
    keys: torch.Tensor
    weights: torch.Tensor
    sentence_ids: Sequence[int]
    seq_start: torch.Tensor
    first_row: int


class TopRows:
    """The `count` strongest rows of every (layer, head, kind) offered so far.

    kinds: the exemplar kinds in order; layers: the measured layers (the state's first axis follows them). Offers
    wait to be taken together (`WAITING_SCORES`); reading `state` takes the waiting ones first.
    """

    def __init__(self, count: int, kinds: Sequence[str], layers: Sequence[int], heads: int, state=None) -> None:
        self.count, self.kinds, self.heads = count, tuple(kinds), heads
        self.layer_index = {layer: i for i, layer in enumerate(layers)}
        self.kind_index = {kind: i for i, kind in enumerate(self.kinds)}
        self._state = empty_state(len(self.layer_index), len(self.kinds), heads, count) if state is None else state
        self._waiting: list[_Offer] = []
        self._waiting_scores = 0

    @property
    def state(self) -> np.ndarray:
        """(layers, kinds, heads, count, fields) float64: the kept rows, every offer taken."""
        self.flush()
        return self._state

    @state.setter
    def state(self, state: np.ndarray) -> None:
        self.flush()
        self._state = state

    def offer(
        self,
        layer: int,
        kinds: Sequence[str],
        scores: torch.Tensor,
        counted: torch.Tensor,
        keys: torch.Tensor,
        weights: torch.Tensor,
        *,
        sentence_ids: Sequence[int],
        seq_start: torch.Tensor,
        first_row: int = 0,
    ) -> None:
        """A block of rows' scores for the `kinds` a measure scores together, (kinds, batch, heads, rows), with
        `counted` (broadcastable to it) the rows that count, and each row's key (batch positions, long) and its
        weight, broadcastable too; or `keys` a function (kind, b, head, r) -> (key, weight) of the candidate rows
        alone, for keys that cost a pass over every key to find (`weights` None; taken at once, not waiting). Rows
        query positions first_row, first_row + 1, ..."""
        n, batch, _, rows = scores.shape
        if batch == 0 or rows == 0 or n == 0:
            return
        at = self.layer_index[layer] * len(self.kinds)
        groups = torch.tensor([at + self.kind_index[kind] for kind in kinds])
        waiting = _Offer(groups, scores, counted, keys, weights, sentence_ids, seq_start, first_row)
        if callable(keys):
            self._take([waiting])
            return
        self._waiting.append(waiting)
        self._waiting_scores += scores.numel()
        if self._waiting_scores >= WAITING_SCORES:
            self.flush()

    def flush(self) -> None:
        """Take the waiting offers: those of one block shape (a batch's layers) together."""
        waiting, self._waiting, self._waiting_scores = self._waiting, [], 0
        alike: dict[tuple, list[_Offer]] = {}
        for offer in waiting:
            shape = (*offer.scores.shape[1:], offer.first_row, id(offer.seq_start), offer.scores.device)
            alike.setdefault(shape, []).append(offer)
        for offers in alike.values():
            self._take(offers)

    def _take(self, offers: list[_Offer]) -> None:
        """Offers of one block shape and batch, their candidates found on the device (a top-k per group and every
        row tied with the k-th) and merged into the state on the host."""
        first = offers[0]
        _, batch, heads, rows = first.scores.shape
        shape = lambda offer, x: x.expand(len(offer.groups), batch, heads, rows)  # noqa: E731
        scores = torch.cat([offer.scores.double() for offer in offers])
        counted = torch.cat([shape(offer, offer.counted) for offer in offers]) & torch.isfinite(scores)
        n = scores.shape[0]
        # one group per (layer, kind, head), its rows over the whole batch
        flat = torch.where(counted, scores, -torch.inf).transpose(1, 2).reshape(n * heads, batch * rows)
        groups = torch.cat([offer.groups for offer in offers])  # (n,) into the state's (layers x kinds)
        state = self._state.reshape(-1, heads, self.count, len(STATE_FIELDS))
        # A row below the weakest kept one (when `count` are kept) cannot get in: most batches offer few rows.
        weakest = torch.from_numpy(state[groups.numpy(), :, -1, 0].reshape(n * heads, 1)).to(flat.device)
        above = (flat >= weakest) & (flat > -torch.inf)
        if int(above.sum(-1).max()) > self.count:  # more than a group keeps: only those at or above its k-th go on
            kth = flat.topk(min(self.count, batch * rows), dim=-1).values[:, -1:]
            above &= flat >= kth  # ties at the border all go on, and the merge picks among them
        group, where = torch.nonzero(above, as_tuple=True)
        if group.numel() == 0:
            return
        b, r = where // rows, where % rows
        row_kind, head = group // heads, group % heads
        if callable(first.keys):  # a lone offer whose keys are found for the candidates alone
            key, weight = first.keys(row_kind, b, head, r)
        else:
            key = torch.cat([shape(offer, offer.keys) for offer in offers])[row_kind, b, head, r]
            weight = torch.cat([shape(offer, offer.weights) for offer in offers])[row_kind, b, head, r]
        seq_start = first.seq_start
        # to the host in two transfers (each one waits for an accelerator)
        numbers = torch.stack([flat[group, where], weight.double()]).cpu().numpy()
        ids = torch.stack([key - seq_start[b], first.first_row + r - seq_start[b], b, row_kind, head]).cpu().numpy()
        picked = {"score": numbers[0], "weight": numbers[1], "key": ids[0], "row": ids[1],
                  "sentence": np.asarray(first.sentence_ids, dtype=np.int64)[ids[2]],
                  "group": groups.numpy()[ids[3]] * heads + ids[4]}  # fmt: skip
        self._merge(picked)

    def _merge(self, new: dict[str, np.ndarray]) -> None:
        """The kept rows and the `new` ones ("group": (layer index x kinds + kind index) x heads + head, into the
        state), the strongest `count` of each group they touch kept."""
        count = self.count
        state = self._state.reshape(-1, count, len(STATE_FIELDS))  # (groups, count, fields), a view
        touched = np.unique(new["group"])
        old = state[touched].reshape(len(touched) * count, -1)
        live = old[:, 1] >= 0
        group = np.concatenate([np.repeat(touched, count)[live], new["group"]])
        fields = {name: np.concatenate([old[live, i], new[name]]) for i, name in enumerate(STATE_FIELDS)}
        order = np.lexsort((fields["row"], fields["sentence"], -fields["score"], group))
        group = group[order]
        starts = np.searchsorted(group, touched)
        rank = np.arange(len(group)) - starts[np.searchsorted(touched, group)]
        keep = rank < count
        fresh = empty_state(1, 1, len(touched), count)[0, 0]  # (touched, count, fields)
        slot = np.searchsorted(touched, group[keep])
        for i, name in enumerate(STATE_FIELDS):
            fresh[slot, rank[keep], i] = fields[name][order][keep]
        state[touched] = fresh


def merged_states(states: Sequence[np.ndarray], kinds: Sequence[str], layers: Sequence[int]) -> np.ndarray:
    """Several ranks' (or runs') states as one: the strongest rows of them all, ties as one run breaks them."""
    first = states[0]
    top = TopRows(first.shape[3], kinds, layers, first.shape[2], state=first.copy())
    for state in states[1:]:
        rows = state.reshape(-1, len(STATE_FIELDS))
        live = rows[:, 1] >= 0
        new = {name: rows[live, i] for i, name in enumerate(STATE_FIELDS)}
        new["group"] = np.repeat(np.arange(state.shape[0] * state.shape[1] * state.shape[2]), state.shape[3])[live]
        if live.any():
            top._merge(new)
    return top.state


def exemplar_frame(state: np.ndarray, kinds: Sequence[str], layers: Sequence[int]) -> pd.DataFrame:
    """exemplars.parquet: one row per kept row, by layer, head, kind (in `kinds` order) and rank (1 = strongest)."""
    n_layers, n_kinds, heads, count, _ = state.shape
    index = np.indices((n_layers, n_kinds, heads, count)).reshape(4, -1)
    flat = state.reshape(-1, len(STATE_FIELDS))
    live = flat[:, 1] >= 0
    layer, kind, head, rank = (axis[live] for axis in index)
    frame = pd.DataFrame(
        {
            "layer": np.asarray(layers, dtype=np.int64)[layer],
            "head": head.astype(np.int64),
            "kind": pd.Categorical(np.asarray(kinds, dtype=object)[kind], categories=list(kinds)),
            "rank": (rank + 1).astype(np.int64),
            "sentence": flat[live, 1].astype(np.int64),
            "row": flat[live, 2].astype(np.int64),
            "key": flat[live, 3].astype(np.int64),
            "weight": flat[live, 4].astype(np.float32),
            "score": flat[live, 0],
        }
    )
    return frame.sort_values(["layer", "head", "kind", "rank"], ignore_index=True)


# Tokens kept around each exemplar for the page: a few before the earlier of its query and key, two after the
# query; a key further back than FAR_KEY is shown alone (key_token) and the context runs from the query back.
CONTEXT_BEFORE, CONTEXT_AFTER, FAR_KEY, FAR_CONTEXT = 4, 2, 40, 16


def with_context(frame: pd.DataFrame, tokens: dict[int, list[str]]) -> pd.DataFrame:
    """The exemplars with their query's and key's tokens, and a window of the sentence around them (context, from
    position context_start). tokens: sentence id -> the sentence's tokens as text."""
    row, key = frame["row"].to_numpy(), frame["key"].to_numpy()
    near = (key >= 0) & (row - key <= FAR_KEY)
    starts = np.maximum(0, np.where(near, np.minimum(row, key) - CONTEXT_BEFORE, row - FAR_CONTEXT))
    texts = [tokens[sentence] for sentence in frame["sentence"].tolist()]
    rows, keys, begins = row.tolist(), key.tolist(), starts.tolist()
    contexts = [text[start : at + CONTEXT_AFTER + 1] for text, start, at in zip(texts, begins, rows, strict=True)]
    queries = [text[at] for text, at in zip(texts, rows, strict=True)]
    named = [text[at] if at >= 0 else None for text, at in zip(texts, keys, strict=True)]
    return frame.assign(query_token=pd.Series(queries, dtype=object, index=frame.index),
                        key_token=pd.Series(named, dtype=object, index=frame.index),
                        context_start=starts.astype(np.int64),
                        context=pd.Series(contexts, dtype=object, index=frame.index))  # fmt: skip
