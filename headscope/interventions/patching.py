"""Activation patching on prompt pairs: the metric of each pair with one head's activation taken from the other
prompt of the pair (docs/patch.md has the definitions).

Each batch of pairs runs once as [clean rows; corrupt rows] (a pair's prompts have the same length, so both halves
are padded alike). That pass records, for every patched layer, what each head's output becomes when patched
(`PairRecorder`): the other prompt's output (`output`), the other prompt's probabilities times this prompt's values
(`pattern`) or this prompt's probabilities times the other's values (`values`). A head patched alone changes
nothing before its layer, so its patched output is a function of the two recorded runs, and every patch is one
replacement of one head's output (`PatchedHeads`) in a pass that starts at its layer from the target prompts'
recorded state, many patches per forward as replicas of the batch (interventions.group_losses does the same for
ablation). `--fast` replaces those passes by one backward pass of the metric: m_patched ~ m + (z' - z) . dm/dz.

`q` and `k` patch a head's inputs instead (`ProjectionPatch`): its features of the query projection's output, or
its KV head's features of the key projection's output, taken from the other prompt in the same replicated passes;
the head then attends with them, and everything after it follows.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.errors import ModelLoadError
from headscope.estimates import MIN_BOOTSTRAP_SENTENCES, percentile_interval, replicate_ratios
from headscope.interventions.group_losses import replica_passes
from headscope.interventions.pairs import TokenizedPair
from headscope.interventions.removal import ReplicaEditor
from headscope.model.attention.readout import RowBlock, repeat_kv
from headscope.model.batch import Batch, plan_batches
from headscope.model.layer_outputs import replicate, rows_of
from headscope.model.layers import layer_modules

Unit = tuple[int, int, int | None]  # (layer, head, position or None for every position)


@dataclass(frozen=True)
class Metric:
    name: str
    definition: str  # as docs/patch.md and patch.json say it
    compute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, answer, distractor)


def logit_difference(logits: torch.Tensor, answer: torch.Tensor, distractor: torch.Tensor) -> torch.Tensor:
    """(rows,) logit[answer] - logit[distractor]; logits (rows, vocab) at each row's last position."""
    logits = logits.float()
    return logits.gather(1, answer[:, None])[:, 0] - logits.gather(1, distractor[:, None])[:, 0]


METRICS = {
    "logit_diff": Metric("logit_diff", "logit[answer] - logit[distractor] at the last position", logit_difference)
}


@dataclass
class PairBatch:
    """A batch of pairs: `both` holds the clean prompts then the corrupt ones; patches go into `target`'s rows."""

    pair_ids: list[int]
    both: Batch
    target_rows: slice
    source_rows: slice
    answer: torch.Tensor  # (pairs,) long
    distractor: torch.Tensor
    target: Batch  # both's target rows, as a batch of their own


def pair_batches(pairs: Sequence[TokenizedPair], plan, device, direction: str) -> Iterator[PairBatch]:
    """The pairs batched by length (two prompts per pair within the plan's importance limits; the padding side is
    the plan's and changes no number). denoise: patches go into the corrupt prompts; noise: into the clean ones."""
    limits = plan.limits("importance")
    lengths = {pair.pair.pair_id: pair.length for pair in pairs}
    by_id = {pair.pair.pair_id: pair for pair in pairs}
    for ids in plan_batches(lengths, max_sentences=max(1, limits.max_sentences // 2),
                            max_tokens=max(1, limits.max_tokens // 2)):  # fmt: skip
        members = [by_id[i] for i in ids]
        both = plan.collate(ids + ids, [p.clean_ids for p in members] + [p.corrupt_ids for p in members], device)
        clean, corrupt = slice(0, len(ids)), slice(len(ids), 2 * len(ids))
        target, source = (corrupt, clean) if direction == "denoise" else (clean, corrupt)
        tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        yield PairBatch(ids, both, target, source, tensor([p.answer_id for p in members]),
                        tensor([p.distractor_id for p in members]), both.rows(target))  # fmt: skip


def last_columns(batch: Batch) -> torch.Tensor:
    """(rows,) the column of each row's last real token."""
    return batch.seq_start + batch.attention_mask.sum(-1) - 1


def kept_logits(capture, batch: Batch) -> int | torch.Tensor:
    """What the LM head must score: each row's last real token ((rows, 1) positions) where the model can score
    positions row by row, else the last k positions of every row, k enough to reach every row's last token (the LM
    head is most of a pass that starts late: 49,152 x 576 per scored position on SmolLM2)."""
    last = last_columns(batch)
    return last[:, None] if capture.keeps_rows else int(batch.input_ids.shape[1] - last.min())


def metric_of(metric: Metric, logits: torch.Tensor, batch: Batch, kept, answer, distractor) -> torch.Tensor:
    """(rows,) the metric at each row's last real token; logits as the pass asked for them with `kept`
    (kept_logits), or for every position where the model scores them all."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    if logits.shape[1] == batch.input_ids.shape[1]:  # every position
        last = logits[rows, last_columns(batch)]
    elif isinstance(kept, torch.Tensor):  # one position per row
        last = logits[:, 0]
    else:  # the last logits.shape[1] positions
        last = logits[rows, last_columns(batch) - (batch.input_ids.shape[1] - logits.shape[1])]
    return metric.compute(last, answer, distractor)


class PairRecorder:
    """A measure and output editor on the [clean; corrupt] pass: per patched layer, each head's output as the patch
    makes it (`replacement`, (pairs, t, heads, head_dim) float32), and for `--positions each` with `values` the
    target's probabilities and the values' difference. Leaves every output as it is."""

    def __init__(self, what: str, layers: Sequence[int], target: slice, source: slice, *, each: bool, keep: bool):
        self.what, self.layers, self.target, self.source = what, set(layers), target, source
        self.each, self.keep = each, keep  # keep: the target's own outputs too (the first-order estimate)
        self.replacement: dict[int, torch.Tensor] = {}
        self.target_output: dict[int, torch.Tensor] = {}
        self.target_weights: dict[int, torch.Tensor] = {}  # (pairs, heads, t, t): values-each only
        self.value_change: dict[int, torch.Tensor] = {}  # (pairs, kv_heads, t, head_dim): source - target values
        self._blocks: dict[int, list[RowBlock]] = {}
        self._valid: torch.Tensor | None = None

    def start(self, batch: Batch) -> None:
        self.replacement, self.target_output, self.target_weights, self.value_change = {}, {}, {}, {}
        self._blocks, self._valid = {}, batch.attention_mask.bool()

    def wants(self, layer: int) -> bool:
        return self.what in ("pattern", "values") and layer in self.layers

    def last_layer(self) -> int | None:
        return None  # the pass runs to the end: it keeps every layer's output and the logits

    def attention(self, layer: int, block: RowBlock) -> None:
        self._blocks.setdefault(layer, []).append(block)

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        if layer not in self.layers:
            return output
        if self.what in PROJECTED:  # ProjectionPatch keeps what q and k patch
            return output
        z = output.detach().float()  # (rows, t, heads, head_dim)
        if self.keep:
            self.target_output[layer] = z[self.target]
        if self.what == "output":
            self.replacement[layer] = z[self.source]
            return output
        weights, value = self._weights_and_value(layer, z)
        values = repeat_kv(value, z.shape[2])  # (rows, heads, t, head_dim)
        looks, moves = (self.source, self.target) if self.what == "pattern" else (self.target, self.source)
        self.replacement[layer] = torch.matmul(weights[looks], values[moves]).transpose(1, 2)
        if self.each and self.what == "values":
            self.target_weights[layer] = weights[self.target]
            self.value_change[layer] = value[self.source] - value[self.target]
        return output

    def _weights_and_value(self, layer: int, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, heads, t, t) probabilities and (rows, kv_heads, t, head_dim) values of `layer`, checked to give its
        output: pattern and values patching rest on output = probabilities x values."""
        blocks = self._blocks.pop(layer)
        t = z.shape[1]
        rows = [block.probabilities().float() for block in blocks]  # a block sees keys up to its last row
        rows = [torch.nn.functional.pad(row, (0, t - row.shape[-1])) for row in rows]
        weights, value = torch.cat(rows, dim=2), blocks[0].value.float()
        product = torch.matmul(weights, repeat_kv(value, z.shape[2])).transpose(1, 2)
        real = self._valid[:, :, None, None]
        scale = max(1.0, float(z.abs().amax()))
        tolerance = 1e-4 if blocks[0].value.dtype == torch.float32 else 2e-2
        if float(((product - z) * real).abs().amax()) > tolerance * scale:
            raise ModelLoadError(
                f"layer {layer}'s attention output is not its probabilities times its values, so --what "
                f"{self.what} cannot patch one without the other on this model; --what output can"
            )
        return weights, value


class PatchedHeads(ReplicaEditor):
    """Replicas of the target batch (`rows` rows each): replica r has units[r] patched, at `layer`."""

    def __init__(self, recorder: PairRecorder, layer: int, units: Sequence[Unit], rows: int, columns: torch.Tensor):
        super().__init__(rows)
        self.recorder = recorder
        self.columns = columns  # (pairs, positions) long: the column of each pair's token at each position
        for replica, (_, head, position) in enumerate(units):
            self.add(layer, replica, functools.partial(self._patch, layer, head, position))

    def _patch(self, layer: int, head: int, position: int | None, block: torch.Tensor) -> None:
        replacement = self.recorder.replacement[layer].to(block.dtype)
        if position is None:
            block[:, :, head] = replacement[:, :, head]
            return
        pairs = torch.arange(self.rows, device=block.device)
        column = self.columns[:, position]
        if self.recorder.what == "values":  # the value vector at key `column` changes every row reading it
            weights = self.recorder.target_weights[layer][pairs, head, :, column]  # (pairs, t)
            kv_head = head // (block.shape[2] // self.recorder.value_change[layer].shape[1])
            change = self.recorder.value_change[layer][pairs, kv_head, column]  # (pairs, head_dim)
            block[:, :, head] += (weights[:, :, None] * change[:, None, :]).to(block.dtype)
        else:
            block[pairs, column, head] = replacement[pairs, column, head]


PROJECTED = {"q": "query", "k": "key"}  # --what that patches a head's input: its projection's output


class ProjectionPatch:
    """--what q / k: what a head reads, its query (or its KV head's key: a grouped-KV model's query heads share
    it, so the heads of one group patch the same key), as the q or k projection makes it. `recording` keeps the
    source prompts' projection outputs on the [clean; corrupt] pass; `patching` puts one head's features of them
    into each replica of the target rows, at every position or at each pair's column of one position."""

    def __init__(self, decoder, architecture: dict, channel: str, layers: Sequence[int]) -> None:
        self.channel, self.layers = channel, sorted(set(layers))
        self.heads, kv_heads, self.head_dim = (architecture[key] for key in ("heads", "kv_heads", "head_dim"))
        self.group = self.heads // kv_heads
        self.modules, self.offsets = {}, {}
        for layer in self.layers:
            place = layer_modules(decoder[layer], self.heads, kv_heads, self.head_dim)
            if place.unplaced is not None:
                raise ModelLoadError(place.unplaced)
            fused = place.fused is not None  # GPT-2's c_attn: q | k | v
            self.modules[layer] = place.fused if fused else getattr(place, channel)
            self.offsets[layer] = self.heads * self.head_dim if fused and channel == "k" else 0
        self.source: dict[int, torch.Tensor] = {}

    def features(self, layer: int, head: int) -> slice:
        unit = head if self.channel == "q" else head // self.group
        start = self.offsets[layer] + unit * self.head_dim
        return slice(start, start + self.head_dim)

    @contextlib.contextmanager
    def recording(self, source_rows: slice) -> Iterator[None]:
        self.source = {}

        def keep(layer):
            def hook(module, args, output):
                self.source[layer] = output[source_rows].detach()

            return hook

        handles = [self.modules[layer].register_forward_hook(keep(layer)) for layer in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def patching(self, layer: int, units: Sequence[Unit], rows: int, columns: torch.Tensor | None) -> Iterator[None]:
        """Replica r (rows r * rows ...) of the pass reads units[r]'s head's features from the source."""
        source = self.source[layer]

        def put(module, args, output):
            output = output.clone()
            for replica, (_, head, position) in enumerate(units):
                features, block = self.features(layer, head), output[replica * rows : (replica + 1) * rows]
                if position is None:
                    block[..., features] = source[..., features]
                else:
                    pairs = torch.arange(rows, device=block.device)
                    column = columns[:, position]
                    block[pairs, column, features] = source[pairs, column, features]
            return output

        handle = self.modules[layer].register_forward_hook(put)
        try:
            yield
        finally:
            handle.remove()


def exact_metrics(capture, batch: PairBatch, recorder: PairRecorder, outputs: list, units: Sequence[Unit],
                  metric: Metric, columns: torch.Tensor, replicas: int, on_forward: Callable[[Batch], None],
                  projections: ProjectionPatch | None = None, unchanged: Sequence[int] = (),
                  target_metric: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """(units, pairs) the metric with each unit patched, each by its own replica of the target rows, in passes
    starting at the unit's layer; outputs: every decoder layer's output on the [clean; corrupt] pass; on_forward: told
    each pass's replicated batch; projections: for --what q / k, what patches the heads' inputs. unchanged: units
    that patch, in every pair of the batch, only positions before its first differing token, where the two prompts'
    activations are the same: not run, their metric the target's own (`target_metric`, (pairs,))."""
    target = batch.target
    found = np.zeros((len(units), len(batch.pair_ids)))
    if len(unchanged):
        found[list(unchanged)] = target_metric
    skipped = set(unchanged)
    todo = [i for i in range(len(units)) if i not in skipped]
    groups = [[units[i][:2]] for i in todo]
    for layer, chosen in replica_passes(groups, set(), len(outputs), replicas):
        chunk = [todo[i] for i in chosen]
        replicated = target.replicated(len(chunk))
        members = [units[i] for i in chunk]
        handed_on = replicate(rows_of(outputs[layer - 1], batch.target_rows), len(chunk)) if layer > 0 else None
        kept = kept_logits(capture, replicated)
        if projections is not None:
            with projections.patching(layer, members, len(batch.pair_ids), columns):
                output = capture.run(replicated, start_at=layer, handed_on=handed_on, logits_to_keep=kept)
        else:
            editor = PatchedHeads(recorder, layer, members, len(batch.pair_ids), columns)
            output = capture.run(replicated, editors=[editor], start_at=layer, handed_on=handed_on,
                                 logits_to_keep=kept)  # fmt: skip
        values = metric_of(metric, output.logits, replicated, kept, batch.answer.repeat(len(chunk)),
                           batch.distractor.repeat(len(chunk)))  # fmt: skip
        found[chunk] = values.view(len(chunk), -1).double().cpu().numpy()
        on_forward(replicated)
    return found


class _GradientKeeper:
    """An output editor that keeps each recorded layer's output with its gradient retained."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers, self.outputs = set(layers), {}

    def start(self, batch: Batch) -> None:
        self.outputs = {}

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        if layer in self.layers:
            output.retain_grad()
            self.outputs[layer] = output
        return output


def attributed_metrics(capture, batch: PairBatch, recorder: PairRecorder, units: Sequence[Unit], metric: Metric,
                       columns: torch.Tensor) -> np.ndarray:  # fmt: skip
    """(units, pairs) first-order estimates of the patched metric: m + sum over the patched positions of
    (z' - z) . dm/dz, from one forward and one backward pass of the target prompts (attribution patching)."""
    target = batch.target
    keeper = _GradientKeeper({layer for layer, _, _ in units})
    kept = kept_logits(capture, target)
    output = capture.run(target, editors=[keeper], grad=True, logits_to_keep=kept)
    with torch.enable_grad():
        values = metric_of(metric, output.logits, target, kept, batch.answer, batch.distractor)
        values.sum().backward()
    base = values.detach().double().cpu().numpy()
    valid = target.attention_mask.bool()[:, :, None, None]
    pairs = torch.arange(len(batch.pair_ids), device=valid.device)
    found = np.zeros((len(units), len(batch.pair_ids)))
    terms: dict[int, torch.Tensor] = {}  # layer -> (pairs, heads) or (pairs, heads, positions)
    for layer in sorted(keeper.outputs):
        grad = keeper.outputs[layer].grad.float() * valid  # (pairs, t, heads, head_dim)
        change = recorder.replacement[layer] - recorder.target_output[layer]
        if columns is None:
            terms[layer] = (change * grad).sum((1, 3))
        elif recorder.what == "values":  # sum over rows t of p(t, c) (dv(c) . g(t)) for each key column c
            heads = grad.shape[2]
            dv = repeat_kv(recorder.value_change[layer], heads)  # (pairs, heads, t, head_dim)
            reach = torch.einsum("bthd,bhcd->bhtc", grad, dv) * recorder.target_weights[layer]
            terms[layer] = reach.sum(2)[pairs[:, None], :, columns].permute(0, 2, 1)  # (pairs, heads, positions)
        else:
            per_column = (change * grad).sum(-1)  # (pairs, t, heads)
            terms[layer] = per_column[pairs[:, None], columns].permute(0, 2, 1)
    for index, (layer, head, position) in enumerate(units):
        term = terms[layer][:, head] if position is None else terms[layer][:, head, position]
        found[index] = base + term.double().cpu().numpy()
    return found


def patch_effects(patched: np.ndarray, clean: np.ndarray, corrupt: np.ndarray, direction: str, pair_ids: np.ndarray,
                  *, replicates: int, seed: int) -> dict[str, np.ndarray]:  # fmt: skip
    """Each unit's effect and its 95% paired bootstrap interval over pairs (Poisson weights keyed by pair id, so
    the draws do not depend on batching or order).

    patched: (units, pairs) metric with the unit patched; clean, corrupt: (pairs,) the metric on each prompt.
    denoise: (mean patched - mean corrupt) / (mean clean - mean corrupt); noise: (mean clean - mean patched) / the
    same. NaN where clean and corrupt give the same mean (there is no behaviour to explain), and then the interval
    too: a replicate's gap is not 0 by chance, but an effect on no gap has nothing to be an interval of."""
    gap = clean - corrupt  # (pairs,)
    moved = patched - corrupt if direction == "denoise" else clean - patched  # (units, pairs)
    no_gap = gap.mean() == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        effect = np.full(len(patched), np.nan) if no_gap else moved.mean(1) / gap.mean()
    low = high = np.full(len(patched), np.nan)
    if replicates and len(gap) >= MIN_BOOTSTRAP_SENTENCES and not no_gap:
        draws = replicate_ratios(pair_ids, replicates, seed, moved.T, gap)  # (replicates, units)
        low, high = percentile_interval(draws)
    return {"effect": effect, "effect_ci_low": low, "effect_ci_high": high, "mean_patched": patched.mean(1)}


def beyond_parts(output: np.ndarray, pattern: np.ndarray, values: np.ndarray, clean: np.ndarray, corrupt: np.ndarray,
                 direction: str, pair_ids: np.ndarray, *, replicates: int, seed: int) -> dict:  # fmt: skip
    """How far patching each unit's output moves m beyond patching its pattern and its values apart: each part's
    effect, and effect(output) - effect(pattern) - effect(values) with its paired bootstrap interval (the same
    draws as every effect). output, pattern, values: (units, pairs) m with the unit patched that way. 0 where the
    head's output is its probabilities times its values and each part acts alone; nonzero where the two interact
    (both change together) or where something besides them differs between the prompts."""
    # the difference of the three effects as one patched array: its effect is that difference, its interval the
    # same ratio's
    combined = output - pattern - values + (2 * corrupt if direction == "denoise" else 2 * clean)
    found = patch_effects(combined, clean, corrupt, direction, pair_ids, replicates=replicates, seed=seed)
    parts = {name: patch_effects(array, clean, corrupt, direction, pair_ids, replicates=0, seed=seed)["effect"]
             for name, array in (("pattern_effect", pattern), ("values_effect", values))}  # fmt: skip
    return parts | {"beyond_parts": found["effect"], "beyond_ci_low": found["effect_ci_low"],
                    "beyond_ci_high": found["effect_ci_high"]}  # fmt: skip
