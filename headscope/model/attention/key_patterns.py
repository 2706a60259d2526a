"""Patterns of target keys the fused pass reads in the same pass as the statistics (the exemplars' and detectors'
patterns): no probability is computed twice.

A pattern says, for every query row t of a sentence, which keys s are its targets, as equal classes:

    s is a target of t  <=>  key_class[s] == row_class[t] >= 0 and t - reach <= s <= t - lag (the pattern's lag: 0,
                             or 1 where a row is not its own target, or W where only keys at least W back count;
                             its reach: NO_REACH, or W - 1 where only the last W keys count)

Every built-in detector family is one (headscope.measures.detectors.target_classes): same-token compares the tokens,
after-same-token the query's token with each key's previous one, offset:K a key's position with t - K, token:REGEX and
first a match with class 0, far:S,W every key past the sentence's first S with class 0 and lag W (or, where no exemplar
reads its keys, the two runs it leaves out: the first S keys, and every key with reach W - 1). So the targets of row t
are a run of the sentence's keys sorted by (class, position): the kernels read them by look-up (the C++ kernel:
`sorted_keys` and each row's run, [run_begin, run_end)), never as a (rows x keys) matrix.

What a kernel returns per (pattern, sentence, head, row), over the targets it folds (the keys the row sees, the
sentence's first key left out, as for every statistic of the fold), relative to the fold's maximum m': the sum of
e^(s - m'), how many there are, the largest e^(s - m') and its key. `finish` puts the first key back and turns them
into probabilities, from the row's own RowValues (its sink and rest_max_weight hold e^(s_f - m) / A and e^(m' - m) / A).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headscope.model.attention.finish_rows import RowValues, softcapped

NO_REACH = 2**40  # a pattern's reach where its targets may be any distance back


@dataclass(frozen=True)
class KeyPatterns:
    """Some patterns' targets on one batch, in the forms the kernels read; (patterns, batch, t) each."""

    key_class: torch.Tensor  # long: each key's class (-1: no row's target)
    row_class: torch.Tensor  # long: each query row's class (-2: no targets)
    lag: torch.Tensor  # (patterns,) long: a row's targets are at least this far back (1: not the row itself)
    reach: torch.Tensor  # (patterns,) long: and at most this far back (NO_REACH: any distance)
    sorted_keys: torch.Tensor  # long: each sentence's keys by (class, position)
    run_begin: torch.Tensor  # long: where row t's run of targets starts in sorted_keys
    run_end: torch.Tensor  # long: and ends (its keys in t - reach .. t - lag)
    first_target: torch.Tensor  # bool: the sentence's first key is a target of row t

    @classmethod
    def of(cls, key_class: torch.Tensor, row_class: torch.Tensor, lag: torch.Tensor, seq_start: torch.Tensor,
           reach: torch.Tensor | None = None):  # fmt: skip
        """From the classes: key_class (patterns, batch, t) long, -1 where a key is no row's target; row_class
        (patterns, batch, t) long, -2 where a row has none; lag and reach (patterns,) long (reach None: NO_REACH
        each); seq_start (batch,) long."""
        patterns, batch, t = key_class.shape
        reach = torch.full((patterns,), NO_REACH) if reach is None else reach.long()
        positions = torch.arange(t, device=key_class.device)
        # (class, position) as one number; keys of no class sort first (below 0), where no row's run reaches
        order = torch.where(key_class >= 0, key_class * t + positions, positions - t)
        ordered, sorted_keys = torch.sort(order, dim=-1, stable=True)
        has = row_class >= 0
        # the run starts `reach` keys before the row's own (at its class's first key, where that is further), and
        # ends `lag` keys before it (after it, for lag 0)
        lags, reaches = (value.view(-1, 1, 1).long().to(positions.device) for value in (lag, reach))
        low = torch.where(has, row_class * t + (positions - reaches).clamp(min=0), -2 * t)
        high = torch.where(has, row_class * t + positions - lags, -2 * t)
        run_begin = torch.searchsorted(ordered, low, side="left")
        run_end = torch.maximum(torch.searchsorted(ordered, high, side="right"), run_begin)
        first_class = key_class.gather(-1, seq_start.view(1, batch, 1).expand(patterns, batch, 1))  # (patterns, b, 1)
        start = seq_start.view(1, batch, 1)
        first_in_reach = (start <= positions - lags) & (start >= positions - reaches)
        first_target = has & (first_class == row_class) & first_in_reach
        return cls(key_class, row_class, lags.view(-1), reaches.view(-1), sorted_keys, run_begin, run_end, first_target)

    @property
    def count(self) -> int:
        return self.key_class.shape[0]

    @classmethod
    def joined(cls, parts: list[KeyPatterns]) -> KeyPatterns:
        """Several readers' patterns as one (theirs in order along the first axis)."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(torch.cat([getattr(part, name) for part in parts]) for name in cls.__dataclass_fields__))

    def to(self, device: torch.device) -> KeyPatterns:
        return KeyPatterns(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))

    def kernel_arguments(self) -> dict[str, torch.Tensor]:
        """What the C++ kernel's row_state takes of them (kernels/row_state.cpp)."""
        return {"pattern_keys": self.sorted_keys, "pattern_begin": self.run_begin, "pattern_end": self.run_end}

    def targets(self, rows: slice | torch.Tensor, keys: int) -> torch.Tensor:
        """(patterns, batch, rows, keys) bool: the targets of query rows `rows` among the first `keys` keys (for
        tests and checks; the kernels never build it)."""
        row_class = self.row_class[..., rows]  # (patterns, batch, rows)
        row = torch.arange(self.row_class.shape[-1], device=row_class.device)[rows]
        key = torch.arange(keys, device=row_class.device)
        back = row[:, None] - key[None, :]  # (rows, keys): how far back each key is
        within = (back >= self.lag.view(-1, 1, 1)) & (back <= self.reach.view(-1, 1, 1))  # (patterns, rows, keys)
        same = self.key_class[..., None, :keys] == row_class[..., None]
        return same & (row_class[..., None] >= 0) & within[:, None]


@dataclass(frozen=True)
class PatternRows:
    """Every row's reading of the patterns, (patterns, batch, heads, rows) each."""

    match: torch.Tensor  # float64: the row's attention on its targets
    targets: torch.Tensor  # long: how many targets the row sees
    key: torch.Tensor  # long: the target it attends to most (the first holding it; -1: none)
    weight: torch.Tensor  # float32: its attention weight (0: none)

    def part(self, first: int, stop: int) -> PatternRows:
        """Patterns first .. stop - 1 of them."""
        return PatternRows(*(getattr(self, name)[first:stop] for name in self.__dataclass_fields__))


# Picked probabilities (patterns x batch x heads x rows x run width) read at once; past it, one pattern at a time. On
# short sentences the patterns together are a few tensor operations, not a few per pattern.
PICKED_AT_ONCE = 2**22


def read_probabilities(probs: torch.Tensor, visible: torch.Tensor, patterns: KeyPatterns, first_row: int):
    """PatternRows of probabilities the model computed (the eager path) or a block's recomputed from its logits: each
    row's targets picked from its run (a few keys, not a (rows x keys) matrix).
    probs: (batch, heads, rows, keys) of query rows first_row, first_row + 1, ...; visible: (batch or 1, 1, rows,
    keys) bool. The first key among the targets counts as any other (these probabilities hold it)."""
    batch, heads, rows, keys = probs.shape
    span = slice(first_row, first_row + rows)
    if patterns.count * probs.numel() <= PICKED_AT_ONCE:  # short rows: every key at once, fewer operations
        return _weighed(probs, patterns.targets(span, keys) & visible[None, :, 0])
    begin, end = patterns.run_begin[..., span], patterns.run_end[..., span]  # (patterns, batch, rows)
    width = max(1, int((end - begin).max()))
    offsets = begin[..., None] + torch.arange(width, device=probs.device)  # (patterns, batch, rows, width)
    inside = offsets < end[..., None]
    t = patterns.sorted_keys.shape[-1]
    target = patterns.sorted_keys.gather(-1, offsets.clamp(max=t - 1).flatten(2)).view(offsets.shape)
    target = torch.where(inside, target, 0).clamp(max=keys - 1)  # a run's keys are <= its row, < keys
    seen = inside & visible[:, 0].expand(batch, rows, keys)[None].expand(len(target), -1, -1, -1).gather(-1, target)
    if target.numel() * heads <= PICKED_AT_ONCE:
        return _picked(probs, target, seen)
    parts = [_picked(probs, one[None], hit[None]) for one, hit in zip(target, seen, strict=True)]
    fields = PatternRows.__dataclass_fields__
    return PatternRows(*(torch.cat([getattr(part, name) for part in parts]) for name in fields))


def _weighed(probs: torch.Tensor, hits: torch.Tensor) -> PatternRows:
    """PatternRows from the probabilities and every key's targets, hits (patterns, batch, rows, keys) bool."""
    shown = hits[:, :, None]  # (patterns, batch, 1, rows, keys)
    weight, key = torch.where(shown, probs[None], -1.0).max(-1)  # the first target (in key order) holding the most
    count = hits.sum(-1)[:, :, None].expand_as(weight)
    found = count > 0
    return PatternRows(
        match=(probs[None] * shown).sum(-1, dtype=torch.float64),
        targets=count,
        key=torch.where(found, key, -1),
        weight=torch.where(found, weight, 0.0),
    )


def _picked(probs: torch.Tensor, target: torch.Tensor, seen: torch.Tensor) -> PatternRows:
    """PatternRows from the probabilities at each row's targets: target, seen (patterns, batch, rows, width)."""
    patterns, batch, rows, width = target.shape
    heads = probs.shape[1]
    index = target[:, :, None].expand(patterns, batch, heads, rows, width)
    picked = probs[None].expand(patterns, -1, -1, -1, -1).gather(-1, index)
    shown = seen[:, :, None]
    weight, best = torch.where(shown, picked, -1.0).max(-1)  # the first target (in key order) holding the most
    found = shown.any(-1)
    return PatternRows(
        match=torch.where(shown, picked, 0.0).sum(-1, dtype=torch.float64),
        targets=seen.sum(-1)[:, :, None].expand(patterns, batch, heads, rows),
        key=torch.where(found, index.gather(-1, best[..., None])[..., 0], -1),
        weight=torch.where(found, weight, 0.0),
    )


def finish(folded: tuple, values: RowValues, first_target: torch.Tensor, seq_start: torch.Tensor) -> PatternRows:
    """The rows' PatternRows from what a kernel folded over their targets off the first key (`folded`: sum, count,
    best, key, (patterns, batch, heads, rows) each, relative to the fold's maximum), the rows' `values`, first_target
    (patterns, batch, rows) bool and seq_start (batch,) long. The first key is put back where it is a target the row
    sees: its weight is `values.sink`; the fold's sums scale by `values.rest_max_weight`, e^(m' - m) / A."""
    target_sum, count, best, key = folded
    scale = values.rest_max_weight.double()  # (batch, heads, rows)
    sink = values.sink.double()
    first = first_target[:, :, None, :] & values.first_visible[None]  # (patterns, batch, 1 or heads, rows)
    match = target_sum.double() * scale + torch.where(first, sink, 0.0)
    rest_weight = best.double() * scale
    # the first key is the sentence's earliest: it wins a tie, as an argmax over the keys in order gives it
    takes_first = first & (sink >= rest_weight)
    return PatternRows(
        match=match,
        targets=count + first.long(),
        key=torch.where(takes_first, seq_start.view(1, -1, 1, 1), key),
        weight=torch.where(takes_first, sink, rest_weight).float(),
    )


def fold_reference(
    grouped_query, key, visibility, rows, softcap, first_key, patterns: KeyPatterns, at_keys: torch.Tensor | None = None
) -> tuple:
    """What a kernel folds of the patterns' targets (sum, count, best, key, (patterns, batch, heads, rows) each), by
    plain tensor operations on the rows' whole logits: the check of a kernel's first result (a few rows). With
    `at_keys` (another fold's keys, shaped as `key`), a fifth: e^(s - m) at those keys (0 at -1), to tell a near tie
    from a wrong key. grouped_query: (batch, kv_heads, groups, rows, head_dim), scaled; key: (batch, kv_heads, keys,
    head_dim); visibility: masks.TileVisibility; rows: (rows,) long positions; first_key: (batch,) long."""
    batch, kv_heads, groups, n_rows, _ = grouped_query.shape
    keys = key.shape[2]
    scores = softcapped(torch.matmul(grouped_query, key[:, :, None].transpose(-1, -2)), softcap)
    scores = scores.reshape(batch, kv_heads * groups, n_rows, keys)
    positions = torch.arange(keys, device=key.device)
    seen = visibility.points(rows, positions.expand(batch, n_rows, keys))  # (batch, 1, rows, keys)
    seen = seen & (positions != first_key.view(-1, 1, 1, 1))
    m = torch.where(seen, scores, -torch.inf).amax(-1, keepdim=True)
    exponentials = torch.where(seen, torch.exp(scores - m), 0.0)
    hits = patterns.targets(rows, keys)[:, :, None] & seen[None]  # (patterns, batch, 1, rows, keys)
    count = hits.sum(-1).expand(-1, -1, kv_heads * groups, -1)
    target_logits = torch.where(hits, scores[None], -torch.inf)
    best_logit, best_key = target_logits.max(-1)
    found = count > 0
    best = torch.where(found, torch.exp(best_logit - m[None, ..., 0]), 0.0)
    folded = ((exponentials[None] * hits).sum(-1), count, best, torch.where(found, best_key, -1))
    if at_keys is None:
        return folded
    at = exponentials[None].expand(len(at_keys), -1, -1, -1, -1).gather(-1, at_keys.clamp(min=0)[..., None])[..., 0]
    return (*folded, torch.where(at_keys >= 0, at, 0.0))
