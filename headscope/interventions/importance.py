"""Does a head matter? Per-head importance on the model's own next-token loss.

Definitions (the README has them too):
- loss: mean next-token cross-entropy in nats over every predicted token of the corpus (a sentence of T tokens
  predicts T - 1), token-weighted over the corpus, from the model's own LM head; padding never counts.
- a head's output: its slice of the input to the layer's output projection, what the attention function
  returns for that query head, at every position: (batch, t, heads, head_dim) in `OutputEditor.output`.
- ablation_zero / ablation_mean: the loss with that output set to 0 / to its mean over every non-padding
  position of the corpus, minus the clean loss (exact: one forward per ablated head).
- attribution_zero / attribution_mean: the first-order estimates of the same two from one forward and one
  backward pass for all heads: sum over positions of (replacement - output) . dLoss/d(output), averaged like
  the loss. With m the head's mean output, sum (m - o) . g = m . (sum g) - sum o . g, so one pass gives both.

Exact ablation removes each head as a group of one (measures.groups, the same passes as `headscope ablate`): each
batch runs once clean, keeping every decoder layer's output; then, per ablated layer, the batch is replicated along
the batch axis, a different head removed in each replica, and the layers before it are skipped (they hand on the
clean output they had). Every pass goes
through headscope.model.capture, which freezes the parameters for the gradient pass and restores them after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.arguments import head_name
from headscope.errors import ResourceError
from headscope.interventions.groups import MODES, SCORINGS, Removal, group_effect, group_losses, token_nll
from headscope.labels import ROLES
from headscope.model.memory import readable
from headscope.run.feed import Batch, CorpusFeed
from headscope.run.progress import Reporter


def token_losses(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sentence: the summed next-token cross-entropy (nats, float64) and how many tokens were predicted.

    logits: (batch, t, vocab), the model's own. Position p predicts the token at p + 1 when both are real
    tokens, so padding (on either side) never counts.
    """
    valid = batch.attention_mask.bool()
    return token_nll(logits, batch).sum(-1), (valid[:, :-1] & valid[:, 1:]).sum(-1)


class HeadOutputs:
    """An OutputEditor for the clean pass with gradients: keeps each wanted layer's head outputs so that,
    after the backward pass, `collect` can sum what attribution needs (outputs are returned unchanged)."""

    def __init__(self, layers: Sequence[int], heads: int, head_dim: int) -> None:
        self.layers = list(layers)
        shape = (len(self.layers), heads, head_dim)
        self.sum_output = np.zeros(shape)  # sum of o over real positions, for the mean
        self.sum_grad = np.zeros(shape)  # sum of dLoss/do over real positions
        self.sum_output_grad = np.zeros(shape[:2])  # sum of o . dLoss/do
        self.positions = 0  # real positions seen
        self._outputs: dict[int, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None

    def start(self, batch: Batch) -> None:
        self._outputs, self._valid = {}, batch.attention_mask.bool()

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        if layer in self.layers:
            output.retain_grad()
            self._outputs[layer] = output
        return output

    def collect(self) -> None:
        """Add this batch's sums; call after the backward pass of its summed loss."""
        mask = self._valid[:, :, None, None].to(torch.float64)  # (batch, t, 1, 1)
        for index, layer in enumerate(self.layers):
            output = self._outputs[layer].detach().double()  # (batch, t, heads, head_dim)
            grad = self._outputs[layer].grad.double()
            self.sum_output[index] += (output * mask).sum((0, 1)).cpu().numpy()
            self.sum_grad[index] += (grad * mask).sum((0, 1)).cpu().numpy()
            self.sum_output_grad[index] += (output * grad * mask).sum((0, 1, 3)).cpu().numpy()
        self.positions += int(self._valid.sum())
        self._outputs = {}

    def means(self) -> np.ndarray:
        """(layers, heads, head_dim): each head's mean output over every real position of the corpus."""
        return self.sum_output / max(self.positions, 1)


@dataclass
class Importance:
    """Per head of the measured layers: the four importance numbers (nats), and what they were measured on."""

    mode: str  # "fast" or "exact"
    clean_loss: float  # the corpus loss, nats per predicted token
    predicted_tokens: int
    attribution_zero: np.ndarray  # (layers, heads)
    attribution_mean: np.ndarray
    ablation_zero: np.ndarray | None = None  # (layers, heads), exact mode only
    ablation_mean: np.ndarray | None = None
    means: np.ndarray | None = None  # (layers, heads, head_dim): each head's mean output over the corpus
    roles: list[dict] | None = None  # each role's heads removed together (`role_groups`)

    @classmethod
    def unmeasured(cls, mode: str, layers: int, heads: int) -> Importance:
        """Importance of a corpus with no token to predict: no loss, every head NaN."""
        nan = np.full((layers, heads), np.nan)
        exact = mode == "exact"
        return cls(mode, float("nan"), 0, nan, nan, nan if exact else None, nan if exact else None)

    def columns(self) -> dict[str, np.ndarray]:
        """The heads table's importance columns that were measured."""
        names = ("ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def check_importance_fits(feed: CorpusFeed, plan, what: str = "--importance") -> None:
    """Refuse, before anything is measured, a corpus whose longest sentence cannot fit in one importance pass: a
    sentence is never split, so it would take more memory than --max-memory allows (its chunks are tokenized
    now and kept: importance reads them again anyway)."""
    longest = max((len(ids) for index in range(len(feed)) for ids in feed.chunk(index).ids), default=0)
    if longest > plan.importance.max_tokens:
        raise ResourceError(
            f"{what} fits {plan.importance.max_tokens:,} tokens in one gradient pass with "
            f"{readable(plan.memory_budget)} of memory, and the longest sentence has {longest:,}: raise "
            f"--max-memory, or cut sentences with --max-length {plan.importance.max_tokens}"
        )


def run_importance(capture, feed: CorpusFeed, plan, reporter: Reporter, *, device, roles=None) -> Importance:
    """Head importance of every measured head over the feed's corpus, through `capture` (an attached LM); with
    `roles` (the heads table, labelled), also each role's heads removed together (`role_groups`)."""
    settings = plan.settings
    exact = settings.importance == "exact"

    def batches() -> Iterator[Batch]:
        limits = plan.importance
        for batch in feed.every_batch(
            max_sentences=limits.max_sentences, max_tokens=limits.max_tokens, padding_side=settings.padding_side
        ):
            yield batch.to(device)

    predicted = sum(max(len(ids) - 1, 0) for index in range(len(feed)) for ids in feed.chunk(index).ids)
    if predicted == 0:
        reporter.warn("no sentence has a token to predict (each has one token or none): importance is not measured")
        return Importance.unmeasured(settings.importance, len(plan.layers), plan.heads)
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
        replicas_per_forward=lambda batch: plan.replica_tokens // batch.input_ids.numel(),
        reporter=reporter,
    )
    reporter.finish()
    if roles is not None:
        sentences = len(feed.corpus.sentences)
        importance.roles = role_groups(capture, batches, plan, roles, importance.means, sentences, reporter)
    return importance


def role_groups(capture, batches, plan, labelled, means: np.ndarray, sentences: int, reporter: Reporter) -> list[dict]:
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
    full = np.zeros((plan.depth, plan.heads, means.shape[-1]))
    full[list(plan.layers)] = means  # only measured layers have roles, and means
    settings, entries = plan.settings, []
    reporter.stage(f"each role's heads removed together ({len(groups)} roles, zero and mean)")
    reporter.start(len(MODES) * sentences, what="role ablation")
    for mode in MODES:
        removal = Removal(mode, full if mode == "mean" else None)
        losses = group_losses(
            capture,
            batches,
            list(groups.values()),
            removal,
            scorings=SCORINGS,
            replicas_per_forward=lambda batch: plan.replica_tokens // batch.input_ids.numel(),
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
) -> Importance:
    """Attribution (and with `exact`, ablation) of every head of `layer_ids` over the corpus `batches`.

    capture: an attached causal LM (headscope.model.capture.attached); batches() -> the corpus's batches afresh
    (called once per pass: twice with `exact`); replicas_per_forward(batch) -> how many replicas of `batch`
    one forward pass may hold.
    """
    recorder = HeadOutputs(layer_ids, heads, head_dim)
    clean, tokens = 0.0, 0
    for batch in batches():
        output = capture.run(batch, editors=[recorder], grad=True)  # parameters frozen: gradients of outputs only
        with torch.enable_grad():
            losses, counts = token_losses(output.logits, batch)
            losses.sum().backward()
        recorder.collect()
        clean += float(losses.detach().sum())
        tokens += int(counts.sum())
        reporter.advance(len(batch.sentence_ids), batch.n_tokens)
    means = recorder.means()
    result = Importance(
        means=means,
        mode="exact" if exact else "fast",
        clean_loss=clean / max(tokens, 1),
        predicted_tokens=tokens,
        attribution_zero=-recorder.sum_output_grad / max(tokens, 1),
        attribution_mean=((means * recorder.sum_grad).sum(-1) - recorder.sum_output_grad) / max(tokens, 1),
    )
    if exact:
        zero, mean = _ablate(capture, batches, layer_ids, heads, means, replicas_per_forward, reporter)
        result.ablation_zero, result.ablation_mean = zero / max(tokens, 1), mean / max(tokens, 1)
    return result


def _ablate(capture, batches, layer_ids, heads, means, replicas_per_forward, reporter):
    """Summed loss increase (nats) of every (layer, head), zero- and mean-ablated, over the corpus: each head a group
    of one (measures.groups), the replicas of a batch sharing its clean pass and starting at their head's layer."""
    full = np.zeros((max(layer_ids) + 1, heads, means.shape[-1]))
    full[list(layer_ids)] = means
    singles = [[(layer, head)] for layer in layer_ids for head in range(heads) for _ in MODES]
    removals = [Removal(mode, full if mode == "mean" else None) for mode in MODES] * (len(singles) // len(MODES))
    losses = group_losses(
        capture, batches, singles, removals, replicas_per_forward=replicas_per_forward, reporter=reporter
    )
    _, clean, ablated = losses.arrays("all")
    increases = (ablated - clean[None]).sum(-1).reshape(len(layer_ids), heads, len(MODES))
    return tuple(increases[..., MODES.index(mode)] for mode in ("zero", "mean"))
