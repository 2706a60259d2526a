"""What `ablate` and `prune` share: the model's loss on a corpus with heads removed, through one attached LM.

`LossModel` holds the attached causal LM, the corpus feed and the plan; it batches the corpus as head importance
does (sentences never split, replicas within --max-memory) and answers three questions:
    means()                        each head's mean output over the corpus on the clean model (mean removal)
    losses(groups, removal, ...)   per sentence, the clean loss and the loss with each group removed together
    estimated_costs(removed, removal)  the pruned model's loss, and a second-order estimate of removing each
                                       further head, from one gradient pass

Under torchrun the batches are dealt round-robin (batch i to rank i % N, batched as rank 0 batches); each rank runs
its own, and every answer is put together on every rank: the per-sentence losses gathered back into one process's
order (the same arrays, so the same sums: equal to one process's exactly), the float64 sums of the means and of the
gradient pass all-reduced (equal within ~1e-15). A failure on one rank stops every rank with its message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from headscope.errors import ConfigError
from headscope.interventions.clean_prefix import CleanPrefix, clean_prefix
from headscope.interventions.group_losses import GroupLosses, PassPlan, planned_passes, shared_group_losses
from headscope.interventions.importance import check_importance_fits
from headscope.interventions.loss import token_losses
from headscope.interventions.removal import Head, OutputSums, Removal, RemovedHeads, Window, shared_gradient_pass
from headscope.model.architecture import text_config
from headscope.model.batch import Batch
from headscope.model.capture import Capture, attached
from headscope.model.loading import LoadedModel
from headscope.progress import Reporter
from headscope.run.corpus import Corpus
from headscope.run.distributed import ONE_PROCESS, Ranks, added, share_of, together
from headscope.run.feed import CorpusFeed
from headscope.run.plan import Plan


@dataclass
class LossModel:
    capture: Capture
    feed: CorpusFeed
    plan: Plan
    loaded: LoadedModel
    reporter: Reporter
    ranks: Ranks = ONE_PROCESS
    _means: np.ndarray | None = None
    prefix: CleanPrefix | None = None  # the clean layers below every head the passes change, run once (`skip_below`)

    @property
    def all_heads(self) -> list[Head]:
        return [(layer, head) for layer in range(self.plan.depth) for head in range(self.plan.heads)]

    def batches(self) -> Iterator[Batch]:
        """This rank's batches of the corpus (all of them in one process)."""
        return share_of(self.ranks, self.plan.batches(self.feed, "importance", self.loaded.device))

    def means(self) -> np.ndarray:
        """(depth, heads, head_dim) float64: each head's mean output over every real token of the corpus."""
        if self._means is None:
            recorder = OutputSums(range(self.plan.depth), self.plan.heads, self.plan.architecture["head_dim"])

            def record():
                for batch in self.batches():
                    self.capture.run(batch, editors=[recorder])

            together(self.ranks, record)
            self._means = recorder.summed_over(added(self.ranks)).means()
        return self._means

    def skip_below(self, layer: int) -> None:
        """Every later pass changes heads of `layer` and above only: run the clean model's layers below it once per
        batch now, and start every pass from what they returned (interventions/clean_prefix.py; nothing is kept
        where it would not fit)."""
        planned = self.plan.batches(self.feed, "importance", "cpu")  # counted on the host: nothing moves
        hidden_bytes = text_config(self.loaded.model.config).hidden_size * self.loaded.dtype.itemsize
        self.prefix = together(
            self.ranks,
            lambda: clean_prefix(self.capture, self.batches, layer, share_of(self.ranks, planned), hidden_bytes),
        )

    def prefix_passes(self) -> PassPlan:
        """The forward passes `skip_below` ran (none where it kept nothing): one per batch through the skipped
        layers."""
        if self.prefix is None:
            return PassPlan()
        batches = list(self.plan.batches(self.feed, "importance", "cpu"))
        tokens = sum(batch.n_tokens for batch in batches)
        return PassPlan(len(batches), len(batches) * self.prefix.layer, tokens * self.prefix.layer)

    def removal(self, mode: str, window: Window | None = None) -> Removal:
        """How `mode` removes heads on this corpus (mean: with the corpus means; window: keeping `window`)."""
        return Removal(mode, self.means() if mode == "mean" else None, window if mode == "window" else None)

    def losses(
        self,
        groups: Sequence[Sequence[Head]],
        removal: Removal,
        scorings=("all",),
        base: Sequence[Head] = (),
        *,
        progress: bool = False,
        clean: bool = True,
    ) -> GroupLosses:
        """group_losses over the corpus; base: heads every group holds (see group_losses); progress: report each
        batch's sentences to the reporter (a pass the user waits on, such as ablate's; rank 0's share of it);
        clean: whether the clean (base-only) losses are wanted (else NaN, and the first pass stops early)."""
        return shared_group_losses(
            self.ranks,
            self.capture,
            self.batches,
            groups,
            removal,
            scorings=scorings,
            replicas_per_forward=self.plan.replicas,
            reporter=self.reporter if progress else None,
            base=base,
            clean=clean,
            prefix=self.prefix,
        )

    def planned(
        self, groups: Sequence[Sequence[Head]], mode: str, base: Sequence[Head] = (), *, clean: bool = True
    ) -> PassPlan:
        """What `removal(mode)` and then `losses(groups, ..., base=base, clean=clean)` will run, counted from the
        corpus's batches before anything runs (mean removal first takes a clean pass over the corpus for the
        means)."""

        def batches():
            return self.plan.batches(self.feed, "importance", "cpu")  # counted on the host: nothing moves

        skipped = self.prefix.layer if self.prefix is not None else 0
        planned = planned_passes(batches(), groups, self.plan.depth, self.plan.replicas, base, clean, skipped)
        if mode == "mean" and self._means is None:
            planned = planned + planned_passes(batches(), [], self.plan.depth, self.plan.replicas)
        return planned

    def estimated_costs(
        self, removed: Sequence[Head], removal: Removal, *, curvature: bool = True, progress: bool = False
    ) -> tuple[float, dict[Head, float]]:
        """One gradient pass over the corpus on the model with `removed` removed: its loss (nats per predicted token,
        exact: the pass's forward), and per head the estimated loss increase of also removing it,
        Removal.estimate + Removal.curvature (without `curvature`, the first order alone)."""
        depth, heads, head_dim = self.plan.depth, self.plan.heads, self.plan.architecture["head_dim"]
        found = shared_gradient_pass(
            self.ranks, self.capture, self.batches, range(depth), heads, head_dim,
            edit=lambda batch: [RemovedHeads([list(removed)], removal, len(batch.sentence_ids))],
            curvature_of=removal if curvature else None, prefix=self.prefix,
            window=removal.window if removal.windowed else None,
            on_batch=(lambda b: self.reporter.advance(len(b.sentence_ids), b.n_tokens)) if progress else lambda b: None,
        )  # fmt: skip
        if found.tokens == 0:
            raise ConfigError("no sentence of the corpus has a token to predict: there is no loss to estimate")
        estimate = removal.estimate(found.sums, found.tokens)
        if curvature:
            estimate = estimate + removal.curvature(found.sums, found.tokens)
        costs = {(layer, head): float(estimate[layer, head]) for layer, head in self.all_heads}
        return found.loss / found.tokens, costs


@contextlib.contextmanager
def loss_model(
    loaded: LoadedModel, plan: Plan, corpus: Corpus, reporter: Reporter, ranks: Ranks, what: str
) -> Iterator[LossModel]:
    """`loaded`'s model (opened with its LM head) attached, `corpus` fed as head importance feeds it, on this rank
    of `ranks` (a data-parallel run's); what: the command, as messages name it."""
    chunk = max(1, len(corpus.sentences))  # one chunk: every pass reads the whole corpus again
    feed = CorpusFeed(corpus, loaded.tokenizer, max_length=plan.max_length, chunk_sentences=chunk, keep=True)
    check_importance_fits(feed, plan, what)
    with attached(loaded.lm, block_bytes=plan.settings.block_bytes) as capture:
        yield LossModel(capture, feed, plan, loaded, reporter, ranks)


def plain_loss(folder: Path, lm: LossModel) -> float:
    """The corpus loss of the checkpoint in `folder`, loaded by transformers alone and run without headscope (its
    default attention), batched as `lm` batches: what a user of the saved model gets."""
    import inspect

    from transformers import AutoModelForCausalLM

    loaded = lm.loaded
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=loaded.dtype, trust_remote_code=lm.plan.settings.trust_remote_code
    )
    model = model.to(loaded.device).eval()
    positions = "position_ids" in inspect.signature(model.forward).parameters
    total, tokens = 0.0, 0
    with torch.inference_mode():
        for batch in lm.plan.batches(lm.feed, "importance", loaded.device):
            kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
            if positions:
                kwargs["position_ids"] = batch.position_ids
            losses, counts = token_losses(model(**kwargs).logits, batch)
            total, tokens = total + float(losses.sum()), tokens + int(counts.sum())
    return total / max(tokens, 1)
