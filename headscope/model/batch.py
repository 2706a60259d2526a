"""A batch as the model takes it: token ids padded into one tensor, the mask, the positions and where each
sentence starts; and how sentences of similar length are planned into batches (padding is wasted compute; every
metric sums each sentence's own rows, so neither the grouping nor the padding side changes any number)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Batch:
    sentence_ids: list[int]  # (batch,) corpus ids of the rows below
    input_ids: torch.Tensor  # (batch, t) long, padding filled with 0
    attention_mask: torch.Tensor  # (batch, t) long, 1 on real tokens
    position_ids: torch.Tensor  # (batch, t) long, 0 at each sentence's first real token
    seq_start: torch.Tensor  # (batch,) long, index of the first real token (0 with right padding)
    n_tokens: int  # real tokens, counted on the host (reading it never waits for the device)

    @classmethod
    def unpadded(cls, input_ids: torch.Tensor) -> Batch:
        """(batch, t) ids with no padding, as a Batch (sentence ids 0 ...)."""
        batch, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(batch, t)
        zeros = torch.zeros(batch, dtype=torch.long, device=input_ids.device)
        return cls(list(range(batch)), input_ids, torch.ones_like(input_ids), positions, zeros, batch * t)

    def replicated(self, times: int) -> Batch:
        """The batch `times` times over along the batch axis (replica r holds rows r * batch ...)."""
        return Batch(
            sentence_ids=self.sentence_ids * times,
            input_ids=self.input_ids.repeat(times, 1),
            attention_mask=self.attention_mask.repeat(times, 1),
            position_ids=self.position_ids.repeat(times, 1),
            seq_start=self.seq_start.repeat(times),
            n_tokens=self.n_tokens * times,
        )

    def rows(self, rows: slice) -> Batch:
        """The rows `rows` of the batch, as a batch of their own (its padding as it was)."""
        ids = self.attention_mask[rows]
        return Batch(
            sentence_ids=self.sentence_ids[rows],
            input_ids=self.input_ids[rows],
            attention_mask=ids,
            position_ids=self.position_ids[rows],
            seq_start=self.seq_start[rows],
            n_tokens=int(ids.sum()),
        )

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`. From pinned host memory the copies are asynchronous (non_blocking): the host
        goes on preparing the next batch while they run."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        tensors = (self.input_ids, self.attention_mask, self.position_ids, self.seq_start)
        moved = (t.to(device, non_blocking=True) for t in tensors)
        return Batch(self.sentence_ids, *moved, n_tokens=self.n_tokens)

    def pinned(self) -> Batch:
        """The batch in page-locked host memory, so that copying it to a GPU can overlap other work."""
        tensors = (self.input_ids, self.attention_mask, self.position_ids, self.seq_start)
        return Batch(self.sentence_ids, *(t.pin_memory() for t in tensors), n_tokens=self.n_tokens)


MAX_PADDING = 0.2  # a batch may be at most this share padding: compute grows with padded tokens


def plan_batches(
    lengths: dict[int, int],
    *,
    max_sentences: int,
    max_tokens: int | None = None,
    max_padding: float = MAX_PADDING,
) -> list[list[int]]:
    """Split sentence ids into batches, shortest sentences first.

    A batch holds at most `max_sentences` sentences, at most `max_tokens` padded tokens (sentences
    times the longest one), and at most `max_padding` of its padded tokens are padding; a sentence
    longer than `max_tokens` still gets a batch of its own. Ties are broken by id, so the plan is the
    same for the same input.
    """
    order = sorted(lengths, key=lambda sentence_id: (lengths[sentence_id], sentence_id))
    batches: list[list[int]] = []
    current: list[int] = []
    real = 0
    for sentence_id in order:
        length = lengths[sentence_id]
        padded = (len(current) + 1) * length  # sorted: the newcomer is the longest
        too_many = len(current) == max_sentences
        too_big = max_tokens is not None and padded > max_tokens
        too_padded = padded - (real + length) > max_padding * padded
        if current and (too_many or too_big or too_padded):
            batches.append(current)
            current, real = [], 0
        current.append(sentence_id)
        real += length
    if current:
        batches.append(current)
    return batches


def collate(
    sentence_ids: Sequence[int],
    token_ids: Sequence[Sequence[int]],
    *,
    padding_side: str = "right",
    device: torch.device | str = "cpu",
) -> Batch:
    """Pad `token_ids` (one list per sentence) into one batch on `device`."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left'; got {padding_side!r}")
    lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=len(token_ids))
    width = int(lengths.max())
    # Each row's real tokens: positions [start, start + length) of a row of `width`.
    seq_start = np.zeros_like(lengths) if padding_side == "right" else width - lengths
    columns = np.arange(width)
    real = (columns >= seq_start[:, None]) & (columns < (seq_start + lengths)[:, None])
    input_ids = np.zeros((len(token_ids), width), dtype=np.int64)
    input_ids[real] = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    attention_mask = real.astype(np.int64)
    position_ids = np.clip(attention_mask.cumsum(-1) - 1, 0, None)
    batch = Batch(
        sentence_ids=list(sentence_ids),
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        position_ids=torch.from_numpy(position_ids),
        seq_start=torch.from_numpy(seq_start),
        n_tokens=int(lengths.sum()),
    )
    return batch.to(device)


def batches_in_order(
    tokenized: dict[int, list[int]],
    *,
    max_sentences: int,
    max_tokens: int | None = None,
    padding_side: str = "right",
    device="cpu",
) -> Iterator[Batch]:
    """Collated batches for every tokenized sentence, planned by length."""
    lengths = {k: len(v) for k, v in tokenized.items()}
    for ids in plan_batches(lengths, max_sentences=max_sentences, max_tokens=max_tokens):
        yield collate(ids, [tokenized[i] for i in ids], padding_side=padding_side, device=device)
