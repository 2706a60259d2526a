"""The model's next-token loss: cross-entropy in nats at every predicted position, and per sentence.

Position p predicts the token at p + 1 when both are real tokens, so padding (on either side) never counts.
"""

from __future__ import annotations

import torch

from headscope.model.batch import Batch

LOSS_CHUNK_BYTES = 64 * 2**20  # float32 logits of the rows whose loss is computed at once


def token_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(rows, t - 1) float64: next-token cross-entropy at every position (0 where nothing is predicted).

    logits: (rows, t, vocab); batch: the rows' inputs (rows may be a multiple of it: replicas). logsumexp runs in
    float32 along the contiguous vocabulary axis: on SmolLM2 (49,152 words) within 2e-6 nats per token of float64,
    where cross_entropy with the vocabulary as a strided class axis was off by 2.4e-4, and took 3x as long
    (measured); float64 throughout took 4x as long."""
    rows, t, vocab = logits.shape
    valid = batch.attention_mask.bool()
    predicted = valid[:, :-1] & valid[:, 1:]
    per_chunk = max(1, LOSS_CHUNK_BYTES // max(1, 4 * t * vocab))
    parts = []
    for first in range(0, rows, per_chunk):
        chunk = slice(first, first + per_chunk)
        scores = logits[chunk, :-1].float()  # (chunk, t - 1, vocab)
        picked = scores.gather(-1, batch.input_ids[chunk, 1:, None])[..., 0]
        nll = (torch.logsumexp(scores, -1) - picked).double()
        parts.append(torch.where(predicted[chunk], nll, 0.0))
    return torch.cat(parts)


def token_losses(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sentence: the summed next-token cross-entropy (nats, float64) and how many tokens were predicted.

    logits: (batch, t, vocab), the model's own."""
    valid = batch.attention_mask.bool()
    return token_nll(logits, batch).sum(-1), (valid[:, :-1] & valid[:, 1:]).sum(-1)
