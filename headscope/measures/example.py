"""The example measure: every layer's attention of a one-sentence batch, kept whole (it is small by design)."""

from __future__ import annotations

import torch

from headscope.feed import Batch


class ExampleAttention:
    """Keeps (heads, t, t) probabilities per layer of a one-sentence batch; `finish` stacks them on the CPU."""

    def __init__(self) -> None:
        self._layers: dict[int, torch.Tensor] = {}  # layer -> (heads, t, t)
        self._t = 0

    def start(self, batch: Batch) -> None:
        if len(batch.sentence_ids) != 1:
            raise ValueError("ExampleAttention takes a batch of exactly one sentence")
        self._t = batch.input_ids.shape[-1]
        self._layers = {}

    def wants(self, layer: int) -> bool:
        return True

    def last_layer(self) -> int | None:
        return None

    def attention(self, layer, block) -> None:
        probabilities = block.probabilities()[0].float().cpu()  # (heads, rows, keys)
        heads, rows, keys = probabilities.shape
        matrix = self._layers.setdefault(layer, torch.zeros(heads, self._t, self._t))
        matrix[:, block.first_row : block.first_row + rows, :keys] = probabilities

    def finish(self) -> torch.Tensor:
        """(layers, heads, t, t) attention of the sentence."""
        return torch.stack([self._layers[layer] for layer in sorted(self._layers)])
