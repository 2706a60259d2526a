"""Whole attention matrices of chosen heads on one text: what `inspect` shows and the report's example views.

A `HeadAttention` keeps, for a one-text batch, a (t, t) float32 matrix per chosen head and the keys each row
could see, filled block of rows by block: its memory is the chosen heads' t x t, whatever path the layer's
probabilities took (the model's eager weights, or the block-wise logits checked against them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa
import torch

from headscope.columns import PROBE_PATTERNS
from headscope.errors import ResourceError
from headscope.model.batch import Batch
from headscope.model.memory import readable
from headscope.tables import ATTENTION_SCHEMA


def by_layer(heads: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """[(layer, head), ...] -> {layer: [heads, ascending]}, layers ascending."""
    grouped: dict[int, set[int]] = {}
    for layer, head in heads:
        grouped.setdefault(int(layer), set()).add(int(head))
    return {layer: sorted(grouped[layer]) for layer in sorted(grouped)}


class HeadAttention:
    """A Measure for a one-text batch: the chosen heads' (t, t) attention, on the CPU.

    heads: layer -> its heads to keep; None keeps every head of every layer.
    """

    def __init__(self, heads: Mapping[int, list[int]] | None = None) -> None:
        self.heads = dict(heads) if heads is not None else None
        self._t = 0
        self._kept: dict[tuple[int, int], torch.Tensor] = {}  # (layer, head) -> (t, t)
        self._visible: dict[int, torch.Tensor] = {}  # layer -> (t, t) bool

    def start(self, batch: Batch) -> None:
        if len(batch.sentence_ids) != 1:
            raise ValueError("HeadAttention takes a batch of exactly one text")
        self._t = batch.input_ids.shape[-1]
        self._kept, self._visible = {}, {}

    def wants(self, layer: int) -> bool:
        return self.heads is None or layer in self.heads

    def last_layer(self) -> int | None:
        return None if self.heads is None else max(self.heads)

    def attention(self, layer: int, block) -> None:
        chosen = None if self.heads is None else self.heads[layer]
        probabilities = block.probabilities(chosen)[0].float().cpu()  # (chosen heads, rows, keys)
        count, rows, keys = probabilities.shape
        where = slice(block.first_row, block.first_row + rows)
        visible = self._visible.setdefault(layer, torch.zeros(self._t, self._t, dtype=torch.bool))
        visible[where, :keys] = block.visible[0, 0].cpu()  # (rows, keys): the text's own (or the shared) mask
        for index, head in enumerate(chosen if chosen is not None else range(count)):
            matrix = self._kept.setdefault((layer, head), torch.zeros(self._t, self._t))
            matrix[where, :keys] = probabilities[index]

    def finish(self) -> tuple[dict[tuple[int, int], np.ndarray], dict[int, np.ndarray]]:
        """(layer, head) -> its (t, t) attention; layer -> the (t, t) keys each row could see."""
        kept = {key: matrix.numpy() for key, matrix in sorted(self._kept.items())}
        visible = {layer: matrix.numpy() for layer, matrix in self._visible.items()}
        self._kept, self._visible = {}, {}  # the caller holds the only reference: one text's matrices at a time
        return kept, visible


def largest_weight(matrix: np.ndarray, visible: np.ndarray, places: int = 3) -> tuple[list, float, int]:
    """Where a head's rows put their largest weight, on one text.

    matrix: (t, t) attention; visible: (t, t) bool. Over rows 1..t-1 (row 0 sees only itself), each row's key of
    largest weight is named "first token" (position 0), "itself" (offset 0) or "k back" (offset k = query - key);
    rows whose largest weight is shared by several keys are "tied". Returns the `places` most common names with
    the share of rows each holds ([(name, share), ...], most common first, ties by name; those holding at least
    5% of rows, and always the first), the mean largest weight, and the number of rows. A text of one token has
    no such row: ([], nan, 0).
    """
    t = matrix.shape[0]
    if t < 2:
        return [], float("nan"), 0
    rows = np.where(visible[1:], matrix[1:], -np.inf)  # (t - 1, t)
    largest = rows.max(axis=1)
    key = rows.argmax(axis=1)
    tied = (rows == largest[:, None]).sum(axis=1) > 1
    offset = np.arange(1, t) - key
    names = np.where(key == 0, "first token", np.where(offset == 0, "itself", [f"{k} back" for k in offset]))
    names = np.where(tied, "tied", names)
    values, counts = np.unique(names, return_counts=True)
    order = sorted(range(len(values)), key=lambda i: (-counts[i], values[i]))[:places]
    shares = [(str(values[i]), float(counts[i] / (t - 1))) for i in order]
    return [shares[0]] + [place for place in shares[1:] if place[1] >= 0.05], float(largest.mean()), t - 1


def kept_bytes(heads: int, layers: int, tokens: int) -> int:
    """What `HeadAttention` keeps for one text: a float32 (t, t) per head and a bool (t, t) per layer."""
    return (4 * heads + layers) * tokens * tokens


def check_memory(heads: Iterable[tuple[int, int]], longest: int, budget: int) -> None:
    """Refuse, naming what would fit, when the chosen heads' attention on the longest text passes the budget."""
    heads = list(heads)
    layers = len({layer for layer, _ in heads})
    needed = kept_bytes(len(heads), layers, longest)
    if needed > budget:
        fits = int(np.sqrt(budget / (4 * len(heads) + layers)))
        raise ResourceError(
            f"{len(heads)} heads on a text of {longest:,} tokens keep {readable(needed)} of attention (4 bytes x "
            f"heads x tokens²), more than the {readable(budget)} budget; choose fewer heads (--heads, --role, "
            f"--layers), texts of at most {fits:,} tokens (--max-length), or raise --max-memory"
        )


PAIRS_PER_WRITE = 1 << 20  # (query, key) rows per Parquet write: the writer's memory stays small at any length


def write_pairs(writer, text_id: int, layer: int, head: int, matrix: np.ndarray, visible: np.ndarray) -> None:
    """One head's visible (query, key) pairs on one text (tables.ATTENTION_SCHEMA), a slab of rows at a time."""
    t = matrix.shape[0]
    step = max(1, PAIRS_PER_WRITE // t)
    for first in range(0, t, step):
        query, key = np.nonzero(visible[first : first + step])
        query += first
        columns = {
            "text_id": np.full(len(query), text_id, dtype=np.int32),
            "layer": np.full(len(query), layer, dtype=np.int32),
            "head": np.full(len(query), head, dtype=np.int32),
            "query": query.astype(np.int32),
            "key": key.astype(np.int32),
            "weight": matrix[query, key].astype(np.float32),
        }
        writer.write_table(pa.table(columns, schema=ATTENTION_SCHEMA))


def probe_scores(kept: Mapping[tuple[int, int], np.ndarray], tokens: int, length: int) -> dict:
    """Each kept head's probe scores on one probe sequence of `tokens` tokens (copies of `length`): the battery's
    own sums (measures/probes.py) on this sequence, so that they equal probes.parquet's score for its seed.
    (layer, head) -> {"probe_<pattern>": score}."""
    from headscope.measures.probes import ProbeSpec, pattern_counts, pattern_mass

    spec = ProbeSpec(seeds=2, length=length)
    prefix = tokens - spec.repeats * spec.length
    valid, start = torch.ones(1, tokens, dtype=torch.bool), torch.zeros(1, dtype=torch.long)
    rows, _ = pattern_counts(valid, start, prefix, spec)  # (1, patterns)
    scores = {}
    for pair, matrix in kept.items():
        mass = pattern_mass(torch.from_numpy(matrix)[None, None], 0, start, valid, prefix, spec)  # (1, 1, patterns)
        scores[pair] = {f"probe_{p}": float(mass[0, 0, i] / rows[0, i]) for i, p in enumerate(PROBE_PATTERNS)}
    return scores
