"""Group tokenized sentences into padded batches.

Sentences of similar length are batched together to keep padding (wasted
compute) small. Metrics are per-sentence sums, so neither the grouping nor
the padding side changes any number.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    sentence_ids: list[int]  # (batch,) corpus ids of the rows below
    input_ids: torch.Tensor  # (batch, t) long, padding filled with 0
    attention_mask: torch.Tensor  # (batch, t) long, 1 on real tokens
    position_ids: torch.Tensor  # (batch, t) long, 0 at each sentence's first real token
    seq_start: torch.Tensor  # (batch,) long, index of the first real token (0 with right padding)

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())


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
    width = max(len(ids) for ids in token_ids)
    input_ids = torch.zeros(len(token_ids), width, dtype=torch.long)
    attention_mask = torch.zeros(len(token_ids), width, dtype=torch.long)
    seq_start = torch.zeros(len(token_ids), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        start = 0 if padding_side == "right" else width - len(ids)
        input_ids[row, start : start + len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        attention_mask[row, start : start + len(ids)] = 1
        seq_start[row] = start
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(
        sentence_ids=list(sentence_ids),
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        seq_start=seq_start.to(device),
    )


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
