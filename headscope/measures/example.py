"""The example sentence: every head's attention on one short corpus sentence, kept whole (small by design)."""

from __future__ import annotations

import pandas as pd
import torch

from headscope.feed import Batch, CorpusFeed, collate, token_labels
from headscope.tables import examples_frame

# The example is cut to at most this many tokens: it keeps every head's (t, t) attention, which must stay small
# even when every sentence of the corpus is thousands of tokens long.
EXAMPLE_MAX_TOKENS = 32


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


def example_attention(capture, feed: CorpusFeed, sentence_id: int, *, padding_side: str, device) -> pd.DataFrame:
    """Every head's attention on sentence `sentence_id` of the feed, cut to EXAMPLE_MAX_TOKENS, long-form."""
    ids = feed.token_ids(sentence_id, EXAMPLE_MAX_TOKENS)
    batch = collate([sentence_id], [ids], padding_side=padding_side, device=device)
    keeper = ExampleAttention()
    capture.run(batch, measures=[keeper])
    return examples_frame(sentence_id, token_labels(feed.tokenizer, ids), keeper.finish().numpy())
