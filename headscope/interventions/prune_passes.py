"""prune's search on a model: the loss model's passes as the pure search's `estimate` (a gradient pass on the model
pruned so far, whose forward gives the loss of the heads it removes) and `verify` (one replicated pass), journalled
for --resume, counted, and shown as they run (each pass's bar names the pass, the heads removed so far and the
verified loss against the budget)."""

from __future__ import annotations

from dataclasses import dataclass

from headscope.arguments import head_name
from headscope.interventions.group_losses import PassPlan
from headscope.interventions.journal import SearchJournal
from headscope.interventions.loss_model import LossModel
from headscope.interventions.removal import Removal, Window
from headscope.interventions.search import Estimate, PruneResult, prune_search
from headscope.progress import Reporter

SHORTLIST = 8  # heads verified alone in a round whose estimate stopped predicting (the best-ranked by it)
FIRST_SHORTLIST = 48  # ... in the first round; also the longest prefix the first round trusts to the estimate
LONGEST = 96  # the longest prefix a later round trusts to the estimate (it removes half of what fits)
TRIES = 4  # nested sizes verified per packing pass


@dataclass
class Searched:
    result: PruneResult
    removal: Removal
    passes: PassPlan  # the verifying forward passes run


def search_on_model(
    lm: LossModel,
    candidates: list[tuple[int, int]],
    budget: float,
    mode: str,
    reporter: Reporter,
    journal: SearchJournal | None,
    *,
    max_rounds: int | None,
    patience: int,
    window: Window | None = None,
) -> Searched:
    """prune_search on `lm`'s passes, removing `mode`'s way (window mode: keeping `window`)."""
    removal = lm.removal(mode, window)
    if candidates:  # the layers below every candidate compute the clean model's in every pass: run them once
        lm.skip_below(min(layer for layer, _ in candidates))
    passes = lm.prefix_passes()

    def shared(sets):  # the heads removed so far: their pass is shared
        return sorted(set.intersection(*map(set, sets)))

    # the search so far, for the progress bar of each pass: heads removed, verified loss against the budget
    state = {"heads": 0, "delta": 0.0}
    sentences = len(lm.feed.corpus.sentences)

    def status(doing: str) -> str:
        return f"{doing} ({state['heads']} heads removed so far, loss {state['delta']:+.4f} of {budget:g} nats)"

    def verify(sets):
        reporter.start(sentences, what=status(f"verifying {len(sets)} sets"))
        counts, _, ablated = lm.losses(sets, removal, base=shared(sets), clean=False, progress=True).arrays("all")
        reporter.finish()
        return list(ablated.sum(1) / counts.sum())  # only the sets' losses

    def estimate(removed):
        doing = f"gradient pass with {len(removed)} heads removed" if removed else "clean loss and first ranking"
        reporter.start(sentences, what=status(doing))
        loss, found = lm.estimated_costs(removed, removal, progress=True)
        reporter.finish()
        gone = set(removed)
        return Estimate(loss, {head: found[head] for head in candidates if head not in gone})

    if journal is not None:
        verify, estimate = journal.verify(verify), journal.estimate(estimate)

    answered_verify = verify  # live, or replayed from the journal

    def counted(sets):  # the passes of every verification, replayed ones included: the whole search's
        nonlocal passes
        passes = passes + lm.planned(sets, mode, base=shared(sets), clean=False)
        return answered_verify(sets)

    removed_before = 0

    def step(found: PruneResult) -> None:
        nonlocal removed_before
        added = ",".join(head_name(*head) for head in found.heads[removed_before:])
        removed_before = len(found.heads)
        if journal is not None:  # saved before it is said
            journal.step(found)
        delta = found.loss - found.clean_loss  # signed: removing a head can lower the loss
        state["heads"], state["delta"] = len(found.heads), delta
        reporter.note(f"{len(found.heads)} heads removed (+{added}): loss {found.loss:.4f} ({delta:+.4f} nats)")

    alone = [min(FIRST_SHORTLIST, len(candidates)), min(SHORTLIST, len(candidates))]
    reporter.note(
        "planned: a gradient pass for the clean loss and the first ranking, then rounds of one gradient pass each, "
        "removing the heads the ranking says fit and ranking the next round; where they overshoot, a replicated "
        "pass verifying fewer; where the estimate stops predicting, "
        f"{alone[1]} heads verified alone ({alone[0]} in the first round) and a few sets packed; "
        + (f"at most {max_rounds} rounds" if max_rounds is not None else "until no shortlisted head fits alone")
        + (f", or {patience} rounds in a row adding under 4% of the heads near the budget" if patience else "")
    )
    reporter.stage(f"pruning within {budget:g} nats ({mode} removal)")
    result = prune_search(candidates, budget=budget, estimate=estimate, verify=counted, shortlist=SHORTLIST,
                          first_shortlist=FIRST_SHORTLIST, longest=LONGEST, tries=TRIES, patience=patience,
                          max_rounds=max_rounds, on_step=step)  # fmt: skip
    return Searched(result, removal, passes)
