"""The detectors' measure: rides on the capture and keeps, per (sentence, layer, head, detector), the sums behind
each score (measures.detectors): the numerator (the rows' matches) and the denominator (the rows counted, or a `mul`
pattern's attention mass); per (sentence, detector) the same for uniform attention, the chance level. Each row's match
also goes to the exemplars (measures.exemplars), under the detector's name.

Two ways in, the same numbers (within float32 rounding: tested on every path):
- where the fused pass folds a layer (long texts), its kernel reads the built-in families' targets in the same pass
  as the statistics (`key_patterns` -> `pattern_rows`, headscope.model.attention.key_patterns): nothing is computed
  twice;
- elsewhere (the eager path's probabilities; a fused layer no kernel took; a callable detector, whose pattern is any
  (t x t) array) block by block from the probabilities (`attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from headscope.measures.detectors import (
    Detector,
    all_row_matches,
    callable_targets,
    kept_classes,
    row_matches,
    target_classes,
    targets,
)
from headscope.measures.exemplars import TopRows, evidence_rows
from headscope.model.attention.finish_rows import RowValues
from headscope.model.attention.key_patterns import NO_REACH, KeyPatterns, PatternRows, read_probabilities
from headscope.model.batch import Batch
from headscope.model.masks import count_visible

# Probabilities (batch x heads x rows x keys) up to which each row's top target key is found for every row (one
# temporary of their size per pattern, 4 MiB), not for the candidate rows alone.
EVERY_ROWS_KEY = 2**20
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
        self._targets: dict[tuple, tuple] = {}  # (first row, rows, keys) -> (visible keys, what `_block_rows` gives)
        # the built-in families (the fused pass folds their targets); callables are read block by block
        self.built_in = [i for i, detector in enumerate(self.detectors) if detector.family != "callable"]
        self.folded = self.built_in  # those read on the batch: not far:S,W on sentences too short for its rows
        self.callables = [i for i, detector in enumerate(self.detectors) if detector.family == "callable"]
        self._key_patterns: dict[torch.device, KeyPatterns] = {}  # the batch's, on each device a layer runs on
        self._parts: list[range] = []  # each folded detector's patterns in them (two for a complemented far:S,W)
        self._folded_by_kernel: set[int] = set()  # layers of the batch whose built-in families a kernel read

    def start(self, batch: Batch) -> None:
        self._batch, self._sums, self._chance, self._targets = batch, {}, None, {}
        self._key_patterns, self._folded_by_kernel, self._parts = {}, set(), []
        real = batch.attention_mask.bool()
        longest = int(real.sum(-1).max()) if real.numel() else 0
        self.folded = [i for i in self.built_in if self.detectors[i].min_tokens <= longest]
        self._parts = self._parts_of(self.folded)
        self._patterns = {
            detector.name: callable_targets(detector, batch.input_ids, real, batch.seq_start, self.token_strings)
            for detector in self.detectors
            if detector.family == "callable"
        }

    def wants(self, layer: int) -> bool:
        return layer in self.layers and bool(self.folded or self.callables)

    def last_layer(self) -> int | None:
        return self.layers[-1]

    def key_patterns(self, device: torch.device) -> KeyPatterns | None:
        """The built-in families' targets on the batch, for the fused pass to fold (None: no such detector): one
        pattern each, or for a far:S,W no exemplar reads, the two runs of keys it leaves out (`_complemented`)."""
        if not self.folded:
            return None
        if device not in self._key_patterns:
            batch = self._batch
            real = batch.attention_mask.bool()
            parts = []
            for i, placed in zip(self.folded, self._parts, strict=True):
                detector = self.detectors[i]
                if self._complemented(i):
                    made = kept_classes(detector, batch.input_ids, real, batch.seq_start)
                else:
                    made = [(*target_classes(detector, batch.input_ids, real, batch.seq_start, self.token_text),
                             NO_REACH)]  # fmt: skip
                assert range(len(parts), len(parts) + len(made)) == placed, (detector.name, placed)
                parts += made
            key_class, row_class, lag, reach = zip(*parts, strict=True)
            made = KeyPatterns.of(torch.stack(key_class), torch.stack(row_class), torch.tensor(lag), batch.seq_start,
                                  reach=torch.tensor(reach))  # fmt: skip
            self._key_patterns[device] = made.to(device)
        return self._key_patterns[device]

    def _parts_of(self, folded: list[int]) -> list[range]:
        """Each folded detector's patterns among the batch's KeyPatterns, in `folded`'s order: one each, two for a
        complemented far:S,W (its first S keys and its last W: detectors.kept_classes)."""
        parts, start = [], 0
        for i in folded:
            count = 2 if self._complemented(i) else 1
            parts.append(range(start, start + count))
            start += count
        return parts

    def _complemented(self, i: int) -> bool:
        """Is detector i a far:S,W that no exemplar kind reads? Its score is then read from the keys it leaves out,
        S + W of them a row, not its own run (as long as the row): the same number within float32 rounding, at a
        fraction of the cost (far_mass always; docs/streaming.md). An exemplar needs the far key itself."""
        return self.detectors[i].family == "far" and not self._offers(i)

    def _offers(self, i: int) -> bool:
        return self.exemplars is not None and self.detectors[i].name in self.exemplars.kind_index

    def pattern_rows(self, layer: int, rows: PatternRows, values: RowValues, query_valid, seq_start) -> None:
        """A whole layer's readings of the built-in families' targets (the `key_patterns` folded by a kernel), with
        the layer's row `values` (each row's visible keys, for chance)."""
        self._folded_by_kernel.add(layer)
        n_visible = values.n_visible.amax(1)
        self._read_rows(layer, self._per_detector(rows, n_visible, 0), n_visible, query_valid, seq_start, 0)

    def needs_blocks(self, layer: int) -> bool:
        """Does `layer` still want its attention block by block (`attention`)? Not where its built-in families came
        folded (`pattern_rows`) and no callable is left."""
        return layer not in self._folded_by_kernel or bool(self.callables)

    def attention(self, layer: int, block) -> None:
        probs = block.probabilities().float()  # (batch, heads, rows, keys)
        if self.folded and layer not in self._folded_by_kernel:  # the built-in families, from their runs of keys
            patterns = self.key_patterns(probs.device)
            by_torch = functools.partial(read_probabilities, probs, block.visible, patterns, block.first_row)
            # headscope's C++ kernel where the capture offers it (checked against torch on its first call), else torch
            native = block.native_patterns
            rows = by_torch() if native is None else native(patterns, block.first_row, by_torch)
            n_visible = count_visible(block.visible)[:, 0]  # (batch or 1, rows)
            rows = self._per_detector(rows, n_visible, block.first_row)
            self._read_rows(layer, rows, n_visible, block.query_valid, block.seq_start, block.first_row)
        if self.callables:
            self._read_callables(layer, block, probs)

    def _per_detector(self, rows: PatternRows, n_visible: torch.Tensor, first_row: int) -> PatternRows:
        """The folded detectors' readings, one each in `folded`'s order, from their patterns' `rows` (query positions
        first_row, ...): a complemented far:S,W's row reads 1 less the mass on the keys it leaves out, on the rows it
        has (t >= S + W) with a far key they see (n_visible: (batch or 1, rows) less the keys left out); it names no
        key (no exemplar reads it)."""
        if all(len(parts) == 1 for parts in self._parts):
            return rows
        patterns = self._key_patterns[rows.match.device]
        span = slice(first_row, first_row + rows.match.shape[-1])
        readings = []
        for parts in self._parts:
            if len(parts) == 1:
                readings.append(rows.part(parts[0], parts[0] + 1))
                continue
            kept = rows.part(parts[0], parts[-1] + 1)
            has_rows = (patterns.row_class[parts[0], :, span] >= 0)[:, None]  # (batch, 1, rows)
            far = torch.where(has_rows, n_visible[:, None] - kept.targets.sum(0), 0)  # (batch, heads, rows)
            match = torch.where(far > 0, 1.0 - kept.match.sum(0), 0.0)
            readings.append(PatternRows(match[None], far[None], torch.full_like(far, -1)[None],
                                        torch.zeros_like(kept.weight[0])[None]))  # fmt: skip
        fields = PatternRows.__dataclass_fields__
        return PatternRows(*(torch.cat([getattr(reading, name) for reading in readings]) for name in fields))

    def _read_rows(self, layer: int, rows: PatternRows, n_visible, query_valid, seq_start, first_row: int) -> None:
        """The built-in families' readings of a block of rows (query positions first_row, ...): their sums, their
        chance (on the first layer) and their exemplars. n_visible: (batch or 1, rows) the keys each row sees."""
        counted = query_valid[None] & (rows.targets.amax(2) > 0)  # (folded, batch, rows): a target seen
        evidence = counted & evidence_rows(first_row, query_valid.shape[-1], seq_start)[None]
        scored = [j for j, i in enumerate(self.folded) if i < self.scored]
        batch, heads = rows.match.shape[1:3]
        sums = rows.match.new_zeros(batch, heads, self.scored, 2)
        for j in scored:
            i = self.folded[j]
            sums[:, :, i, 0] = torch.where(counted[j][:, None], rows.match[j], 0.0).sum(-1)
            sums[:, :, i, 1] = counted[j].sum(-1, dtype=torch.float64)[:, None]
        self._add_sums(layer, sums)
        if layer == self.layers[0]:  # uniform attention: each row's visible targets over its visible keys
            uniform = rows.targets.amax(2).double() / n_visible.clamp(min=1)[None]
            chance = uniform.new_zeros(batch, self.scored, 2)
            for j in scored:
                i = self.folded[j]
                chance[:, i, 0] = torch.where(counted[j], uniform[j], 0.0).sum(-1)
                chance[:, i, 1] = counted[j].sum(-1)
            self._add_chance_sums(chance)
        offered = self._offered()
        if offered:
            names = [self.detectors[self.folded[j]].name for j in offered]
            pick = torch.tensor(offered, device=rows.match.device)
            rows_of = (rows.match, evidence[:, :, None], rows.key, rows.weight)
            match, counted_rows, key, weight = (x if len(offered) == len(self.folded) else x.index_select(0, pick)
                                                for x in rows_of)  # fmt: skip
            self.exemplars.offer(layer, names, match, counted_rows, key, weight,
                                 sentence_ids=self._batch.sentence_ids, seq_start=seq_start,
                                 first_row=first_row)  # fmt: skip

    def _offered(self) -> list[int]:
        """Which of the folded patterns feed the exemplars (by place among them): those that are an exemplar kind
        (not far_mass, which is scored only)."""
        return [j for j, i in enumerate(self.folded) if self._offers(i)]

    def _read_callables(self, layer: int, block, probs: torch.Tensor) -> None:
        """The callable detectors on a block: their (rows x keys) patterns, whatever they hold, over every real row."""
        batch, heads, rows, keys = probs.shape
        block_targets = self._callable_targets(block, rows, keys)  # (callables, batch, rows, keys)
        callables = [self.detectors[i] for i in self.callables]
        every_match = all_row_matches(probs, block_targets, callables)  # (callables, batch, heads, rows)
        real = block.query_valid[:, None]  # (batch, 1, rows): every real row counts
        sums = probs.new_zeros(batch, heads, self.scored, 2, dtype=torch.float64)
        chance = probs.new_zeros(batch, self.scored, 2, dtype=torch.float64)
        if layer == self.layers[0]:  # uniform attention is the same in every layer: counted once
            visible = block.visible[:, 0].expand(batch, rows, keys)
            uniform = visible / count_visible(visible[:, None])[:, 0, :, None].clamp(min=1)  # (batch, rows, keys)
        for j, (i, detector) in enumerate(zip(self.callables, callables, strict=True)):
            if i >= self.scored:
                continue
            mass = probs.sum(-1, dtype=torch.float64) if detector.mode == "mul" else torch.ones_like(every_match[j])
            sums[:, :, i, 0] = torch.where(real, every_match[j], 0.0).sum(-1)
            sums[:, :, i, 1] = torch.where(real, mass, 0.0).sum(-1)
            if layer == self.layers[0]:
                chance_matches = row_matches(uniform[:, None], block_targets[j], detector)[:, 0]  # (batch, rows)
                chance[:, i, 0] = torch.where(real[:, 0], chance_matches, 0.0).sum(-1)
                chance[:, i, 1] = real[:, 0].sum(-1)  # uniform attention's mass is 1
        self._add_sums(layer, sums)
        if layer == self.layers[0]:
            self._add_chance_sums(chance)
        if self.exemplars is not None:
            evidence = real & evidence_rows(block.first_row, rows, block.seq_start)[:, None]
            keys, weights = _top_keys(probs, block_targets)
            self.exemplars.offer(
                layer, [detector.name for detector in callables], every_match, evidence[None], keys, weights,
                sentence_ids=self._batch.sentence_ids, seq_start=block.seq_start, first_row=block.first_row,
            )  # fmt: skip

    def _add_sums(self, layer: int, sums: torch.Tensor) -> None:
        self._sums[layer] = sums if layer not in self._sums else self._sums[layer] + sums

    def _add_chance_sums(self, chance: torch.Tensor) -> None:
        self._chance = chance if self._chance is None else self._chance + chance

    def _callable_targets(self, block, rows: int, keys: int) -> torch.Tensor:
        """The callables' targets on the keys each row of the block may see, (callables, batch, rows, keys): the same
        for every layer, so kept for the batch's other layers while small, and while their visible keys are the same
        (a sliding-window layer's are not)."""
        where = (block.first_row, rows, keys)
        cached = self._targets.get(where)
        if cached is not None and torch.equal(cached[0], block.visible):
            return cached[1]
        batch = self._batch
        real = batch.attention_mask.bool()
        span = slice(block.first_row, block.first_row + rows)
        made = torch.stack([
            targets(self.detectors[i], batch.input_ids, real, batch.seq_start, span, keys, self.token_text,
                    self._patterns[self.detectors[i].name])
            for i in self.callables
        ]) * block.visible[:, 0]  # fmt: skip
        held = sum(entry[1].numel() for entry in self._targets.values())
        if held + made.numel() <= CACHED_TARGETS:
            self._targets[where] = (block.visible, made)
        return made

    def finish(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The batch's sums: (layers, batch, heads, detectors, 2) and (batch, detectors, 2), in layer order; (None,
        None) where nothing was read (no detector had a row with a target in the batch)."""
        if not self._sums:
            return None, None
        return torch.stack([self._sums[layer] for layer in sorted(self._sums)]), self._chance


def _top_keys(probs: torch.Tensor, targets: torch.Tensor):
    """The target key each row attends to most (a pattern's weights scale it) and its weight, for every row at once
    ((patterns, batch, heads, rows) each) where that costs little memory, so that the exemplars take the offer with
    the layer's others; else a function of the candidate rows alone (measures.exemplars.TopRows.offer).
    probs: (batch, heads, rows, keys); targets: (patterns, batch, rows, keys)."""
    if probs.numel() <= EVERY_ROWS_KEY:
        keys = torch.stack([(probs * target[:, None]).argmax(-1) for target in targets])
        return keys, probs[None].expand(len(targets), -1, -1, -1, -1).gather(-1, keys[..., None])[..., 0]

    def top_key(kind, b, head, r):
        weights = probs[b, head, r]  # (candidates, keys)
        key = (weights * targets[kind, b, r]).argmax(-1)
        return key, weights.gather(-1, key[:, None])[:, 0]

    return top_key, None
