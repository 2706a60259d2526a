"""Which heads can go together within a loss budget: an iterative search whose every step is verified.

The search knows the model only through two functions:
- estimate(removed) -> {head: estimated loss increase of also removing it}, for every head still in the model,
  with `removed` already removed (headscope's is the first-order attribution of one gradient pass through the
  pruned model, so the ranking follows what the model has become);
- verify(sets) -> [loss], the exact corpus loss with each set of heads removed together (one forward pass,
  the sets as replicas of the batch).

Each round shortlists the remaining heads whose estimate is smallest in magnitude (signed estimates fail in
saturated layers, where a head's removal costs more than its gradient says), verifies removing each of them alone
on top of the heads removed so far, orders them by that exact cost (a head whose removal lowers the loss first),
and verifies removing the first s of that order together for a few nested sizes s at once (step, step/2, ...; 1).
The largest size whose verified loss stays within the budget is accepted; the step doubles after a full step and
shrinks to what fitted otherwise. When not one shortlisted head fits alone, the search ends. The loss of the
accepted set is always a verified one, so the result never exceeds the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Head = tuple[int, int]


@dataclass
class PruneResult:
    budget: float  # nats above the clean loss
    clean_loss: float
    heads: list[Head] = field(default_factory=list)  # removed, in removal order
    loss: float = float("nan")  # verified, every head of `heads` removed together
    curve: list[tuple[int, float]] = field(default_factory=list)  # (heads removed, verified loss) per accepted step
    set_aside: list[Head] = field(default_factory=list)  # the last shortlist: each overshot the budget alone
    verified_sets: int = 0  # sets verified by a forward pass


def prune_search(
    all_heads: Sequence[Head],
    *,
    clean_loss: float,
    budget: float,
    estimate: Callable[[list[Head]], dict[Head, float]],
    verify: Callable[[list[list[Head]]], list[float]],
    shortlist: int = 32,
    tries: int = 4,
    first_step: int | None = None,
    on_step: Callable[[PruneResult], None] | None = None,
) -> PruneResult:
    """Remove as many of `all_heads` as `budget` (nats above `clean_loss`) allows; see the module's docstring.

    shortlist: heads verified alone each round; tries: nested sizes verified each round (the last is 1);
    first_step: the first round's largest size (default: a sixteenth of the heads)."""
    result = PruneResult(budget=budget, clean_loss=clean_loss, loss=clean_loss, curve=[(0, clean_loss)])
    limit = clean_loss + budget
    step = max(1, first_step or len(all_heads) // 16)
    while True:
        removed, aside = set(result.heads), set(result.set_aside)
        remaining = [head for head in all_heads if head not in removed and head not in aside]
        if not remaining:
            break
        estimates = estimate(list(result.heads))
        candidates = sorted(remaining, key=lambda head: (abs(estimates[head]), head))[:shortlist]
        alone = _verified(verify, [[*result.heads, head] for head in candidates], result)
        order = [head for _, head in sorted(zip(alone, candidates, strict=True))]  # cheapest exact cost first
        if min(alone) > limit:  # not one of the likeliest heads fits: the rest would cost more
            result.set_aside.extend(candidates)
            break
        fitting = sum(loss <= limit for loss in alone)
        sizes = _nested_sizes(min(step, fitting), tries)
        losses = [*_verified(verify, [result.heads + order[:size] for size in sizes[:-1]], result), min(alone)]
        size, loss = max((size, loss) for size, loss in zip(sizes, losses, strict=True) if loss <= limit)
        _accept(result, order[:size], loss, on_step)
        step = min(2 * size, shortlist) if size == sizes[0] else size
    return result


def _nested_sizes(step: int, tries: int) -> list[int]:
    """step, step/2, step/4, ... down to 1, at most `tries` of them, always ending at 1: largest first."""
    sizes = []
    size = step
    while size > 1 and len(sizes) < tries - 1:
        sizes.append(size)
        size //= 2
    return [*sizes, 1]


def _verified(verify, sets: list[list[Head]], result: PruneResult) -> list[float]:
    result.verified_sets += len(sets)
    return list(verify(sets)) if sets else []


def _accept(result: PruneResult, heads: list[Head], loss: float, on_step) -> None:
    result.heads.extend(heads)
    result.loss = loss
    result.curve.append((len(result.heads), loss))
    if on_step is not None:
        on_step(result)
