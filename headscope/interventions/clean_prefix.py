"""The clean model's decoder layers below every head a search can remove, run once for the whole search.

prune --layers 26-29 removes heads of layers 26 to 29 only: layers 0 to 25 compute the same thing in every pass of
the search (each gradient pass, each replicated pass), the clean model's. `clean_prefix` runs them once per batch
and keeps what layer 25 returned; every later pass starts at layer 26 from it (Capture.run's start_at and
handed_on, as the replicated passes of ablate and patch start at their first removed layer), so that a pass costs
the layers it can change and the LM head. The numbers are the same: a batch's layer outputs do not depend on what
later layers do, and the batches are the same each time (the corpus is fed as one chunk, batched the same way).

Kept only where it fits: all of the corpus's padded positions times the hidden size, in the model's dtype, within
an eighth of the memory free on the device (else every pass runs from layer 0, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from headscope.model.batch import Batch
from headscope.model.memory import free_memory

SHARE_OF_FREE = 8  # the prefix may take this fraction (1/8) of the memory free on the device


@dataclass
class CleanPrefix:
    layer: int  # passes start at this decoder layer; the ones before it hand on what they returned on the clean model
    outputs: dict[tuple[int, ...], object]  # a batch's sentence ids -> what layer `layer - 1` returned (detached)

    def handed_on(self, batch: Batch):
        """What layer `layer - 1` returned on the clean model for `batch`."""
        return self.outputs[tuple(batch.sentence_ids)]

    def for_gradients(self, batch: Batch):
        """handed_on(batch) as a leaf that requires grad (a normal tensor, not the inference tensor the clean pass
        made), so that the head outputs of the layers after it are in the autograd graph."""
        return _requiring_grad(self.handed_on(batch))


def clean_prefix(
    capture, batches: Callable[[], Iterable[Batch]], layer: int, planned: Iterable[Batch], hidden_bytes: int
) -> CleanPrefix | None:
    """Run the decoder layers before `layer` once per batch, on the clean model, and keep the last one's output; None
    where there is nothing to skip (`layer` 0) or it would not fit (planned: the same batches, counted on the host;
    hidden_bytes: one position's hidden state, in bytes)."""
    if layer <= 0:
        return None
    needed = sum(batch.input_ids.numel() for batch in planned) * hidden_bytes
    if needed > free_memory(capture.model.device) // SHARE_OF_FREE:
        return None
    outputs = {}
    for batch in batches():
        outputs[tuple(batch.sentence_ids)] = capture.run_keeping_layers(batch, through=layer)[1][layer - 1]
    return CleanPrefix(layer, outputs)


def _requiring_grad(value):
    if isinstance(value, torch.Tensor):
        return value.clone().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple):
        return tuple(_requiring_grad(item) for item in value)
    return value
