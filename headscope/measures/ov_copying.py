"""What a head's weights copy, with no data: the OV copying score of Elhage et al. 2021 ("A Mathematical Framework
for Transformer Circuits").

A head's OV circuit on tokens is the (vocab, vocab) map M = W_U W_O^h W_V^h W_E: a token attended to, through the
head's values and output, onto the logits. The copying score is sum(lambda) / sum(|lambda|) over M's eigenvalues:
1 where the head raises the logit of the very token it attends to (its OV circuit the identity), -1 where it lowers
it (copy suppression: McDougall et al. 2023 find GPT-2 small's 10.7 the strongest), near 0 where it moves other
tokens. M's non-zero eigenvalues are those of the (head_dim, head_dim) map K = W_V^h (W_E^T W_U) W_O^h (AB and BA
share them), so the score is computed there, never on a vocab x vocab matrix; sum(lambda) is K's trace (real, as M
is). measures/ov_circuits.py gathers the weights, with the norms' gains folded in.
"""

from __future__ import annotations

import numpy as np
import torch

DEFINITION = "sum(eigenvalues) / sum(|eigenvalues|) of W_U G_f G_post W_O^h W_V^h G_in W_E^T (Elhage et al. 2021)"
CHUNK_TOKENS = 8192  # vocabulary rows per product of W_E^T W_U


def token_map(embed: torch.Tensor, unembed: torch.Tensor) -> torch.Tensor:
    """(hidden, hidden) float64 W_E^T W_U from embed and unembed (vocab, hidden): float32 products over CHUNK_TOKENS
    tokens at a time on their device, added in float64."""
    total = torch.zeros(embed.shape[1], unembed.shape[1], dtype=torch.float64, device=embed.device)
    for start in range(0, embed.shape[0], CHUNK_TOKENS):
        rows = slice(start, start + CHUNK_TOKENS)
        total += (embed[rows].float().T @ unembed[rows].float()).double()
    return total


def copying_scores(values: torch.Tensor, tokens: torch.Tensor, outputs: torch.Tensor) -> np.ndarray:
    """(heads,) float64: sum(lambda) / sum(|lambda|) over the eigenvalues of each head's K = V (tokens) O, with values
    (heads, head_dim, hidden) its value rows, outputs (heads, hidden, head_dim) its output columns and tokens the
    (hidden, hidden) map between them (W_E^T W_U, gains folded in). NaN for a head whose K is 0."""
    circuits = values.double() @ tokens.double() @ outputs.double()  # (heads, head_dim, head_dim)
    eigenvalues = torch.linalg.eigvals(circuits.cpu())
    total = eigenvalues.abs().sum(-1)
    trace = torch.diagonal(circuits, dim1=-2, dim2=-1).sum(-1).cpu()
    return torch.where(total > 0, trace / total, torch.nan).numpy()
