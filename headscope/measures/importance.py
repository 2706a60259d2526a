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

Exact ablation is batched: each batch runs once clean, keeping every decoder layer's output; then, for each
ablated layer, the batch is replicated along the batch axis, a different (head, replacement) in each replica,
and the layers before the ablated one are skipped (they hand on the clean output they had).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.capture import forward, measuring
from headscope.feed import Batch
from headscope.reporting import Reporter

LOSS_CHUNK_BYTES = 64 * 2**20  # float32 logits of the rows whose loss is computed at once


def token_losses(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sentence: the summed next-token cross-entropy (nats, float64) and how many tokens were predicted.

    logits: (batch, t, vocab), the model's own. Position p predicts the token at p + 1 when both are real
    tokens, so padding (on either side) never counts.
    """
    rows, t, vocab = logits.shape
    valid = batch.attention_mask.bool()
    predicted = valid[:, :-1] & valid[:, 1:]  # (batch, t - 1)
    targets = batch.input_ids[:, 1:]
    per_chunk = max(1, LOSS_CHUNK_BYTES // max(1, 4 * t * vocab))
    sums = []
    for first in range(0, rows, per_chunk):
        chunk = slice(first, first + per_chunk)
        nll = torch.nn.functional.cross_entropy(
            logits[chunk, :-1].float().transpose(1, 2), targets[chunk], reduction="none"
        )  # (chunk, t - 1)
        sums.append(torch.where(predicted[chunk], nll, 0.0).sum(-1).double())
    return torch.cat(sums), predicted.sum(-1)


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


class Ablations:
    """An OutputEditor for replicated batches: in replica r, head heads[r] of `layer` outputs replacements[r]."""

    def __init__(self, layer: int, heads: Sequence[int], replacements: torch.Tensor, rows: int) -> None:
        """replacements: (replicas, head_dim); rows: sentences per replica."""
        self.layer, self.heads, self.replacements, self.rows = layer, list(heads), replacements, rows

    def start(self, batch: Batch) -> None:
        pass

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        if layer != self.layer:
            return output
        output = output.clone()
        for replica, head in enumerate(self.heads):
            rows = slice(replica * self.rows, (replica + 1) * self.rows)
            output[rows, :, head, :] = self.replacements[replica].to(output.dtype)
        return output


def decoder_layers(base: torch.nn.Module, n_layers: int) -> torch.nn.ModuleList:
    """The base model's list of decoder layers (`layers` for Llama, `h` for GPT-2, ...)."""
    for module in base.children():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            return module
    raise RuntimeError(f"{type(base).__name__} has no list of {n_layers} decoder layers")


@contextlib.contextmanager
def recording(layers: torch.nn.ModuleList) -> Iterator[list]:
    """Keep every decoder layer's output of the next forward pass (detached)."""
    outputs: list = [None] * len(layers)

    def keep(index: int):
        def hook(module, args, output):
            outputs[index] = _detach(output)

        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def starting_at(layers: torch.nn.ModuleList, first: int, handed_on) -> Iterator[None]:
    """Run only layers[first:]: every layer before it returns `handed_on`, the clean input of layer `first`
    (so the last skipped layer hands it to the first one that runs)."""
    skipped = list(layers[:first])
    for layer in skipped:
        layer.forward = lambda *args, **kwargs: handed_on
    try:
        yield
    finally:
        for layer in skipped:
            del layer.forward


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value


def _replicate(value, times: int):
    if isinstance(value, torch.Tensor):
        return value.repeat(times, *[1] * (value.dim() - 1))
    if isinstance(value, tuple):
        return tuple(_replicate(v, times) for v in value)
    return value


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

    def columns(self) -> dict[str, np.ndarray]:
        """The heads table's importance columns that were measured."""
        names = ("ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def measure_importance(
    lm: torch.nn.Module,
    batches: Callable[[], Iterable[Batch]],
    *,
    layer_ids: Sequence[int],
    architecture: dict,
    exact: bool,
    replicas_per_forward,
    reporter: Reporter,
    block_bytes: int,
) -> Importance:
    """Attribution (and with `exact`, ablation) of every head of `layer_ids` over the corpus `batches`.

    batches() -> the corpus's batches afresh (called once per pass: twice with `exact`);
    replicas_per_forward(batch) -> how many replicas of `batch` one forward pass may hold.
    """
    heads, head_dim = architecture["heads"], architecture["head_dim"]
    recorder = HeadOutputs(layer_ids, heads, head_dim)
    clean, tokens = 0.0, 0
    for parameter in lm.parameters():
        parameter.requires_grad_(False)  # gradients are wanted for head outputs only
    embeddings = lm.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, output: output.requires_grad_())
    try:
        with measuring(lm, [], editors=[recorder], block_bytes=block_bytes) as capture:
            for batch in batches():
                output = forward(lm, capture, batch, grad=True)
                with torch.enable_grad():
                    losses, counts = token_losses(output.logits, batch)
                    losses.sum().backward()
                recorder.collect()
                clean += float(losses.detach().sum())
                tokens += int(counts.sum())
                reporter.advance(len(batch.sentence_ids), batch.n_tokens)
    finally:
        handle.remove()
    means = recorder.means()
    result = Importance(
        mode="exact" if exact else "fast",
        clean_loss=clean / max(tokens, 1),
        predicted_tokens=tokens,
        attribution_zero=-recorder.sum_output_grad / max(tokens, 1),
        attribution_mean=((means * recorder.sum_grad).sum(-1) - recorder.sum_output_grad) / max(tokens, 1),
    )
    if exact:
        zero, mean = _ablate(lm, batches, layer_ids, architecture, means, replicas_per_forward, reporter, block_bytes)
        result.ablation_zero, result.ablation_mean = zero / max(tokens, 1), mean / max(tokens, 1)
    return result


def _ablate(lm, batches, layer_ids, architecture, means, replicas_per_forward, reporter, block_bytes):
    """Summed loss increase (nats) of every (layer, head), zero- and mean-ablated, over the corpus."""
    heads = architecture["heads"]
    layers = decoder_layers(lm.base_model, architecture["layers"])
    zero, mean = np.zeros((len(layer_ids), heads)), np.zeros((len(layer_ids), heads))
    plan = [(head, kind) for head in range(heads) for kind in ("zero", "mean")]
    for batch in batches():
        with measuring(lm, [], block_bytes=block_bytes) as capture, recording(layers) as outputs:
            clean = token_losses(forward(lm, capture, batch).logits, batch)[0].sum()
        per_forward = max(1, replicas_per_forward(batch))
        for index, layer in enumerate(layer_ids):
            for first in range(0, len(plan), per_forward):
                group = plan[first : first + per_forward]
                replacements = torch.stack(
                    [
                        torch.zeros(means.shape[-1]) if kind == "zero" else torch.as_tensor(means[index, head])
                        for head, kind in group
                    ]
                ).to(batch.input_ids.device)
                editor = Ablations(layer, [head for head, _ in group], replacements, len(batch.sentence_ids))
                handed_on = _replicate(outputs[layer - 1], len(group)) if layer > 0 else None
                with (
                    starting_at(layers, layer, handed_on),
                    measuring(lm, [], editors=[editor], block_bytes=block_bytes, first_layer=layer) as capture,
                ):
                    logits = forward(lm, capture, batch.replicated(len(group))).logits
                losses = token_losses(logits, batch.replicated(len(group)))[0].view(len(group), -1).sum(-1)
                for (head, kind), loss in zip(group, losses, strict=True):
                    target = zero if kind == "zero" else mean
                    target[index, head] += float(loss - clean)
        reporter.advance(len(batch.sentence_ids), batch.n_tokens)
    return zero, mean
