"""The detectors' measure: rides on the capture, reads each layer's attention probabilities block by block (the
eager weights, or the fused path's logits recomputed) and keeps, per (sentence, layer, head, detector), the sums
behind each score (measures.detectors): the numerator (the rows' matches) and the denominator (the rows counted,
or a `mul` pattern's attention mass); per (sentence, detector) the same for uniform attention, the chance level.
Each row's match also goes to the exemplars (measures.exemplars), under the detector's name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headscope.columns import EVIDENCE_FROM
from headscope.measures.detectors import Detector, all_row_matches, callable_targets, row_matches, targets
from headscope.measures.exemplars import TopRows
from headscope.model.batch import Batch
from headscope.model.masks import count_visible

# Target matrices kept for the batch's other layers (they depend on the tokens only), up to this many floats in all;
# past it each layer builds its own (a long text's (t x t) matrices would take more memory than they save time).
CACHED_TARGETS = 2**24


class PatternScores:
    """A Measure: per batch, `finish` returns ((layers, batch, heads, scored, 2) numerator and denominator,
    (batch, scored, 2) the same for uniform attention), left on the batch's device.

    scored: how many of `detectors` (the first ones; default all) are scored as columns; the others (the probes'
    patterns) only feed the exemplars, and nothing is summed for them. token_text(id) and token_strings(ids) give
    tokens' text (token:REGEX; a callable's input).
    """

    def __init__(
        self,
        detectors: Sequence[Detector],
        layers: Sequence[int],
        *,
        token_text,
        token_strings,
        exemplars: TopRows | None = None,
        scored: int | None = None,
    ) -> None:
        self.detectors = tuple(detectors)
        self.scored = len(self.detectors) if scored is None else scored
        self.layers = sorted(set(layers))
        self.token_text, self.token_strings = token_text, token_strings
        self.exemplars = exemplars
        self._batch: Batch | None = None
        self._sums: dict[int, torch.Tensor] = {}  # layer -> (batch, heads, detectors, 2)
        self._chance: torch.Tensor | None = None  # (batch, detectors, 2), summed over the first layer's blocks
        self._patterns: dict[str, torch.Tensor] = {}  # a callable detector's (batch, t, t) targets, once a batch
        self._targets: dict[tuple, list[torch.Tensor]] = {}  # (first row, rows, keys) -> each detector's targets

    def start(self, batch: Batch) -> None:
        self._batch, self._sums, self._chance, self._targets = batch, {}, None, {}
        real = batch.attention_mask.bool()
        self._patterns = {
            detector.name: callable_targets(detector, batch.input_ids, real, batch.seq_start, self.token_strings)
            for detector in self.detectors
            if detector.family == "callable"
        }

    def wants(self, layer: int) -> bool:
        return layer in self.layers

    def last_layer(self) -> int | None:
        return self.layers[-1]

    def attention(self, layer: int, block) -> None:
        probs = block.probabilities().float()  # (batch, heads, rows, keys)
        batch, heads, rows, keys = probs.shape
        visible = block.visible[:, 0].expand(batch, rows, keys)  # (batch, rows, keys)
        sums = probs.new_zeros(batch, heads, self.scored, 2, dtype=torch.float64)
        chance = probs.new_zeros(batch, self.scored, 2, dtype=torch.float64)
        positions = (
            torch.arange(block.first_row, block.first_row + rows, device=probs.device) - block.seq_start[:, None]
        )
        if layer == self.layers[0] and self.scored:  # what uniform attention scores: the chance level
            uniform = visible / count_visible(visible[:, None])[:, 0, :, None].clamp(min=1)  # (batch, rows, keys)
        block_targets = torch.stack(self._block_targets(block, rows, keys)) * visible  # (detectors, batch, rows, keys)
        every_match = all_row_matches(probs, block_targets, self.detectors)  # (detectors, batch, heads, rows) float64
        offered = []  # each detector's exemplar scores, offered together (one merge per block, not one each)
        for i, (detector, target, matches) in enumerate(zip(self.detectors, block_targets, every_match, strict=True)):
            if detector.weighs_rows:  # every real row, weighed by its mass (mul) or counted once (abs)
                counted = block.query_valid[:, None, :].expand(batch, heads, rows)
            else:  # the rows with a target key they may see
                counted = (block.query_valid & (target.sum(-1) > 0))[:, None, :].expand(batch, heads, rows)
            if i < self.scored:
                if detector.weighs_rows and detector.mode == "mul":
                    weight = probs.sum(-1, dtype=torch.float64)
                else:
                    weight = torch.ones_like(matches)
                sums[:, :, i, 0] = torch.where(counted, matches, 0.0).sum(-1)
                sums[:, :, i, 1] = torch.where(counted, weight, 0.0).sum(-1)
            if (
                i < self.scored and layer == self.layers[0]
            ):  # uniform attention is the same in every layer: counted once
                chance_matches = row_matches(uniform[:, None], target, detector)[:, 0]  # (batch, rows)
                chance[:, i, 0] = torch.where(counted[:, 0], chance_matches, 0.0).sum(-1)
                chance[:, i, 1] = counted[:, 0].expand(batch, rows).sum(-1)  # uniform attention's mass is 1
            if self.exemplars is not None:
                evidence = counted & (positions >= EVIDENCE_FROM)[:, None, :]  # as sharp and write count rows
                offered.append((matches, evidence, target))
        if offered:
            scores, evidence, kept_targets = (torch.stack(parts) for parts in zip(*offered, strict=True))

            def top_key(kind, b, head, r):
                """The target key each candidate row attends to most (a pattern's weights scale it), and its weight:
                found for the few rows that may enter the exemplars, not for every row."""
                weights = probs[b, head, r]  # (candidates, keys)
                key = (weights * kept_targets[kind, b, r]).argmax(-1)
                return key, weights.gather(-1, key[:, None])[:, 0]

            self.exemplars.offer_kinds(
                layer, [detector.name for detector in self.detectors], scores, evidence, top_key, None,
                sentence_ids=self._batch.sentence_ids, seq_start=block.seq_start, first_row=block.first_row,
            )  # fmt: skip
        self._sums[layer] = sums if layer not in self._sums else self._sums[layer] + sums
        if layer == self.layers[0]:
            self._chance = chance if self._chance is None else self._chance + chance

    def _block_targets(self, block, rows: int, keys: int) -> list[torch.Tensor]:
        """Every detector's (batch, rows, keys) targets for the block (kept for the batch's other layers while
        they are small)."""
        where = (block.first_row, rows, keys)
        if where in self._targets:
            return self._targets[where]
        batch = self._batch
        real = batch.attention_mask.bool()
        span = slice(block.first_row, block.first_row + rows)
        where_ids = (batch.input_ids, real, batch.seq_start, span, keys, self.token_text)
        made = [targets(detector, *where_ids, self._patterns.get(detector.name)) for detector in self.detectors]
        held = sum(target.numel() for cached in self._targets.values() for target in cached)
        if held + sum(target.numel() for target in made) <= CACHED_TARGETS:
            self._targets[where] = made
        return made

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's sums: (layers, batch, heads, detectors, 2) and (batch, detectors, 2), in layer order."""
        return torch.stack([self._sums[layer] for layer in sorted(self._sums)]), self._chance
