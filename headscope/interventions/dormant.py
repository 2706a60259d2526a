"""The dormant label, checked by removal: the heads it calls dormant are zeroed together on the corpus the run
measured, and the label stands only for a group whose removal costs at most the tolerance.

`dormant` says a head can go (it writes under 2.5% of the residual stream). The run proves it where it can: with the
LM head loaded, the candidates (every head the role rule calls dormant), least written first, are removed together
as nested prefixes, every set verified by the exact loss (interventions.group_losses: one replicated pass per round).
The largest prefix whose cost stays within the tolerance keeps the label; the heads after it are *demoted*: the role
rule goes on to its next test for them. The verified cost, with its paired bootstrap interval, goes into run.json.

The search (`verified_prefix`) is a pure function over a `verify` callable, tested on known cost functions:
    round 1: the whole group (one replica on top of the clean pass: where the label holds, all it costs);
    round 2, if it costs too much: its halves (n/2, n/4, n/8, n/16), one pass;
    later rounds: sizes spread evenly between the largest size that fits and the smallest above it that does not,
    until they are adjacent or `max_rounds` rounds have run. The answer is always a verified set (or none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from headscope.arguments import head_name
from headscope.interventions.group_losses import group_effect, shared_group_losses
from headscope.interventions.removal import Head, Removal
from headscope.progress import Reporter
from headscope.run.distributed import ONE_PROCESS, Ranks, share_of

TRIES = 4  # sets verified in one pass
MAX_ROUNDS = 5
MODE = "zero"  # the label's claim: what the head writes can be left out


@dataclass
class PrefixSearch:
    """What `verified_prefix` found: the longest verified prefix and every set it verified."""

    kept: int = 0  # heads of the verified prefix (0: none fits)
    costs: dict[int, float] = field(default_factory=dict)  # prefix size -> verified cost (nats)
    rounds: int = 0


def verified_prefix(
    count: int, *, tolerance: float, verify: Callable[[list[int]], list[float]], tries: int = TRIES,
    max_rounds: int = MAX_ROUNDS,
) -> PrefixSearch:  # fmt: skip
    """The largest n <= count whose prefix of n candidates, removed together, costs at most `tolerance`, as far
    as `max_rounds` rounds of `tries` verified sizes find it. verify(sizes) -> the cost of each prefix size."""
    result = PrefixSearch()
    if count == 0:
        return result
    sizes = [count]  # the common answer, alone: one replica on top of the clean pass
    while sizes and result.rounds < max_rounds:
        result.rounds += 1
        result.costs.update(zip(sizes, verify(sizes), strict=True))
        fits = [size for size, cost in result.costs.items() if cost <= tolerance]
        result.kept = max(fits, default=0)
        above = [size for size in result.costs if size > result.kept]
        if not above:
            break
        if result.rounds == 1:  # the whole group costs too much: its halves next
            sizes = sorted({max(1, count >> shift) for shift in range(1, tries + 1)} - {count}, reverse=True)
            continue
        low, high = result.kept, min(above)
        step = (high - low) / (tries + 1)
        sizes = sorted({round(low + step * i) for i in range(1, tries + 1)} - {low, high, *result.costs}, reverse=True)
    return result


@dataclass
class DormantCheck:
    """The dormant label's check, for run.json (`record`) and the heads table (`column`)."""

    status: str  # "verified" (the label's heads removed together cost <= tolerance), "unverified", "none" (no head)
    why: str = ""  # unverified: why the run could not check
    tolerance: float | None = None
    kept: list[Head] = field(default_factory=list)  # dormant, verified together
    demoted: list[Head] = field(default_factory=list)  # candidates whose removal with the others cost too much
    effect: dict | None = None  # group_effect of the kept heads: delta, its interval, tokens, losses
    costs: dict[int, float] = field(default_factory=dict)  # prefix size -> verified cost
    rounds: int = 0

    @classmethod
    def unverified(cls, why: str) -> DormantCheck:
        return cls("unverified", why)

    def statuses(self) -> dict[Head, str]:
        """(layer, head) -> "verified" or "demoted", the heads table's `dormant_check` (the others: empty)."""
        return {head: "verified" for head in self.kept} | {head: "demoted" for head in self.demoted}

    def record(self) -> dict:
        """run.json's `dormant_check`."""
        out = {"status": self.status, "mode": MODE, "tolerance": self.tolerance}
        if self.why:
            out["why"] = self.why
        out["heads"] = [head_name(*head) for head in self.kept]
        out["demoted"] = [head_name(*head) for head in self.demoted]
        out["effect"] = self.effect
        out["cost_above_zero"] = cost_above_zero(self.effect)
        out["verified_sets"] = {str(size): round(cost, 6) for size, cost in sorted(self.costs.items())}
        out["rounds"] = self.rounds
        return out


def cost_above_zero(effect: dict | None) -> bool | None:
    """Whether the verified group's cost interval lies above 0: within the tolerance, yet measurably not free (the
    heads do something on this corpus, which another text or task may need). None without an interval."""
    if not effect or effect.get("delta_ci_low") is None:
        return None
    return bool(effect["delta_ci_low"] > 0)


def candidates(labelled: pd.DataFrame) -> list[Head]:
    """The heads the role rule calls dormant, least written first (write_ratio, then layer and head)."""
    dormant = labelled[labelled["role"] == "dormant"].sort_values(["write_ratio", "layer", "head"])
    return [(int(row.layer), int(row.head)) for row in dormant.itertuples()]


def check_dormant(
    capture, batches, plan, labelled: pd.DataFrame, reporter: Reporter, *, sentences: int, tolerance: float,
    ranks: Ranks = ONE_PROCESS,
) -> DormantCheck:  # fmt: skip
    """Remove the dormant candidates of `labelled` together on the corpus (`batches()` yields its batches, all of
    them: this rank's share is taken here), demoting from the most written while the group costs more than
    `tolerance` nats per predicted token."""
    heads = candidates(labelled)
    if not heads:
        return DormantCheck("none", tolerance=tolerance)
    settings = plan.settings
    losses = {}

    def verify(sizes: list[int]) -> list[float]:
        reporter.start(sentences, what=f"dormant check: {len(heads)} heads, sets of {', '.join(map(str, sizes))}")
        found = shared_group_losses(ranks, capture, lambda: share_of(ranks, batches()), [heads[:n] for n in sizes],
                                    Removal(MODE), replicas_per_forward=plan.replicas, reporter=reporter)  # fmt: skip
        reporter.finish()
        effects = [group_effect(found, index, "all", replicates=0, seed=0) for index in range(len(sizes))]
        losses.update({size: (found, index) for index, size in enumerate(sizes)})
        return [float("inf") if effect["delta"] is None else effect["delta"] for effect in effects]

    reporter.stage(f"checking the dormant label: its {len(heads)} heads removed together")
    search = verified_prefix(len(heads), tolerance=tolerance, verify=verify)
    check = DormantCheck("verified", tolerance=tolerance, costs=search.costs, rounds=search.rounds)
    check.kept, check.demoted = heads[: search.kept], heads[search.kept :]
    if search.kept:
        found, index = losses[search.kept]
        effect = group_effect(found, index, "all", replicates=settings.bootstrap, seed=settings.bootstrap_seed)
        check.effect = {key: round(value, 6) if isinstance(value, float) else value for key, value in effect.items()}
    return check
