"""The plan of a run: everything a pass needs, resolved once from the settings and the model's config.

`resolve_plan` is the one place a setting is turned into what the code uses: which layers are measured and how
deep the model is, how long a sentence may be, what the running sums accumulate in and their shapes, how many
sentences and tokens each kind of pass may batch, and the layer bands. Every pass reads the plan, and measures
build themselves from it (`AttentionStatistics.from_plan`, ...), so no option can be dropped on the way.
Another rank resolves the same plan from rank 0's sizing (`Plan.sizing`). The checkpoint keeps the plan
(`Plan.record`): a resumed run, batched as the interrupted one was, must resolve it again exactly, or the
checkpoint is refused.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from headscope.columns import STATS
from headscope.config import RunConfig
from headscope.errors import ConfigError, ResourceError
from headscope.estimates import Bootstrap
from headscope.model.architecture import architecture_of, layer_attention, model_max_length, text_config
from headscope.model.batch import Batch, collate
from headscope.model.memory import (
    MAX_AUTO_SENTENCES,
    bytes_per_token,
    default_budget,
    host_free_memory,
    importance_bytes_per_token,
    readable,
    tokens_per_batch,
)
from headscope.run.feed import CorpusFeed
from headscope.run.head_evidence import evidence_shapes
from headscope.summary import depth_bands


@dataclass(frozen=True)
class Batching:
    """How much one forward pass may hold."""

    max_sentences: int
    max_tokens: int  # padded tokens (sentences x the longest of them)


@dataclass(frozen=True)
class Plan:
    settings: RunConfig  # as the run uses them (a resumed run: with the first run's batching settings)
    architecture: dict  # model_type, layers (the model's depth), heads, kv_heads, head_dim
    layers: tuple[int, ...]  # the layers measured, ascending: every layer unless --layers
    max_length: int | None  # sentences are cut to this many tokens: --max-length or the model's limit
    model_limit: int | None  # the longest sequence the model's positions allow (None: unbounded)
    accumulate: torch.dtype  # running sums: float64 (float32 on MPS, which has no float64)
    memory_budget: int  # bytes for activations and attention in one forward pass
    corpus: Batching  # the corpus and probe passes
    importance: Batching  # forward + backward passes on the LM (head importance)
    replica_tokens: int  # padded tokens one ablation forward may hold (replicas x a batch's tokens)
    attention: tuple[tuple[str, int | None], ...] = ()  # each layer's attention kind and window (layer_attention)

    @property
    def measures_importance(self) -> bool:
        """Does the run measure head importance (and so need the LM head and the corpus kept for another pass)?"""
        return self.settings.importance != "none"

    def limits(self, kind: str) -> Batching:
        """How much one forward pass of `kind` may hold: "corpus" (the corpus and probe passes) or "importance"
        (passes through the LM: gradients, removed heads)."""
        return {"corpus": self.corpus, "importance": self.importance}[kind]

    def replicas(self, batch: Batch) -> int:
        """How many replicas of `batch` one forward pass with heads removed may hold (`replica_tokens`)."""
        return self.replica_tokens // batch.input_ids.numel()

    def collate(self, ids: list[int], sequences: list[list[int]], device=None) -> Batch:
        """One batch of `sequences`, padded on the plan's side (settings.padding_side, which changes no number)."""
        return collate(ids, sequences, padding_side=self.settings.padding_side, device=device)

    def chunk_batches(self, feed: CorpusFeed, chunk, kind: str = "corpus") -> Iterator[Batch]:
        """A chunk's batches for a pass of `kind`, on the host."""
        limits = self.limits(kind)
        yield from feed.batches(chunk, max_sentences=limits.max_sentences, max_tokens=limits.max_tokens,
                                padding_side=self.settings.padding_side)  # fmt: skip

    def batches(self, feed: CorpusFeed, kind: str, device) -> Iterator[Batch]:
        """Every batch of the feed's corpus for a pass of `kind`, on `device`."""
        for index in range(len(feed)):
            for batch in self.chunk_batches(feed, feed.chunk(index), kind):
                yield batch.to(device)

    @property
    def depth(self) -> int:
        return self.architecture["layers"]

    @property
    def heads(self) -> int:
        return self.architecture["heads"]

    def check_heads(self, heads, option: str = "--heads") -> None:
        """Refuse a head the model does not have (`check_heads`)."""
        check_heads(heads, self.architecture, option)

    @property
    def sums_shape(self) -> tuple[int, int, int]:
        """(measured layers, heads, row sums) of the corpus-wide statistics."""
        return (len(self.layers), self.heads, len(STATS))

    @property
    def running_shapes(self) -> dict[str, tuple[int, ...]]:
        """The running sums a run keeps (and checkpoints): name -> shape."""
        shapes = {"sums": self.sums_shape}
        if self.settings.bootstrap:
            shapes["bootstrap"] = Bootstrap.shape(self.settings.bootstrap, len(self.layers), self.heads)
        return shapes | evidence_shapes(self)

    @property
    def bands(self) -> dict[str, range]:
        """early, middle, late: the model's own bands (summary.depth_bands), whichever layers were measured."""
        return depth_bands(self.depth)

    @property
    def sizing(self) -> dict:
        """What decided the batch sizes: a resumed run or another rank resolves the same plan from it."""
        return {
            "batch_size": self.settings.batch_size,
            "max_memory": self.settings.max_memory,
            "memory_budget": self.memory_budget,
        }

    def record(self) -> dict:
        """The plan as JSON: the checkpoint keeps it, and a resumed run must resolve exactly this again."""
        return {
            "layers": list(self.layers),
            "depth": self.depth,
            "heads": self.heads,
            "max_length": self.max_length,
            "accumulate": str(self.accumulate).removeprefix("torch."),
            "sizing": self.sizing,
            "corpus": dataclasses.asdict(self.corpus),
            "importance": dataclasses.asdict(self.importance),
            "replica_tokens": self.replica_tokens,
        }

    def batching(self) -> dict:
        """The corpus pass's batching, as run.json reports it."""
        return {
            "max_sentences": self.corpus.max_sentences,
            "max_tokens": self.corpus.max_tokens,
            "memory_budget_bytes": self.memory_budget,
        }


def needs_lm_head(settings: RunConfig) -> bool | str:
    """Does analyze load the LM head (decided before the model, and so the plan, exists)? True for head importance,
    which cannot do without; "if-present" for the dormant label's check, which says it could not check on a
    checkpoint without one, and for ov_copying, which reads the unembedding (the tied embeddings without one);
    ablate and prune (and every intervention) always score the loss."""
    if settings.importance != "none":
        return True
    return IF_PRESENT if settings.check_dormant or settings.copying else False


IF_PRESENT = "if-present"  # load the LM head where the checkpoint has one


def check_heads(heads, architecture: dict, option: str = "--heads") -> None:
    """Refuse a head the model does not have (heads: (layer, head) pairs, already checked to be whole numbers 0 or
    more by config.as_heads / parse_heads; architecture: architecture_of the model's config): the one range check
    of every command, before the weights load where the command checks its config."""
    depth, count = architecture["layers"], architecture["heads"]
    for layer, head in heads:
        if layer >= depth or head >= count:
            raise ConfigError(f"{option} names {layer}.{head}; the model has layers 0-{depth - 1} with heads "
                              f"0-{count - 1}")  # fmt: skip


def max_length_for(settings: RunConfig, model_config) -> int | None:
    """The longest text a run cuts to: --max-length, or the model's limit (refused where it passes the limit)."""
    return _max_length(settings.max_length, model_max_length(model_config))


def check_settings(settings: RunConfig, model_config) -> None:
    """Refuse what the model cannot do (layers it lacks, sentences longer than its positions) and what would not
    fit in memory (the bootstrap's replicate sums), before the weights load: the same checks `resolve_plan` makes."""
    architecture = architecture_of(model_config)
    layers = _selected_layers(settings.layers, architecture["layers"])
    max_length_for(settings, model_config)
    if settings.bootstrap:
        # The replicate sums, and as much again for each batch's share while it is added (float64).
        per_replicate = 2 * 8 * math.prod(Bootstrap.shape(1, len(layers), architecture["heads"]))
        budget = settings.max_memory or host_free_memory() // 2
        needed = settings.bootstrap * per_replicate
        if needed > budget:
            raise ResourceError(
                f"--bootstrap {settings.bootstrap:,} needs {readable(needed)} for its replicate sums "
                f"({len(layers)} layers x {architecture['heads']} heads), more than the {readable(budget)} "
                f"budget; {budget // per_replicate:,} replicates fit (or raise --max-memory)"
            )


# Importance passes plan their batches on this share of the budget: the rest is the allocator's slack (a gradient
# pass at its estimate peaked 15% above it on SmolLM2: benchmarks/importance_memory.py).
IMPORTANCE_SHARE = 0.8


def resolve_plan(settings: RunConfig, model_config, *, dtype: torch.dtype, device_type: str, budget: int) -> Plan:
    """The plan for running `settings` on a model with `model_config` in `dtype`, with `budget` bytes of memory
    per forward pass (settings.max_memory, or what the device had free). Pure: the same inputs, the same plan."""
    architecture = architecture_of(model_config)
    limit = model_max_length(model_config)
    text = text_config(model_config)
    hidden, intermediate = text.hidden_size, _intermediate_size(text)
    sentences = settings.batch_size or MAX_AUTO_SENTENCES
    with_grad, without_grad = (
        importance_bytes_per_token(hidden, intermediate, architecture["layers"], text.vocab_size, dtype, grad=grad)
        for grad in (True, False)
    )
    return Plan(
        settings=settings,
        architecture=architecture,
        layers=_selected_layers(settings.layers, architecture["layers"]),
        max_length=_max_length(settings.max_length, limit),
        model_limit=limit,
        accumulate=torch.float32 if device_type == "mps" else torch.float64,
        memory_budget=budget,
        corpus=Batching(
            sentences, tokens_per_batch(budget, bytes_per_token(hidden, intermediate, dtype), settings.block_bytes)
        ),
        importance=Batching(sentences, max(1, int(IMPORTANCE_SHARE * budget) // with_grad)),
        replica_tokens=max(1, int(IMPORTANCE_SHARE * budget) // without_grad),
        attention=layer_attention(model_config),
    )


def plan_for_model(settings: RunConfig, loaded) -> Plan:
    """The plan for `settings` on a loaded model (headscope.model.loading.LoadedModel), within settings.max_memory or,
    by default, half the memory its device has free."""
    budget = settings.max_memory or default_budget(loaded.device)
    return resolve_plan(
        settings, loaded.model.config, dtype=loaded.dtype, device_type=loaded.device.type, budget=budget
    )


def resized(plan: Plan, sizing: dict, model_config, *, dtype: torch.dtype, device_type: str) -> Plan:
    """The plan again, batched as `sizing` (another run's `Plan.sizing`) says."""
    settings = dataclasses.replace(plan.settings, batch_size=sizing["batch_size"], max_memory=sizing["max_memory"])
    return resolve_plan(settings, model_config, dtype=dtype, device_type=device_type, budget=sizing["memory_budget"])


def _selected_layers(requested: tuple[int, ...] | None, depth: int) -> tuple[int, ...]:
    if requested is None:
        return tuple(range(depth))
    beyond = [layer for layer in requested if layer >= depth]
    if beyond:
        raise ConfigError(f"--layers names layer {beyond[0]}, but the model has layers 0-{depth - 1}")
    return tuple(sorted(set(requested)))


def _max_length(requested: int | None, limit: int | None) -> int | None:
    if requested and limit and requested > limit:
        raise ConfigError(f"--max-length {requested} exceeds the model's limit of {limit} tokens")
    return requested or limit


def _intermediate_size(text_config) -> int:
    intermediate = getattr(text_config, "intermediate_size", None) or getattr(text_config, "n_inner", None)
    return intermediate or 4 * text_config.hidden_size
