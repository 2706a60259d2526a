"""Does a head matter? Per-head importance on the model's own next-token loss.

Definitions (docs/importance.md has them too):
- loss: mean next-token cross-entropy in nats over every predicted token of the corpus (a sentence of T tokens
  predicts T - 1), token-weighted over the corpus, from the model's own LM head; padding never counts.
- a head's output: its slice of the input to the layer's output projection, what the attention function
  returns for that query head, at every position: (batch, t, heads, head_dim) in `OutputEditor.output`.
- ablation_zero / ablation_mean: the loss with that output set to 0 / to its mean over every non-padding
  position of the corpus, minus the clean loss (exact: one forward per ablated head).
- attribution_zero / attribution_mean: the first-order terms of the same two from one forward and one backward
  pass for all heads (interventions.removal: `Removal.estimate`), averaged like the loss. For mean removal the first
  order averages out (the replacement is the output's own mean), so it does not rank heads: on SmolLM2 it points
  the wrong way (Pearson -0.45 against exact mean ablation over 63 heads).
- estimate_zero / estimate_mean: the second-order estimates, first order + the curvature term 1/2 sum over positions
  of ((r - o) . dL/do)^2 (an empirical-Fisher term, as prune ranks heads by: Spearman 0.85 against exact mean
  ablation on SmolLM2, where first order alone gives 0.53), from the same pass. The fast importance to rank by.

Exact ablation removes each head as a group of one (interventions.group_losses, the same passes as `headscope
ablate`): each batch runs once clean, keeping every decoder layer's output; then, per ablated layer, the batch is
replicated along the batch axis, a different head removed in each replica, and the layers before it are skipped (they
hand on the clean output they had). Every pass goes through headscope.model.capture, which freezes the parameters for
the gradient pass and restores them after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from headscope.arguments import head_name
from headscope.config import OUTPUT_REMOVALS
from headscope.errors import ResourceError
from headscope.interventions.group_losses import SCORINGS, PassPlan, group_effect, planned_passes, shared_group_losses
from headscope.interventions.removal import Removal, shared_gradient_pass
from headscope.labels import ROLES
from headscope.model.batch import Batch
from headscope.model.memory import readable
from headscope.progress import Reporter
from headscope.run.distributed import ONE_PROCESS, Ranks, share_of
from headscope.run.feed import CorpusFeed


@dataclass
class Importance:
    """Per head of the measured layers: the four importance numbers (nats), and what they were measured on."""

    mode: str  # "fast" or "exact"
    clean_loss: float  # the corpus loss, nats per predicted token
    predicted_tokens: int
    attribution_zero: np.ndarray  # (layers, heads)
    attribution_mean: np.ndarray
    estimate_zero: np.ndarray | None = None  # (layers, heads): first order + curvature
    estimate_mean: np.ndarray | None = None
    ablation_zero: np.ndarray | None = None  # (layers, heads), exact mode only
    ablation_mean: np.ndarray | None = None
    # (last measured layer + 1, heads, head_dim): each head's mean output over the corpus, by layer index (zeros
    # for a layer not measured): what mean removal puts in
    means: np.ndarray | None = None
    roles: list[dict] | None = None  # each role's heads removed together (`role_groups`)
    planned: PassPlan | None = None  # exact mode: the ablation's passes, counted before they ran

    @classmethod
    def unmeasured(cls, mode: str, layers: int, heads: int) -> Importance:
        """Importance of a corpus with no token to predict: no loss, every head NaN."""
        nan = np.full((layers, heads), np.nan)
        exact = mode == "exact"
        return cls(mode, float("nan"), 0, nan, nan, nan, nan, nan if exact else None, nan if exact else None)

    def columns(self) -> dict[str, np.ndarray]:
        """The heads table's importance columns that were measured."""
        names = ("ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean", "estimate_zero",
                 "estimate_mean")  # fmt: skip
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def agreement(self) -> dict | None:
        """How well each estimate ranks the heads as their exact ablation does, on this run (exact mode only): the
        Spearman and Pearson correlations over the heads, per removal mode."""
        if self.ablation_zero is None:
            return None
        found = {}
        for mode in ("zero", "mean"):
            exact = getattr(self, f"ablation_{mode}").ravel()
            for kind in ("attribution", "estimate"):
                guess = getattr(self, f"{kind}_{mode}").ravel()
                both = np.isfinite(exact) & np.isfinite(guess)
                a, b = guess[both], exact[both]
                varied = both.sum() >= 3 and a.std() > 0 and b.std() > 0  # else no correlation is defined
                found[f"{kind}_{mode}"] = {
                    "spearman": round(float(stats.spearmanr(a, b).statistic), 4) if varied else None,
                    "pearson": round(float(np.corrcoef(a, b)[0, 1]), 4) if varied else None,
                    "heads": int(both.sum()),
                }
        return found


def check_importance_fits(feed: CorpusFeed, plan, what: str = "--importance") -> None:
    """Refuse, before anything is measured, a corpus whose longest sentence cannot fit in one importance pass: a
    sentence is never split, so it would take more memory than --max-memory allows (its chunks are tokenized
    now and kept: importance reads them again anyway)."""
    longest = max((len(ids) for index in range(len(feed)) for ids in feed.chunk(index).ids), default=0)
    fits = plan.limits("importance").max_tokens
    if longest > fits:
        raise ResourceError(
            f"{what} fits {fits:,} tokens in one gradient pass with "
            f"{readable(plan.memory_budget)} of memory, and the longest sentence has {longest:,}: raise "
            f"--max-memory, or cut sentences with --max-length {fits}"
        )


def run_importance(
    capture, feed: CorpusFeed, plan, reporter: Reporter, *, device, roles=None, ranks: Ranks = ONE_PROCESS
) -> Importance:
    """Head importance of every measured head over the feed's corpus, through `capture` (an attached LM); with
    `roles` (the heads table, labelled), also each role's heads removed together (`role_groups`). ranks: a
    data-parallel run's; each rank runs its share of the batches (dealt round-robin) and every rank gets the whole
    result (the per-sentence losses gathered in one process's order, the float64 sums all-reduced)."""
    settings = plan.settings
    exact = settings.importance == "exact"

    def batches() -> Iterator[Batch]:
        return share_of(ranks, plan.batches(feed, "importance", device))

    predicted = sum(max(len(ids) - 1, 0) for index in range(len(feed)) for ids in feed.chunk(index).ids)
    if predicted == 0:
        reporter.warn("no sentence has a token to predict (each has one token or none): importance is not measured")
        return Importance.unmeasured(settings.importance, len(plan.layers), plan.heads)
    planned = None
    if exact:  # a 7B model's exact importance takes hours: say what it will run before it does
        counted = planned_passes(plan.batches(feed, "importance", "cpu"), _singles(plan.layers, plan.heads),
                                 plan.depth, plan.replicas)  # fmt: skip
        planned = counted
        reporter.note(f"planned: a gradient pass, then {counted.describe(plan.depth)} for the ablations")
    reporter.stage(f"importance ({settings.importance}): {'attribution and ablation' if exact else 'attribution'}")
    passes = 2 if exact else 1  # the gradient pass, then the ablation pass
    reporter.start(len(feed.corpus.sentences) * passes, what=f"importance ({settings.importance})")
    importance = measure_importance(
        capture,
        batches,
        layer_ids=plan.layers,
        heads=plan.heads,
        head_dim=plan.architecture["head_dim"],
        exact=exact,
        replicas_per_forward=plan.replicas,
        reporter=reporter,
        ranks=ranks,
    )
    reporter.finish()
    importance.planned = planned
    if roles is not None:
        sentences = len(feed.corpus.sentences)
        importance.roles = role_groups(capture, batches, plan, roles, importance.means, sentences, reporter, ranks)
    return importance


def role_groups(
    capture, batches, plan, labelled, means: np.ndarray, sentences: int, reporter: Reporter, ranks: Ranks = ONE_PROCESS
) -> list[dict]:
    """Per role that some measured head has (but "other") and per removal mode: the role's heads removed together,
    the delta on every predicted token and on the repeated tokens, with 95% paired bootstrap intervals."""
    groups = {
        role: [(int(r.layer), int(r.head)) for r in labelled[labelled["role"] == role].itertuples()]
        for role in ROLES
        if role != "other"
    }
    groups = {role: heads for role, heads in groups.items() if heads}
    if not groups:
        return []
    settings, entries = plan.settings, []
    reporter.stage(f"each role's heads removed together ({len(groups)} roles, zero and mean)")
    reporter.start(len(OUTPUT_REMOVALS) * sentences, what="role ablation")
    for mode in OUTPUT_REMOVALS:
        removal = Removal(mode, means)  # only measured layers have roles, and means
        losses = shared_group_losses(
            ranks,
            capture,
            batches,
            list(groups.values()),
            removal,
            scorings=SCORINGS,
            replicas_per_forward=plan.replicas,
            reporter=reporter,
        )
        for index, (role, heads) in enumerate(groups.items()):
            entry = {"role": role, "mode": mode, "heads": [head_name(*h) for h in heads]}
            for scoring in SCORINGS:
                effect = group_effect(
                    losses, index, scoring, replicates=settings.bootstrap, seed=settings.bootstrap_seed
                )
                entry[scoring] = {key: _rounded(value) for key, value in effect.items()}
            entries.append(entry)
    reporter.finish()
    return entries


def _rounded(value):
    return round(value, 6) if isinstance(value, float) else value


def measure_importance(
    capture,
    batches: Callable[[], Iterable[Batch]],
    *,
    layer_ids: Sequence[int],
    heads: int,
    head_dim: int,
    exact: bool,
    replicas_per_forward: Callable[[Batch], int],
    reporter: Reporter,
    ranks: Ranks = ONE_PROCESS,
) -> Importance:
    """Attribution (and with `exact`, ablation) of every head of `layer_ids` over the corpus `batches`.

    capture: an attached causal LM (headscope.model.capture.attached); batches() -> the corpus's batches afresh
    (called once per pass: twice with `exact`); replicas_per_forward(batch) -> how many replicas of `batch`
    one forward pass may hold; ranks: with `batches` yielding this rank's share (see run_importance).
    """
    found = shared_gradient_pass(
        ranks, capture, batches, layer_ids, heads, head_dim, moments=True,
        on_batch=lambda batch: reporter.advance(len(batch.sentence_ids), batch.n_tokens),
    )  # fmt: skip
    tokens = found.tokens
    full = np.zeros((max(layer_ids) + 1, heads, head_dim))
    full[list(layer_ids)] = found.sums.means()
    zero, mean = Removal("zero"), Removal("mean", full)
    first = {"zero": zero.estimate(found.sums, tokens), "mean": mean.estimate(found.sums, tokens)}
    result = Importance(
        means=full,
        mode="exact" if exact else "fast",
        clean_loss=found.loss / max(tokens, 1),
        predicted_tokens=tokens,
        attribution_zero=first["zero"],
        attribution_mean=first["mean"],
        estimate_zero=first["zero"] + found.sums.curvatures(zero, tokens),
        estimate_mean=first["mean"] + found.sums.curvatures(mean, tokens),
    )
    if exact:
        zero, mean = _ablate(capture, batches, layer_ids, heads, full, replicas_per_forward, reporter, ranks)
        result.ablation_zero, result.ablation_mean = zero / max(tokens, 1), mean / max(tokens, 1)
    return result


def _singles(layer_ids, heads: int) -> list[list[tuple[int, int]]]:
    """Exact importance's groups: every head alone, once per removal mode (OUTPUT_REMOVALS order)."""
    return [[(layer, head)] for layer in layer_ids for head in range(heads) for _ in OUTPUT_REMOVALS]


def _ablate(capture, batches, layer_ids, heads, full, replicas_per_forward, reporter, ranks):
    """Summed loss increase (nats) of every (layer, head), zero- and mean-ablated, over the corpus: each head a group
    of one (interventions.group_losses), the replicas of a batch sharing its clean pass and starting at their head's
    layer. full: (depth, heads, head_dim) means, of the measured layers."""
    singles = _singles(layer_ids, heads)
    removals = [Removal(mode, full) for mode in OUTPUT_REMOVALS] * (len(singles) // len(OUTPUT_REMOVALS))
    losses = shared_group_losses(
        ranks, capture, batches, singles, removals, replicas_per_forward=replicas_per_forward, reporter=reporter
    )
    _, clean, ablated = losses.arrays("all")
    increases = (ablated - clean[None]).sum(-1).reshape(len(layer_ids), heads, len(OUTPUT_REMOVALS))
    return tuple(increases[..., OUTPUT_REMOVALS.index(mode)] for mode in ("zero", "mean"))
