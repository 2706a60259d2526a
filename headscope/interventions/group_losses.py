"""Heads removed together: the model's next-token loss with a group of heads' outputs replaced, per sentence.

Definitions (docs/ablate-prune.md has them too):
- removing a head: interventions.removal (zero, or the head's clean corpus mean, at every position).
- scored tokens: `all`, every predicted token (a sentence of T tokens predicts T - 1); `repeats`, the tokens an
  induction head can predict: x[t] (t >= 2) counts iff some j < t - 1 has x[j] == x[t-1] and x[j+1] == x[t]
  (`repeat_tokens`).
- loss: mean next-token cross-entropy (nats) over the scored tokens, token-weighted over the corpus.
- a group's delta: its loss minus the clean loss on the same tokens; the 95% interval is a paired Poisson
  bootstrap over sentences (estimates.replicate_ratios: the same draws in any order or batching of the corpus).

Several groups share one clean pass per batch: the batch is replicated along the batch axis, each replica with
its own group removed, and the decoder layers before the first removed head are skipped (they hand on what they
returned on the clean pass).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from headscope.config import LOSS_ON
from headscope.estimates import MIN_BOOTSTRAP_SENTENCES, percentile_interval, replicate_ratios
from headscope.interventions.clean_prefix import CleanPrefix
from headscope.interventions.loss import token_nll
from headscope.interventions.removal import Head, Removal, RemovedHeads
from headscope.model.batch import Batch
from headscope.model.layer_outputs import replicate
from headscope.progress import Reporter
from headscope.run.distributed import Ranks, gather, together

SCORINGS = LOSS_ON


def repeat_tokens(ids: Sequence[int]) -> np.ndarray:
    """(len(ids),) bool: True at t when the bigram (ids[t-1], ids[t]) occurred earlier: some j < t - 1 has
    ids[j] == ids[t-1] and ids[j+1] == ids[t] (so t >= 2), the tokens an induction head can predict."""
    flags = np.zeros(len(ids), dtype=bool)
    seen: set[tuple[int, int]] = set()
    for t in range(1, len(ids)):
        bigram = (ids[t - 1], ids[t])
        flags[t] = bigram in seen  # seen holds the bigrams ending at 1..t-1, i.e. starting at j < t - 1
        seen.add(bigram)
    return flags


def scored_targets(batch: Batch, scoring: str) -> torch.Tensor:
    """(batch, t - 1) bool: position p's prediction (of the token at p + 1) is scored. Padding never is."""
    valid = batch.attention_mask.bool()
    predicted = valid[:, :-1] & valid[:, 1:]
    if scoring == "all":
        return predicted
    ids, real = batch.input_ids.cpu().numpy(), valid.cpu().numpy()
    repeats = np.zeros(ids.shape, dtype=bool)
    for row in range(len(ids)):
        repeats[row, real[row]] = repeat_tokens(ids[row, real[row]].tolist())
    return predicted & torch.from_numpy(repeats[:, 1:]).to(predicted.device)


@dataclass
class GroupLosses:
    """Per sentence: the clean and each group's summed loss (nats) on each scoring's tokens, and the token counts."""

    sentence_ids: list[int] = field(default_factory=list)
    tokens: dict[str, list[np.ndarray]] = field(default_factory=dict)  # scoring -> per batch (sentences,)
    clean: dict[str, list[np.ndarray]] = field(default_factory=dict)  # scoring -> per batch (sentences,)
    ablated: dict[str, list[np.ndarray]] = field(default_factory=dict)  # scoring -> per batch (groups, sentences)

    def add(self, scoring: str, tokens: np.ndarray, clean: np.ndarray, ablated: np.ndarray) -> None:
        """One batch's sums on `scoring`: tokens and clean (sentences,), ablated (groups, sentences)."""
        self.tokens.setdefault(scoring, []).append(tokens)
        self.clean.setdefault(scoring, []).append(clean)
        self.ablated.setdefault(scoring, []).append(ablated)

    @classmethod
    def dealt(cls, shares: Sequence[GroupLosses]) -> GroupLosses:
        """The losses of a corpus whose batches were dealt round-robin (batch i to share i % len(shares)), in the
        order one process would have seen them: the same arrays, so the same sums in the same order."""
        merged = cls()
        sentence_ids = []
        for share in shares:  # each share's sentence ids, split by its batches
            sizes = [len(tokens) for tokens in next(iter(share.tokens.values()), [])]
            ids = np.asarray(share.sentence_ids, dtype=int)
            sentence_ids.append(np.split(ids, np.cumsum(sizes)[:-1]) if sizes else [])
        for index in range(sum(len(ids) for ids in sentence_ids)):
            share, batch = shares[index % len(shares)], index // len(shares)
            merged.sentence_ids.extend(int(i) for i in sentence_ids[index % len(shares)][batch])
            for scoring in share.tokens:
                merged.add(scoring, share.tokens[scoring][batch], share.clean[scoring][batch],
                           share.ablated[scoring][batch])  # fmt: skip
        return merged

    def arrays(self, scoring: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens (S,), clean (S,), ablated (groups, S)) over every sentence, in the order seen."""
        return (
            np.concatenate(self.tokens[scoring]),
            np.concatenate(self.clean[scoring]),
            np.concatenate(self.ablated[scoring], axis=1),
        )


def group_losses(
    capture,
    batches: Callable[[], Iterable[Batch]],
    groups: Sequence[Sequence[Head]],
    removal: Removal | Sequence[Removal],
    *,
    scorings: Sequence[str] = ("all",),
    replicas_per_forward: Callable[[Batch], int],
    reporter: Reporter | None = None,
    base: Sequence[Head] = (),
    clean: bool = True,
    prefix: CleanPrefix | None = None,
) -> GroupLosses:
    """Every sentence's clean loss and its loss with each group of heads removed together, on each scoring.

    capture: an attached causal LM; batches() -> the corpus's batches; replicas_per_forward(batch) -> how many
    replicas of `batch` one forward pass may hold; removal: one for every group, or one per group. base: heads every
    group holds (all groups removing them the same way); the first pass removes them
    (its losses are then the "clean" ones) and each group's replica starts at the first layer where it removes
    more, so that groups which differ from the base only in late layers cost only those layers. Without `clean`
    (a caller that reads only the groups' losses) the first pass stops at the last layer a replica starts from, and
    the clean sums are NaN. prefix: the clean model's layers below every group's heads, run once already (every
    pass starts after them)."""
    result = GroupLosses()
    base, depth = set(base), len(capture.decoder)
    skipped = prefix.layer if prefix is not None else 0
    for batch in batches():
        start_at = {"start_at": skipped, "handed_on": prefix.handed_on(batch)} if prefix is not None else {}
        masks = {scoring: scored_targets(batch, scoring) for scoring in scorings}
        shape = masks[scorings[0]].shape  # (sentences, t - 1): a batch's per-token losses
        removals = [removal] * len(groups) if isinstance(removal, Removal) else list(removal)
        first = [RemovedHeads([sorted(base)], removals[0], len(batch.sentence_ids))] if base and groups else []
        passes = replica_passes(groups, base, depth, max(1, replicas_per_forward(batch)))
        assert all(start >= skipped for start, _ in passes), "a group removes a head the prefix ran clean"
        handing_on = _handing_on(passes, clean)
        if handing_on is None:
            output, outputs = capture.run_keeping_layers(batch, editors=first, **start_at)
            nll = token_nll(output.logits, batch)
            del output
        else:  # only what the replicas start from: no logits, no clean loss
            outputs = [None] * depth
            if handing_on > skipped:
                outputs = capture.run_keeping_layers(batch, editors=first, through=handing_on, **start_at)[1]
            nll = None
        if prefix is not None:
            outputs[skipped - 1] = start_at["handed_on"]
        ablated = {scoring: np.zeros((len(groups), len(batch.sentence_ids))) for scoring in scorings}
        for start, members in passes:
            chunk = [groups[index] for index in members]
            replicated = batch.replicated(len(chunk))
            editor = RemovedHeads(chunk, [removals[index] for index in members], len(batch.sentence_ids))
            handed_on = replicate(outputs[start - 1], len(chunk)) if start > 0 else None
            logits = capture.run(replicated, editors=[editor], start_at=start, handed_on=handed_on).logits
            replica_nll = token_nll(logits, replicated).view(len(chunk), *shape)  # (groups, sentences, t - 1)
            del logits
            for scoring, mask in masks.items():
                ablated[scoring][members] = torch.where(mask, replica_nll, 0.0).sum(-1).cpu().numpy()
        for scoring, mask in masks.items():
            clean_sums = (torch.where(mask, nll, 0.0).sum(-1).cpu().numpy() if nll is not None
                          else np.full(len(batch.sentence_ids), np.nan))  # fmt: skip
            result.add(scoring, mask.sum(-1).cpu().numpy(), clean_sums, ablated[scoring])
        result.sentence_ids.extend(batch.sentence_ids)
        if reporter is not None:
            reporter.advance(len(batch.sentence_ids), batch.n_tokens)
    return result


def _handing_on(passes: list[tuple[int, list[int]]], clean: bool) -> int | None:
    """Where the first pass of a batch may stop: None when it must run whole (the clean loss is asked for, or
    there is no replica), else the last layer a replica starts from (0: no first pass at all)."""
    if clean or not passes:
        return None
    return max(start for start, _ in passes)


def shared_group_losses(ranks: Ranks, capture, batches, *args, **kwargs) -> GroupLosses:
    """group_losses over this rank's share of the corpus (`batches()` yields it: `distributed.share_of`), put
    together on every rank in the order one process sees the batches: the same arrays as one process's, so the same
    sums. A failure on any rank stops every rank with its message."""
    share = together(ranks, lambda: group_losses(capture, batches, *args, **kwargs))
    return GroupLosses.dealt(gather(ranks, share)) if ranks.parallel else share


@dataclass(frozen=True)
class PassPlan:
    """What group_losses will run, counted before it runs: forward passes (one clean pass per batch, then the
    replicated ones), decoder-layer runs (a pass that starts at layer s runs depth - s layers) and token-layers
    (each replica's real tokens times the layers its pass runs: the work a model's size multiplies)."""

    forwards: int = 0
    layer_runs: int = 0
    token_layers: int = 0

    def __add__(self, other: PassPlan) -> PassPlan:
        return PassPlan(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def describe(self, depth: int) -> str:
        return (f"{self.forwards:,} forward passes, {self.token_layers / max(depth, 1):,.0f} token-forwards "
                f"(whole-model equivalents)")  # fmt: skip


def planned_passes(
    batches: Iterable[Batch], groups: Sequence[Sequence[Head]], depth: int,
    replicas_per_forward: Callable[[Batch], int], base: Sequence[Head] = (), clean: bool = True, skipped: int = 0,
) -> PassPlan:  # fmt: skip
    """The PassPlan of group_losses over `batches` (the same replica_passes it runs, the same first pass); skipped:
    the layers a clean prefix ran already."""
    forwards = layer_runs = token_layers = 0
    for batch in batches:
        passes = replica_passes(groups, set(base), depth, max(1, replicas_per_forward(batch)))
        handing_on = _handing_on(passes, clean)
        first = max(0, (depth if handing_on is None else handing_on) - skipped)
        forwards, layer_runs = forwards + bool(first), layer_runs + first
        token_layers += batch.n_tokens * first
        for start, members in passes:
            forwards += 1
            layer_runs += depth - start
            token_layers += batch.n_tokens * len(members) * (depth - start)
    return PassPlan(forwards, layer_runs, token_layers)


def replica_passes(groups, base: set, depth: int, per_forward: int) -> list[tuple[int, list[int]]]:
    """The replicated forward passes for `groups` of heads: (first layer to run, the groups' indices), at most
    `per_forward` groups each, every group in a pass that starts at its own first changed layer beyond `base` (a
    pass that started earlier would recompute unchanged layers for it). Ablation's groups and patching's heads."""
    starts = {}
    for index, group in enumerate(groups):
        extra = [layer for layer, head in group if (layer, head) not in base]
        starts.setdefault(min(min(extra, default=depth - 1), depth - 1), []).append(index)
    return [
        (start, members[first : first + per_forward])
        for start, members in sorted(starts.items())
        for first in range(0, len(members), per_forward)
    ]


def group_effect(losses: GroupLosses, group: int, scoring: str, *, replicates: int, seed: int) -> dict:
    """One group's effect on one scoring: tokens, clean_loss, ablated_loss, delta and its 95% paired bootstrap
    interval over sentences (delta_ci_low, delta_ci_high; None without replicates or tokens)."""
    tokens, clean, ablated = losses.arrays(scoring)
    ablated = ablated[group]
    count = int(tokens.sum())
    effect = {"tokens": count, "clean_loss": None, "ablated_loss": None, "delta": None}
    effect |= {"delta_ci_low": None, "delta_ci_high": None}
    if count == 0:
        return effect
    effect["clean_loss"] = float(clean.sum() / count)
    effect["ablated_loss"] = float(ablated.sum() / count)
    effect["delta"] = float((ablated - clean).sum() / count)
    if replicates and (tokens > 0).sum() >= MIN_BOOTSTRAP_SENTENCES:  # one sentence has no spread to resample
        deltas = replicate_ratios(np.asarray(losses.sentence_ids), replicates, seed, ablated - clean, tokens)
        low, high = percentile_interval(deltas)
        effect["delta_ci_low"], effect["delta_ci_high"] = float(low), float(high)
    return effect
