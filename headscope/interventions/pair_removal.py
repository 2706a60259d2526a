"""Heads removed on prompt pairs: the task's metric (patch's logit difference at the last position) on each clean
prompt with each group of heads removed together, beside the clean and corrupt prompts' own (`ablate --pairs`).

A label that says a head can go (dormant) or matters is checked on a task this way: the corpus loss averages over
every token, where one task's few tokens weigh little. Each batch runs its clean and corrupt prompts once, then the
clean prompts again with every group removed, each group a replica of the batch (interventions/removal.py's
RemovedHeads: the same removal as ablate's and prune's), as many replicas a forward as the plan allows, each
starting at the group's first removed layer from the clean prompts' layer outputs (group_losses.replica_passes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from headscope.estimates import MIN_BOOTSTRAP_SENTENCES, percentile_interval, replicate_ratios
from headscope.interventions.group_losses import replica_passes
from headscope.interventions.pairs import TokenizedPair
from headscope.interventions.patching import METRICS, kept_logits, metric_of, pair_batches
from headscope.interventions.removal import Head, Removal, RemovedHeads
from headscope.model.layer_outputs import replicate, rows_of


@dataclass
class PairMetrics:
    """In pair order: m on each clean and corrupt prompt, (pairs,), and on the clean prompt with each group
    removed, (groups, pairs); float64."""

    pair_ids: np.ndarray
    clean: np.ndarray
    corrupt: np.ndarray
    ablated: np.ndarray


def removed_metrics(
    capture, plan, device, pairs: Sequence[TokenizedPair], groups: Sequence[Sequence[Head]], removal: Removal,
    on_batch: Callable[[int, int], None] = lambda pairs, tokens: None,
) -> PairMetrics:  # fmt: skip
    """The metric with each group of heads removed together on every pair's clean prompt (see the module)."""
    metric = METRICS["logit_diff"]
    ids, clean, corrupt, ablated = [], [], [], []
    for batch in pair_batches(pairs, plan, device, "noise"):  # "noise": the clean prompts are the target rows
        rows = len(batch.pair_ids)
        both = batch.both
        kept = kept_logits(capture, both)
        output, outputs = capture.run_keeping_layers(both, logits_to_keep=kept)
        m = metric_of(metric, output.logits, both, kept, batch.answer.repeat(2),
                      batch.distractor.repeat(2)).double().cpu().numpy()  # fmt: skip
        del output
        found = np.zeros((len(groups), rows))
        # each group's replica starts at its first removed layer, from the clean prompts' outputs before it
        for start, members in replica_passes(groups, set(), len(outputs), max(1, plan.replicas(batch.target))):
            replicated = batch.target.replicated(len(members))
            handed_on = replicate(rows_of(outputs[start - 1], batch.target_rows), len(members)) if start else None
            kept = kept_logits(capture, replicated)
            editor = RemovedHeads([groups[index] for index in members], removal, rows)
            output = capture.run(replicated, editors=[editor], start_at=start, handed_on=handed_on,
                                 logits_to_keep=kept)  # fmt: skip
            values = metric_of(metric, output.logits, replicated, kept, batch.answer.repeat(len(members)),
                               batch.distractor.repeat(len(members)))  # fmt: skip
            found[members] = values.view(len(members), rows).double().cpu().numpy()
        ids.append(np.array(batch.pair_ids))
        clean.append(m[:rows])
        corrupt.append(m[rows:])
        ablated.append(found)
        on_batch(rows, int(both.n_tokens))
    order = np.argsort(np.concatenate(ids), kind="stable")
    return PairMetrics(np.concatenate(ids)[order], np.concatenate(clean)[order], np.concatenate(corrupt)[order],
                       np.concatenate(ablated, axis=1)[:, order])  # fmt: skip


def pair_group_effect(found: PairMetrics, group: int, *, replicates: int, seed: int) -> dict:
    """One group's effect on the pairs: clean and ablated m (means over pairs), the change (mean of ablated - clean)
    with its 95% paired bootstrap interval over pairs (None with fewer than two pairs or no replicates), and its
    share of the gap, change / mean(corrupt - clean): 1 = removing the heads does what the corrupt prompt does to m,
    0 = nothing, below 0 = it strengthens the behaviour (None where the gap is 0)."""
    change = found.ablated[group] - found.clean
    gap = float((found.corrupt - found.clean).mean())
    effect = {"pairs": len(change), "clean_metric": float(found.clean.mean()),
              "ablated_metric": float(found.ablated[group].mean()), "change": float(change.mean()),
              "change_ci_low": None, "change_ci_high": None,
              "gap_share": float(change.mean() / gap) if gap != 0 else None}  # fmt: skip
    if replicates and len(change) >= MIN_BOOTSTRAP_SENTENCES:
        means = replicate_ratios(found.pair_ids, replicates, seed, change, np.ones(len(change)))
        low, high = percentile_interval(means)
        effect["change_ci_low"], effect["change_ci_high"] = float(low), float(high)
    return effect
