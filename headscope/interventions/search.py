"""Which heads can go together within a loss budget: a search whose every accepted step is verified.

The search knows the model only through two functions:
- estimate(removed) -> Estimate: the exact corpus loss with `removed` removed together, and {head: estimated loss
  increase of also removing it} for every head still in the model (headscope's is one gradient pass through the
  pruned model: its forward gives the loss, its backward a second-order estimate, so the ranking follows what the
  model has become);
- verify(sets) -> [loss], the exact corpus loss with each set of heads removed together (one forward pass,
  the sets as replicas of the batch).

The clean loss is the first estimate's (nothing removed), and so is the first round's ranking. A round ranks the
heads still in the model by estimated cost (a head whose removal lowers the loss first), then:
1. a step, trusting the estimate: of the longest prefix of the ranking (at most `first_shortlist` heads in the
   first round, `longest` later) whose estimates add up to within the budget left, STEP_SHARE (half) is removed in
   one gradient pass on the model pruned so far. The estimates underpredict what a set costs together (about
   twofold for sets of 20-50 heads on SmolLM2), and half of the prefix they fit is the size that mostly fits. The
   pass's forward verifies the step (its loss with every removed head removed together) and its backward ranks the
   next round: where the step fits the budget, the round is done in that one pass;
2. where it overshoots, nested smaller sizes (half of it, a quarter, ... 1) are verified in a replicated pass, the
   two largest first and the smaller ones only where neither fits, and the largest that fits is accepted (the next
   round then begins with a gradient pass on the model it left);
3. where none fits, the estimate has stopped predicting, and the round measures: the `shortlist`
   (`first_shortlist` in the first round) best-ranked heads are each verified alone on top of the heads removed,
   their exact marginal costs; then packing: the shortlist, cheapest exact cost first, is predicted to add its
   costs; the longest prefix predicted to stay within the round's allowance (half of the budget left when it
   began; the whole budget for a first step) is verified with nested smaller ones likewise, the largest verified
   fit accepted, and packing goes on down the shortlist until the allowance is spent or no verified size fits. A
   round that accepted nothing takes its cheapest head, if it fits the budget.

The first step is the one-shot answer: the best-ranked heads of the clean model removed together, as many as their
estimates (or, where parts 1 and 2 found nothing, their exact costs alone) say the budget allows; every later step
adds to it, so the search is never behind the answer one pass verified.

It stops when not one shortlisted head fits alone, after `max_rounds` rounds, or by patience: when `patience`
rounds in a row each add fewer than 4% of the candidate heads *and* the next round is expected to add fewer than
that too: STEP_SHARE of the heads the budget left buys by the latest ranking's estimates (or, where the round's
heads were verified by a replicated pass, at the verified cost per head of the heads it added). A round costs a
gradient pass, about two and a half forward passes: near the budget each adds a few heads (on SmolLM2, 10, 7, 6,
3, 2 after the first 120); far from it a round goes on, however few heads it added (on a small model one head is
more than 4%, and a rule on the share of heads alone stopped a search with a quarter of its budget unspent).
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


MIN_GAIN_SHARE = 0.04  # a round that adds fewer than this share of the candidates (and whose next round is
# expected to add fewer too) counts against patience
ROUND_SHARE = 0.5  # a packing round may spend this share of the budget left when it began
STEP_SHARE = 0.5  # a step removes this share of the prefix its estimates fit within the budget left: they
# underpredict a set's joint cost (about twofold for sets of 20-50 heads on SmolLM2)
FIRST_SIZES = 2  # nested sizes verified in a replicated pass's first pass (the smaller ones only where neither fits)


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
    longest: int = 96,
    tries: int = 4,
    patience: int = 2,
    max_rounds: int | None = None,
    on_step: Callable[[PruneResult], None] | None = None,
) -> PruneResult:
    """Remove as many of `all_heads` as `budget` (nats above `clean_loss`) allows; see the module's docstring.

    shortlist, first_shortlist: heads verified alone in a round that measures (the first round), first_shortlist
    also the longest prefix the first round trusts to its estimate; longest: ... a later round; tries: nested sizes
    verified per replicated pass (the last is 1); patience: rounds in a row adding under 4% of the heads, with a
    next round expected to add fewer too, before it stops (0: never); max_rounds: at most this many rounds (None: no
    limit)."""
    result = PruneResult(budget=budget, clean_loss=math.nan)
    ranking: Estimate | None = _estimated(estimate, result, [])  # the clean loss, and the first round's ranking
    result.clean_loss = result.loss = ranking.loss
    result.curve = [(0, ranking.loss)]
    limit = ranking.loss + budget
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
        if ranking is None:  # the last round's heads were verified by a replicated pass: rank the model they left
            ranking = _estimated(estimate, result, result.heads)
        ranked = sorted(remaining, key=lambda head: (ranking.costs[head], head))
        stepped = _step(result, ranked[:first_shortlist if result.rounds == 1 else longest], ranking.costs,
                        estimate, verify, limit, tries, on_step)  # fmt: skip
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
        # the model changed: its ranking is the step's gradient pass's, or none yet (heads a replicated pass took)
        ranking = stepped if len(result.heads) > before else ranking
        added = len(result.heads) - before
        stalled = (
            stalled + 1 if added < min_gain and _next_gain(result, ranking, added, loss_before, limit) < min_gain else 0
        )
    return result


def _next_gain(result: PruneResult, ranking: Estimate | None, added: int, loss_before: float, limit: float) -> float:
    """How many heads the next round is expected to add: STEP_SHARE of those the budget left buys by the estimates
    of the ranking in hand; where the round's heads were verified by a replicated pass (no ranking of the model they
    left), of those it buys at the verified cost per head of the `added` heads (infinite where they cost nothing or
    lowered the loss; 0 where the round took none)."""
    if ranking is not None:
        return STEP_SHARE * _longest_fit(result.loss, sorted(ranking.costs.values()), limit)
    if added == 0:
        return 0.0
    per_head = (result.loss - loss_before) / added
    return math.inf if per_head <= 0 else STEP_SHARE * (limit - result.loss) / per_head


def _step(
    result: PruneResult,
    ranked: list[Head],
    estimates: dict[Head, float],
    estimate,
    verify,
    limit: float,
    tries: int,
    on_step,
) -> Estimate | None:
    """Parts 1 and 2: trust the estimate. STEP_SHARE of the longest prefix of `ranked` (cheapest estimate first) whose
    estimates add up to within the budget left is removed in a gradient pass: its loss verifies the step, its
    ranking is the next round's (returned; None where the step overshot and the round goes on without it). Where it
    overshoots, smaller nested sizes are verified in one replicated pass and the largest that fits accepted."""
    first = not result.heads
    top = _longest_fit(result.loss, [estimates[head] for head in ranked], limit)
    if top == 0:
        return None
    step = max(1, int(top * STEP_SHARE))
    found = _estimated(estimate, result, result.heads + ranked[:step])
    if found.loss <= limit:
        _accept(result, ranked[:step], found.loss, on_step, one_shot=first)
        return found
    if step > 1:
        sizes = nested_sizes(step // 2, tries)
        size, losses = _largest_fit(verify, result, sizes, lambda size: result.heads + ranked[:size], limit)
        if size:
            _accept(result, ranked[:size], losses[size], on_step, one_shot=first)
    return None


def _pack(
    result: PruneResult, costs: dict[Head, float], verify, limit: float, tries: int, on_step, *, one_shot: bool
) -> None:
    """Part 3, packing: accept prefixes of the shortlist, cheapest exact cost first, while a verified size fits the
    round's allowance: half of the budget left when the round began (the whole budget for the first round's first pass:
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
