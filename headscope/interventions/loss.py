"""The model's next-token loss: cross-entropy in nats at every predicted position, and per sentence.

Position p predicts the token at p + 1 when both are real tokens, so padding (on either side) never counts.
"""

from __future__ import annotations

import torch

from headscope.model.batch import Batch

LOSS_CHUNK_BYTES = 64 * 2**20  # float32 logits of the rows whose loss is computed at once


class _NextTokenNLL(torch.autograd.Function):
    """(rows, t) float32 cross-entropy of each position's logits (rows, t, vocab) against `targets` (rows, t):
    logsumexp - the target's logit, in float32, `rows_per_chunk` rows at a time (a float32 copy of a chunk at most).
    Its backward writes softmax - one-hot, times the incoming gradient, into one logits-sized buffer, chunk by
    chunk; autograd's own (through the chunks' slices, logsumexp and gather) zero-filled the whole buffer for every
    chunk, and three more, and added them: a fifth of a gradient pass on SmolLM2 (profiled)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows_per_chunk: int) -> torch.Tensor:
        chunks = [slice(first, first + rows_per_chunk) for first in range(0, logits.shape[0], rows_per_chunk)]
        lse = torch.cat([torch.logsumexp(logits[chunk].float(), -1) for chunk in chunks])
        picked = logits.gather(-1, targets[..., None])[..., 0].float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunks = chunks
        return lse - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        found = torch.empty_like(logits)
        for chunk in ctx.chunks:  # float32 logits: written in place, in the buffer's own rows
            into = found[chunk] if logits.dtype == torch.float32 else None
            part = torch.sub(logits[chunk].float(), lse[chunk, :, None], out=into).exp_().mul_(grad[chunk, :, None])
            part.scatter_add_(-1, targets[chunk, :, None], -grad[chunk, :, None])
            if into is None:
                found[chunk] = part
        return found, None, None


def token_nll(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(rows, t - 1) float64: next-token cross-entropy at every position (0 where nothing is predicted).

    logits: (rows, t, vocab); batch: the rows' inputs (a replicated batch where the rows are replicas). logsumexp
    runs in float32 along the contiguous vocabulary axis: on SmolLM2 (49,152 words) within 2e-6 nats per token of
    float64, where cross_entropy with the vocabulary as a strided class axis was off by 2.4e-4, and took 3x as long
    (measured); float64 throughout took 4x as long. Differentiable, for a gradient pass (`_NextTokenNLL`)."""
    t, vocab = logits.shape[1:]
    valid = batch.attention_mask.bool()
    predicted = valid[:, :-1] & valid[:, 1:]
    # each position's next token; the last position predicts nothing (dropped below): token 0 stands in for it
    targets = torch.nn.functional.pad(batch.input_ids[:, 1:], (0, 1))
    rows_per_chunk = max(1, LOSS_CHUNK_BYTES // max(1, 4 * t * vocab))
    nll = _NextTokenNLL.apply(logits, targets, rows_per_chunk)[:, :-1].double()
    return torch.where(predicted, nll, 0.0)


def token_losses(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sentence: the summed next-token cross-entropy (nats, float64) and how many tokens were predicted.

    logits: (batch, t, vocab), the model's own."""
    valid = batch.attention_mask.bool()
    return token_nll(logits, batch).sum(-1), (valid[:, :-1] & valid[:, 1:]).sum(-1)
