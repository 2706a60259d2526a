"""Which heads can go together within a loss budget: a search whose every accepted step is verified.

The search knows the model only through two functions:
- estimate(removed) -> Estimate: the exact corpus loss with `removed` removed together, and {head: estimated loss
  increase of also removing it} for every head still in the model (headscope's is one gradient pass through the
  pruned model: its forward gives the loss, its backward a second-order estimate, so the ranking follows what the
  model has become);
- verify(sets) -> [loss], the exact corpus loss with each set of heads removed together (one forward pass,
  the sets as replicas of the batch).

The clean loss is the first estimate's (nothing removed). Each round begins with the estimate on the model pruned
so far, which ranks the remaining heads by estimated cost (a head whose removal lowers the loss first), then:
1. trusting the estimate: the longest prefix of the ranking (at most `first_shortlist` heads) whose estimates add
   up to within the round's allowance (half of the budget left when the round began: a round does not spend the
   budget on heads a later round may find cheaper) is verified with nested smaller ones (size, size/2, ... 1), and
   the largest verified fit accepted: the two largest in one pass, the smaller ones in a second only where neither
   fits (the same answer as verifying them all at once, at half the replicas where the larger sizes fit). If it
   took any head, the round is done: one gradient pass and one replicated pass;
2. else the estimate has stopped predicting, and the round measures: the `shortlist` (`first_shortlist` in the
   first round) best-ranked heads are each verified alone on top of the heads removed, their exact marginal costs;
3. packing, with no further gradient pass: the shortlist, cheapest exact cost first, is predicted to add its
   costs; the longest prefix predicted to stay within the allowance is verified with nested smaller ones likewise,
   the largest verified fit accepted, and packing goes on down the shortlist until the allowance is spent or no
   verified size fits. A round that accepted nothing takes its cheapest head, if it fits the budget.

The first step is the one-shot answer: its allowance is the whole budget, so it verifies the best-ranked heads
removed together, as many as their estimates (or, where part 1 found nothing, their exact costs alone) say the
budget allows, and accepts the largest that fits; every later step adds to it, so the search is never behind the
answer one pass verified.

It stops when not one shortlisted head fits alone, after `max_rounds` rounds, or by patience: when `patience`
rounds in a row each add fewer than 2% of the candidate heads *and* leave a budget that, at the verified cost per
head of the heads they added, buys fewer than that many more (a round near the budget pays a gradient pass and a
replicated pass for a head or two; a round far from it goes on, however few heads it added: on a small model one
head is more than 2%, and a rule on the share of heads alone stopped a search with a quarter of its budget unspent).
The loss of the accepted set is always a verified one, so the result never exceeds the budget.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

Head = tuple[int, int]


@dataclass(frozen=True)
class Estimate:
    loss: float  # exact: the corpus loss with the heads asked about removed together
    costs: dict[Head, float]  # each head still in the model: the estimated loss increase of also removing it


MIN_GAIN_SHARE = 0.02  # a round that adds fewer than this share of the candidates (and whose budget left buys
# fewer than as many more, at its verified cost per head) counts against patience
ROUND_SHARE = 0.5  # a round may spend this share of the budget left when it began
FIRST_SIZES = 2  # nested sizes verified in a packing step's first pass (the smaller ones only where neither fits)


@dataclass
class PruneResult:
    budget: float  # nats above the clean loss
    clean_loss: float
    heads: list[Head] = field(default_factory=list)  # removed, in removal order
    loss: float = float("nan")  # verified, every head of `heads` removed together
    curve: list[tuple[int, float]] = field(default_factory=list)  # (heads removed, verified loss) per accepted step
    set_aside: list[Head] = field(default_factory=list)  # the last shortlist: each overshot the budget alone
    verified_sets: int = 0  # sets verified by a replicated pass (a gradient pass verifies the set it removes too)
    verify_calls: int = 0  # replicated passes over the corpus (each one shared pass and replicas)
    estimates: int = 0  # gradient passes over the corpus (the first gives the clean loss)
    rounds: int = 0
    one_shot: int = 0  # heads of the one-shot answer: the first step, the best-ranked heads together
    stopped: str = ""  # why the search ended


def prune_search(
    all_heads: Sequence[Head],
    *,
    budget: float,
    estimate: Callable[[list[Head]], Estimate],
    verify: Callable[[list[list[Head]]], list[float]],
    shortlist: int = 8,
    first_shortlist: int = 48,
    tries: int = 4,
    patience: int = 2,
    max_rounds: int | None = None,
    on_step: Callable[[PruneResult], None] | None = None,
) -> PruneResult:
    """Remove as many of `all_heads` as `budget` (nats above `clean_loss`) allows; see the module's docstring.

    shortlist, first_shortlist: heads verified alone in a round that measures (the first round), first_shortlist
    also the longest prefix a round trusts to its estimate; tries: nested sizes verified
    per packing pass (the last is 1); patience: rounds in a row adding under 2% of the heads, with a budget left
    that buys fewer than that many more, before it stops (0: never); max_rounds: at most this many rounds (None: no
    limit)."""
    result = PruneResult(budget=budget, clean_loss=math.nan)
    clean = _estimated(estimate, result, [])  # the clean loss, and the first round's ranking
    result.clean_loss = result.loss = clean.loss
    result.curve = [(0, clean.loss)]
    limit = clean.loss + budget
    min_gain = max(1, math.ceil(MIN_GAIN_SHARE * len(all_heads)))
    stalled = 0
    while True:
        removed = set(result.heads)
        remaining = [head for head in all_heads if head not in removed]
        if not remaining:
            result.stopped = "every head removed"
            break
        if max_rounds is not None and result.rounds >= max_rounds:
            result.stopped = f"max_rounds: {max_rounds} rounds"
            break
        if patience and stalled >= patience:
            result.stopped = (f"patience: {patience} rounds in a row added fewer than {min_gain} heads each, with a "
                              "budget left for fewer than that many more")  # fmt: skip
            break
        result.rounds += 1
        before, loss_before = len(result.heads), result.loss
        estimates = (clean if result.rounds == 1 else _estimated(estimate, result, result.heads)).costs
        ranked = sorted(remaining, key=lambda head: (estimates[head], head))
        _pack_estimated(result, ranked[:first_shortlist], estimates, verify, limit, tries, on_step)
        if len(result.heads) == before:  # the estimate has stopped predicting: measure
            candidates = ranked[: first_shortlist if result.rounds == 1 else shortlist]
            singles = _verified(verify, [[*result.heads, h] for h in candidates], result)
            alone = [loss - result.loss for loss in singles]
            if result.loss + min(alone) > limit:  # not one of the likeliest heads fits: the rest would cost more
                result.set_aside = list(candidates)
                result.stopped = "no shortlisted head fits alone"
                break
            costs = dict(zip(candidates, alone, strict=True))
            _pack(result, costs, verify, limit, tries, on_step, one_shot=not result.heads)
        added = len(result.heads) - before
        stalled = stalled + 1 if added < min_gain and _buys(result, added, loss_before, limit) < min_gain else 0
    return result


def _buys(result: PruneResult, added: int, loss_before: float, limit: float) -> float:
    """How many more heads the budget left buys at the verified cost per head of the `added` heads the round took
    (infinite where they cost nothing, or lowered the loss; 0 where it took none)."""
    if added == 0:
        return 0.0
    per_head = (result.loss - loss_before) / added
    return math.inf if per_head <= 0 else (limit - result.loss) / per_head


def _pack_estimated(
    result: PruneResult, ranked: list[Head], estimates: dict[Head, float], verify, limit: float, tries: int, on_step
) -> None:
    """Part 1: trust the estimate. The longest prefix of `ranked` (cheapest estimate first) whose estimates add up
    to within the allowance (the whole budget for the first step: the one-shot answer; else half of what is left) is
    verified with nested smaller ones (`_largest_fit`), and the largest that fits accepted."""
    first = not result.heads
    ceiling = limit if first else _allowance(result.loss, limit)
    top = _longest_fit(result.loss, [estimates[head] for head in ranked], ceiling)
    if top == 0:
        return
    sizes = nested_sizes(top, tries)
    size, losses = _largest_fit(verify, result, sizes, lambda size: result.heads + ranked[:size], ceiling)
    if size:
        _accept(result, ranked[:size], losses[size], on_step, one_shot=first)


def _pack(
    result: PruneResult, costs: dict[Head, float], verify, limit: float, tries: int, on_step, *, one_shot: bool
) -> None:
    """Part 3: accept prefixes of the shortlist, cheapest exact cost first, while a verified size fits the round's
    allowance: half of the budget left when the round began (the whole budget for the first round's first pass:
    the one-shot answer)."""
    pool = sorted(costs, key=lambda head: (costs[head], head))
    known = {1: result.loss + costs[pool[0]]}  # a size of one is the cheapest head, verified alone already
    ceiling = limit if one_shot else _allowance(result.loss, limit)
    accepted = 0
    while pool and result.loss + costs[pool[0]] <= limit:
        top = _longest_fit(result.loss, [costs[head] for head in pool], ceiling)
        if top == 0 and accepted:
            break  # the round has spent its allowance: a later round may find cheaper heads
        sizes = nested_sizes(max(top, 1), tries)
        prefixes = functools.partial(_with_prefix, result.heads, pool)
        size, losses = _largest_fit(verify, result, sizes, prefixes, ceiling if top else limit, known)
        if size == 0:
            break
        if one_shot and not accepted:
            ceiling = _allowance(losses[size], limit)  # the round goes on as any
        _accept(result, pool[:size], losses[size], on_step, one_shot=one_shot and not accepted)
        accepted += size
        pool, known = pool[size:], {}


def _largest_fit(
    verify, result: PruneResult, sizes: list[int], set_of, ceiling: float, known: dict[int, float] | None = None
) -> tuple[int, dict[int, float]]:
    """The largest of the nested `sizes` (largest first) whose set, set_of(size), verifies within `ceiling`, and the
    losses verified (`known`: sizes verified already): (0, losses) where none does. The two largest go first, in one
    pass; the smaller ones only where neither fits. The answer is the one verifying every size at once would give
    (any size that fits beats every smaller one), at two replicas a pass where the larger sizes fit, as they mostly
    do, instead of all of them."""
    losses = dict(known or {})
    for part in (sizes[:FIRST_SIZES], sizes[FIRST_SIZES:]):
        asked = [size for size in part if size not in losses]
        losses |= dict(zip(asked, _verified(verify, [set_of(size) for size in asked], result), strict=True))
        fitting = [size for size in part if losses[size] <= ceiling]
        if fitting:
            return max(fitting), losses
    return 0, losses


def _with_prefix(heads: list[Head], pool: list[Head], size: int) -> list[Head]:
    return heads + pool[:size]


def _allowance(loss: float, limit: float) -> float:
    """The loss a round may reach from `loss`: ROUND_SHARE of the budget left on top of it."""
    return min(limit, loss + ROUND_SHARE * (limit - loss))


def _longest_fit(loss: float, costs: list[float], ceiling: float) -> int:
    """How many of `costs`, in order, are predicted (added to `loss`) to stay within `ceiling`: the longest such
    prefix (a later negative cost can bring a longer one back within it)."""
    predicted = accumulate(costs, initial=loss)
    return max([size for size, total in enumerate(predicted) if size and total <= ceiling], default=0)


def nested_sizes(step: int, tries: int) -> list[int]:
    """step, step/2, step/4, ... down to 1, at most `tries` of them, always ending at 1: largest first."""
    sizes = []
    size = step
    while size > 1 and len(sizes) < tries - 1:
        sizes.append(size)
        size //= 2
    return [*sizes, 1]


def _estimated(estimate, result: PruneResult, removed: list[Head]) -> Estimate:
    result.estimates += 1
    return estimate(list(removed))


def _verified(verify, sets: list[list[Head]], result: PruneResult) -> list[float]:
    if not sets:
        return []
    result.verified_sets += len(sets)
    result.verify_calls += 1
    return list(verify(sets))


def _accept(result: PruneResult, heads: list[Head], loss: float, on_step, *, one_shot: bool = False) -> None:
    if one_shot:
        result.one_shot = len(heads)
    result.heads.extend(heads)
    result.loss = loss
    result.curve.append((len(result.heads), loss))
    if on_step is not None:
        on_step(result)
