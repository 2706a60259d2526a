"""What the corpus pass keeps besides the statistics: every head's exemplars (measures.exemplars) and the
detectors' sums (measures.pattern_scores), with their bootstrap replicates. Sized once by the plan, whatever the
corpus; checkpointed and added up across ranks like the statistics' sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headscope.detector_specs import Detector, detector_of
from headscope.estimates import percentile_interval, ratio, replicate_weights
from headscope.measures.exemplars import PROBE_KINDS, SHARP, WRITE, TopRows, empty_state, merged_states
from headscope.measures.pattern_scores import PatternScores
from headscope.run.feed import token_texts
from headscope.tables import DETECTOR_PREFIX

# headscope's own detector: the mass a streaming KV cache drops (docs/streaming.md), a column of its own name
FAR_MASS = "far_mass"


def scored_detectors(settings) -> tuple[Detector, ...]:
    """The detectors a run scores: its own (--detector), then far_mass's far:S,W pattern (none with --stream-window
    0). On texts no longer than S + W tokens no row has a far key: its kernels read empty runs, and far_mass is NaN."""
    if not settings.stream_window:
        return settings.detectors
    return (*settings.detectors, detector_of(FAR_MASS, f"far:{settings.stream_sink},{settings.stream_window}"))


def exemplar_kinds(settings) -> tuple[str, ...]:
    """The exemplar kinds of a run, in order: sharp, write, the probes' patterns, then its detectors (none
    without --exemplars)."""
    if not settings.exemplars:
        return ()
    return (SHARP, WRITE, *PROBE_KINDS, *(detector.name for detector in settings.detectors))


def evidence_shapes(plan) -> dict[str, tuple[int, ...]]:
    """The running arrays the evidence keeps (and checkpoints): name -> shape."""
    settings, layers, heads = plan.settings, len(plan.layers), plan.heads
    shapes = {}
    if settings.exemplars:
        shapes["exemplars"] = empty_state(layers, len(exemplar_kinds(settings)), heads, settings.exemplars).shape
    detectors = len(scored_detectors(settings))
    if detectors:
        shapes["detectors"] = (layers, heads, detectors, 2)
        shapes["detector_chance"] = (detectors, 2)
        if settings.bootstrap:
            shapes["detector_bootstrap"] = (settings.bootstrap, layers, heads, detectors, 2)
    return shapes


@dataclass
class DetectorScores:
    """Every detector's score per head, with its 95% interval and chance level (measures.detectors)."""

    detectors: tuple[Detector, ...]
    scores: np.ndarray  # (layers, heads, detectors)
    low: np.ndarray | None  # the same, or None without bootstrap replicates
    high: np.ndarray | None
    chance: np.ndarray  # (detectors,)

    def columns(self) -> dict[str, np.ndarray]:
        """heads.parquet's detect_<name> (far_mass: its own name), its interval's ends and its chance level, (layers,
        heads) each."""
        out = {}
        for i, detector in enumerate(self.detectors):
            name = FAR_MASS if detector.name == FAR_MASS else f"{DETECTOR_PREFIX}{detector.name}"
            out[name] = self.scores[..., i]
            if self.low is not None:
                out[f"{name}_ci_low"], out[f"{name}_ci_high"] = self.low[..., i], self.high[..., i]
            out[f"{name}_chance"] = np.full(self.scores.shape[:2], self.chance[i])
        return out


class HeadEvidence:
    """The exemplars and detector sums of one corpus pass. `measures` ride on the capture with the statistics;
    after each batch, `add` keeps what they found."""

    def __init__(self, plan, tokenizer, running: dict[str, np.ndarray]) -> None:
        settings = plan.settings
        self.settings, self.layers = settings, plan.layers
        self.kinds = exemplar_kinds(settings)
        self.detectors = scored_detectors(settings)
        shapes = evidence_shapes(plan)
        self.arrays = {name: running.get(name, np.zeros(shape)) for name, shape in shapes.items()}
        self.exemplars = None
        if settings.exemplars:
            state = self.arrays.pop("exemplars")
            state = empty_state(*shapes["exemplars"][:4]) if not state.any() else state  # a fresh run's zeros
            self.exemplars = TopRows(settings.exemplars, self.kinds, plan.layers, plan.heads, state=state)
        # the probes' patterns feed the exemplars only; the run's detectors come first and are scored
        probe_patterns = [detector_of(kind, spec) for kind, spec in PROBE_KINDS.items()] if settings.exemplars else []
        self.patterns = None
        if self.detectors or probe_patterns:

            def token_text(token_id: int) -> str:
                return token_texts(tokenizer, [token_id])[0]

            def token_strings(ids) -> list[str]:
                return token_texts(tokenizer, ids)

            self.patterns = PatternScores([*self.detectors, *probe_patterns], plan.layers, token_text=token_text,
                                          token_strings=token_strings, exemplars=self.exemplars,
                                          scored=len(self.detectors))  # fmt: skip

    @property
    def measures(self) -> list:
        return [] if self.patterns is None else [self.patterns]

    def add(self, sentence_ids) -> None:
        """Keep a batch's detector sums (the exemplars were offered as the layers ran)."""
        if self.patterns is None:
            return
        sums, chance = self.patterns.finish()
        if not self.detectors or sums is None:  # nothing to read in the batch: its sums are 0
            return
        per_sentence = sums.double().cpu().numpy()  # (layers, batch, heads, detectors, 2)
        self.arrays["detectors"] += per_sentence.sum(axis=1)
        self.arrays["detector_chance"] += chance.double().cpu().numpy().sum(axis=0)
        if "detector_bootstrap" in self.arrays:
            settings = self.settings
            weights = replicate_weights(np.asarray(sentence_ids), settings.bootstrap, settings.bootstrap_seed)
            moved = np.moveaxis(per_sentence, 1, 0)  # (batch, layers, heads, detectors, 2)
            replicated = weights @ moved.reshape(moved.shape[0], -1)
            self.arrays["detector_bootstrap"] += replicated.reshape(self.arrays["detector_bootstrap"].shape)

    def running(self) -> dict[str, np.ndarray]:
        """The arrays to checkpoint."""
        state = {} if self.exemplars is None else {"exemplars": self.exemplars.state}
        return {**self.arrays, **state}

    def combined(self, ranks, device: torch.device) -> HeadEvidence:
        """Every rank's evidence added up (sums) and merged (exemplars), on every rank."""
        from headscope.run.distributed import all_sum, gather

        reduce_on = device if device.type == "cuda" else torch.device("cpu")
        self.arrays = {name: all_sum(ranks, array, reduce_on) for name, array in self.arrays.items()}
        if self.exemplars is not None:
            self.exemplars.state = merged_states(gather(ranks, self.exemplars.state), self.kinds, self.layers)
        return self

    def exemplar_state(self) -> np.ndarray | None:
        return None if self.exemplars is None else self.exemplars.state

    def detector_scores(self, resampled: bool) -> DetectorScores | None:
        """The detectors' scores, intervals (with `resampled`: replicates over two or more sentences) and chance."""
        if not self.detectors:
            return None
        sums = self.arrays["detectors"]
        chance = self.arrays["detector_chance"]
        low = high = None
        if resampled and "detector_bootstrap" in self.arrays:
            replicates = self.arrays["detector_bootstrap"]
            low, high = percentile_interval(ratio(replicates[..., 0], replicates[..., 1]))
        return DetectorScores(self.detectors, ratio(sums[..., 0], sums[..., 1]), low, high,
                              ratio(chance[:, 0], chance[:, 1]))  # fmt: skip
