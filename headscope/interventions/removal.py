"""How a head is removed: the one definition every intervention uses (importance, ablate, prune, surgery).

A head's output is its slice of the input to the layer's attention output projection (o_proj, c_proj, ...), at
every position: (batch, t, heads, head_dim), what `capture` hands an OutputEditor. Removing it replaces that
slice, at every position, by its `replacement`: zero (`zero` mode) or the head's mean output over every real token
position of the corpus on the clean model (`mean` mode, the same constant whichever other heads are removed).
`window` mode keeps the head but narrows what it sees to what a streaming KV cache keeps (`Window`): its
attention computed afresh over the sentence's first `sink` keys and the last `size` ones, each row renormalised
over the keys it keeps, on top of the model's own mask; its replacement is that output, position by position.

A `Removal` does the three things a removal must do, each written once here:
    editing      RemovedHeads puts the replacement into the capture's passes (replicas of a batch, a group each)
    estimating   `estimate`: the first-order change of the loss, sum over positions of (replacement - o) . dL/do,
                 from one gradient pass's sums (`OutputSums` with grad); `curvature`: the second-order term
                 prune adds to it, half the sum over positions of ((replacement - o) . dL/do)^2
    folding      `fold`: the replacement written into the output projection's weights (zeroed columns, and in
                 mean mode W_h m_h added to the bias), so that a plain forward pass computes the same model

`OutputSums` is the one recorder of head outputs (their means for mean removal; with a gradient pass, what the
estimate needs), and `gradient_pass` the one forward-and-backward pass over a corpus.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.config import DEFAULT_REMOVAL, DEFAULT_SINK, DEFAULT_WINDOW, REMOVAL_MODES
from headscope.errors import ConfigError
from headscope.interventions.clean_prefix import CleanPrefix
from headscope.interventions.loss import token_losses
from headscope.model.batch import Batch
from headscope.model.projection import linear_weight
from headscope.run.distributed import Ranks, added, together

Head = tuple[int, int]  # (layer, head)


@dataclass(frozen=True)
class Window:
    """What a windowed head keeps of its keys: the sentence's first `sink` and the last `size` (the row's own
    included), as a streaming KV cache keeps them (StreamingLLM's attention sinks and recent window)."""

    sink: int = DEFAULT_SINK
    size: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ConfigError(f"--window takes a whole number of keys >= 1; got {self.size!r}")
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ConfigError(f"--sink takes a whole number of keys >= 0; got {self.sink!r}")

    @property
    def kept(self) -> str:
        """What it keeps, as the printouts and notebook views say it."""
        return f"the first {self.sink} keys and the last {self.size}"


def window_of(mode: str, window: int | None, sink: int | None) -> Window | None:
    """The keys window mode keeps (defaults 64 and 4), or None for another mode, which takes neither option."""
    if mode != "window":
        given = [name for name, value in (("--window", window), ("--sink", sink)) if value is not None]
        if given:
            raise ConfigError(f"{given[0]} sets what a windowed head keeps: it takes effect with --mode window only")
        return None
    return Window(DEFAULT_SINK if sink is None else sink, DEFAULT_WINDOW if window is None else window)


@dataclass(frozen=True)
class Removal:
    """How removed heads are replaced: zero, each head's clean corpus mean (means: (depth, heads, head_dim), which
    the other modes do not read), or their attention windowed (`window`, which only window mode reads)."""

    mode: str = DEFAULT_REMOVAL
    means: np.ndarray | None = None
    window: Window | None = None

    def __post_init__(self) -> None:
        if self.mode not in REMOVAL_MODES:
            raise ConfigError(f"--mode takes {', '.join(REMOVAL_MODES)}; got {self.mode!r}")
        if self.mode == "mean" and self.means is None:
            raise ConfigError("mean removal needs each head's mean output over the corpus")
        if self.mode == "window" and self.window is None:
            raise ConfigError("window removal needs a Window (--sink and --window)")

    @property
    def windowed(self) -> bool:
        """The replacement is the head's own windowed attention, position by position (not a constant)."""
        return self.mode == "window"

    def replacement(self, layers: Sequence[int], heads: int, head_dim: int) -> np.ndarray:
        """(len(layers), heads, head_dim) float64: the constant each head's output becomes (zero and mean)."""
        assert not self.windowed, "a windowed head's output is recomputed at every position, not a constant"
        if self.mode == "zero":
            return np.zeros((len(layers), heads, head_dim))
        return self.means[list(layers)]

    def value(self, layer: int, head: int, head_dim: int) -> torch.Tensor:
        """(head_dim,) float32: one head's replacement, as the capture puts it in."""
        if self.mode == "zero":
            return torch.zeros(head_dim)
        return torch.as_tensor(self.means[layer, head], dtype=torch.float32)

    def estimate(self, sums: OutputSums, tokens: int) -> np.ndarray:
        """(layers, heads): the first-order change of the mean loss (nats per predicted token) from removing each
        head of `sums`' layers alone, on the model `sums` was recorded on: with o the output and g = dL/do,
        sum over positions of (replacement - o) . g = replacement . (sum g) - sum o . g. Window mode: the sum of
        (w - o) . g with w the head's windowed output on the same pass (`OutputSums(window=...)` recorded it)."""
        if self.windowed:
            if sums.sum_change_grad is None or sums.window != self.window:
                raise ValueError(f"these sums did not record the change of windowing heads to {self.window}")
            return sums.sum_change_grad / max(tokens, 1)
        replacement = self.replacement(sums.layers, *sums.sum_grad.shape[1:])
        return ((replacement * sums.sum_grad).sum(-1) - sums.sum_output_grad) / max(tokens, 1)

    def curvature(self, sums: OutputSums, tokens: int) -> np.ndarray:
        """(layers, heads): the second-order term of removing each head alone, an empirical-Fisher (Gauss-Newton)
        estimate of 1/2 d^T H d with d = replacement - o: half the sum over positions of (d . g)^2, per predicted
        token. A mean removal's first-order term averages out (the replacement is the output's own mean), so the
        curvature is much of what it costs: on SmolLM2 first order alone ranks single-head costs at Spearman 0.53,
        with this term 0.85 (benchmarks/prune_estimate.py). `sums` must have recorded it for this removal
        (`OutputSums(..., curvature_of=removal)`)."""
        if sums.sum_squared_change is None or sums.curvature_mode != self.mode:
            raise ValueError(f"these sums did not record the curvature of {self.mode} removal")
        return 0.5 * sums.sum_squared_change / max(tokens, 1)

    def fold(self, projection: torch.nn.Module, layer: int, heads: Sequence[int], head_dim: int) -> None:
        """Write the removal of `heads` (of `layer`) into `projection`, the layer's output projection: zero the
        heads' input columns; in mean mode add W_h m_h to the bias (which must exist: surgery adds one)."""
        if self.windowed:
            raise ConfigError("a windowed head cannot be written into the weights (it is a KV-cache policy)")
        weight = linear_weight(projection)  # (out, in), a view of the module's own: zeroing it zeroes the weight
        for head in heads:
            columns = slice(head * head_dim, (head + 1) * head_dim)
            owned = weight[:, columns]  # (out, head_dim)
            if self.mode == "mean":
                constant = torch.as_tensor(self.means[layer, head], dtype=torch.float64, device=weight.device)
                projection.bias += (owned.double() @ constant).to(projection.bias.dtype)
            owned.zero_()


class ReplicaEditor:
    """An OutputEditor for a batch replicated `rows` rows at a time (model.batch.Batch.replicated): at a layer it
    edits, the head outputs are copied once and each edit is handed its replica's rows (a view: what it writes lands
    in the copy). RemovedHeads and patching's PatchedHeads are its edits."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.edits: dict[int, list[tuple[int, Callable[[torch.Tensor], None]]]] = {}  # layer -> [(replica, edit)]

    def add(self, layer: int, replica: int, edit: Callable[[torch.Tensor], None]) -> None:
        """edit(block): change replica `replica`'s (rows, t, heads, head_dim) outputs of `layer` in place."""
        self.edits.setdefault(layer, []).append((replica, edit))

    def start(self, batch: Batch) -> None:
        pass

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        if layer not in self.edits:
            return output
        output = output.clone()
        for replica, edit in self.edits[layer]:
            edit(output[replica * self.rows : (replica + 1) * self.rows])
        return output


class RemovedHeads(ReplicaEditor):
    """Replica r (rows r * rows ... ) has the heads groups[r] removed, the way removals[r] says (one Removal: every
    replica the same way). A capture hands it `masked_output` calls (model.capture.MaskingEditor): at a layer where
    some replica windows heads, the layer's attention is computed once more under each window asked for, and each
    windowed head takes its rows of it."""

    def __init__(self, groups: Sequence[Sequence[Head]], removals: Removal | Sequence[Removal], rows: int) -> None:
        super().__init__(rows)
        removals = [removals] * len(groups) if isinstance(removals, Removal) else list(removals)
        self._windows: dict[int, set[Window]] = {}  # layer -> the windows its windowed heads keep
        for replica, (group, removal) in enumerate(zip(groups, removals, strict=True)):
            for layer, head in group:
                if removal.windowed:
                    self._windows.setdefault(layer, set()).add(removal.window)
                    self.add(layer, replica, functools.partial(self._window, replica, head, removal.window))
                else:
                    self.add(layer, replica, functools.partial(self._remove, layer, head, removal))
        self._values: dict[tuple[int, int, str], torch.Tensor] = {}
        self._windowed: dict[Window, torch.Tensor] = {}  # the layer in flight's output under each window

    def masked_output(self, layer: int, output: torch.Tensor, attend_within: Callable) -> torch.Tensor:
        self._windowed = {window: attend_within(window.sink, window.size) for window in self._windows.get(layer, ())}
        try:
            return self.output(layer, output)
        finally:
            self._windowed = {}

    def _remove(self, layer: int, head: int, removal: Removal, block: torch.Tensor) -> None:
        key = (layer, head, removal.mode)
        if key not in self._values:  # one replacement per head and mode, whichever replicas remove it
            self._values[key] = removal.value(layer, head, block.shape[-1]).to(block.device)
        block[:, :, head, :] = self._values[key].to(block.dtype)

    def _window(self, replica: int, head: int, window: Window, block: torch.Tensor) -> None:
        rows = slice(replica * self.rows, (replica + 1) * self.rows)
        block[:, :, head, :] = self._windowed[window][rows, :, head, :]


class OutputSums:
    """An OutputEditor that leaves outputs unchanged and sums them over every real position of `layers`:
    `means()`, each head's mean output, (layers, heads, head_dim) float64. With `grad` (a gradient pass), it keeps
    the outputs until `collect()`, after the backward pass, adds what `Removal.estimate` needs too: the sums of
    dL/do and of o . dL/do; with `curvature_of` (a Removal) what its `curvature` needs: the sum of ((r - o) . dL/do)^2
    for that removal's replacement r. With `window` (a gradient pass), each head's windowed output w is computed at
    every recorded layer too (the capture's `masked_output`), and the sum of (w - o) . dL/do kept (`sum_change_grad`;
    the curvature's r is then w)."""

    def __init__(
        self, layers: Sequence[int], heads: int, head_dim: int, *, grad: bool = False,
        curvature_of: Removal | None = None, moments: bool = False, window: Window | None = None,
    ) -> None:  # fmt: skip
        """moments: also the sums from which the curvature of any replacement r follows once r is known (the corpus
        mean is known only after the pass): sum of g g^T, of (o . g) g and of (o . g)^2, per head (`curvatures`)."""
        if curvature_of is not None and curvature_of.windowed and curvature_of.window != window:
            raise ValueError("the curvature of a window removal needs the sums of that window")
        self.layers, self.grad, self.window = list(layers), grad, window
        self._index = {layer: index for index, layer in enumerate(self.layers)}
        shape = (len(self.layers), heads, head_dim)
        self.sum_output = np.zeros(shape)  # sum of o over real positions
        self.sum_grad = np.zeros(shape)  # sum of dL/do over real positions (grad only)
        self.sum_output_grad = np.zeros(shape[:2])  # sum of o . dL/do (grad only)
        self.curvature_mode = None if curvature_of is None else curvature_of.mode
        self.sum_squared_change = None if curvature_of is None else np.zeros(shape[:2])  # sum of ((r - o) . dL/do)^2
        self._replacement = None if curvature_of is None or curvature_of.windowed else torch.as_tensor(
            curvature_of.replacement(self.layers, heads, head_dim))  # fmt: skip
        self.sum_change_grad = None if window is None else np.zeros(shape[:2])  # sum of (w - o) . dL/do
        self._windowed: dict[int, torch.Tensor] = {}  # layer -> this batch's windowed outputs (window only)
        self.moments = None
        if moments:  # (sum of g g^T (heads, d, d), sum of (o . g) g (heads, d), sum of (o . g)^2 (heads,)) per layer
            self.moments = (np.zeros((*shape, head_dim)), np.zeros(shape), np.zeros(shape[:2]))
        self.positions = 0  # real positions seen
        self._outputs: dict[int, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None

    def start(self, batch: Batch) -> None:
        self._outputs, self._windowed, self._valid = {}, {}, batch.attention_mask.bool()
        self.positions += int(self._valid.sum())

    def masked_output(self, layer: int, output: torch.Tensor, attend_within: Callable) -> torch.Tensor:
        if self.window is not None and self.grad and layer in self._index:
            # w is where the estimate moves the output to: a point, not a function (the capture computes it once
            # for this layer, shared with an editor windowing its heads, whose copy carries the gradient)
            self._windowed[layer] = attend_within(self.window.sink, self.window.size).detach()
        return self.output(layer, output)

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        if layer not in self._index:
            return output
        if self.grad:
            output.retain_grad()
            self._outputs[layer] = output
        else:
            self.sum_output[self._index[layer]] += self._summed(output)
        return output

    def _summed(self, output: torch.Tensor) -> np.ndarray:
        mask = self._valid[:, :, None, None].to(output.device, torch.float64)  # (batch, t, 1, 1)
        return (output.detach().double() * mask).sum((0, 1)).cpu().numpy()

    def collect(self) -> None:
        """Add this batch's sums of a gradient pass; call after the backward pass of its summed loss."""
        valid = self._valid[:, :, None, None].to(torch.float64)
        for layer, output in self._outputs.items():
            index = self._index[layer]
            grad = output.grad.double()
            mask = valid.to(grad.device)  # a device map puts layers (and their outputs) on several devices
            self.sum_output[index] += self._summed(output)
            self.sum_grad[index] += (grad * mask).sum((0, 1)).cpu().numpy()
            self.sum_output_grad[index] += (output.detach().double() * grad * mask).sum((0, 1, 3)).cpu().numpy()
            if self.sum_change_grad is not None:  # (batch, t, heads, dim): where windowing moves each output
                change = self._windowed[layer].double() - output.detach().double()
                self.sum_change_grad[index] += (change * grad * mask).sum((0, 1, 3)).cpu().numpy()
            elif self.sum_squared_change is not None:
                change = self._replacement[index].to(grad.device) - output.detach().double()
            if self.sum_squared_change is not None:
                squared = (change * grad).sum(-1) ** 2 * mask[..., 0]
                self.sum_squared_change[index] += squared.sum((0, 1)).cpu().numpy()
            if self.moments is not None:
                real = grad * mask  # (batch, t, heads, dim): padding positions give nothing
                dot = (output.detach().double() * real).sum(-1)  # (batch, t, heads): o . g
                self.moments[0][index] += torch.einsum("bthd,bthe->hde", real, real).cpu().numpy()
                self.moments[1][index] += (dot[..., None] * real).sum((0, 1)).cpu().numpy()
                self.moments[2][index] += (dot**2).sum((0, 1)).cpu().numpy()
        self._outputs, self._windowed = {}, {}

    def curvatures(self, removal: Removal, tokens: int) -> np.ndarray:
        """(layers, heads): `Removal.curvature` of `removal` from the moments, for a replacement r known only now:
        sum over positions of ((r - o) . g)^2 = r^T (sum g g^T) r - 2 r . (sum (o . g) g) + sum (o . g)^2."""
        gg, og_g, og2 = self.moments
        r = removal.replacement(self.layers, *self.sum_grad.shape[1:])  # (layers, heads, d)
        squared = np.einsum("lhd,lhde,lhe->lh", r, gg, r) - 2 * (r * og_g).sum(-1) + og2
        return 0.5 * np.clip(squared, 0.0, None) / max(tokens, 1)  # a sum of squares: rounding may dip below 0

    def means(self) -> np.ndarray:
        return self.sum_output / max(self.positions, 1)

    def summed_over(self, add: Callable[[np.ndarray], np.ndarray]) -> OutputSums:
        """These sums added up with every rank's: add(array) is the all-ranks sum of a float64 array."""
        self.sum_output, self.sum_grad = add(self.sum_output), add(self.sum_grad)
        self.sum_output_grad = add(self.sum_output_grad)
        if self.sum_squared_change is not None:
            self.sum_squared_change = add(self.sum_squared_change)
        if self.sum_change_grad is not None:
            self.sum_change_grad = add(self.sum_change_grad)
        if self.moments is not None:
            self.moments = tuple(add(moment) for moment in self.moments)
        self.positions = int(add(np.array([float(self.positions)]))[0])
        return self


@dataclass
class GradientPass:
    """What one forward-and-backward pass over a corpus found: the clean (or already-edited) summed loss, the
    predicted tokens, and the head-output sums of the recorded layers."""

    loss: float
    tokens: int
    sums: OutputSums


def shared_gradient_pass(ranks: Ranks, *args, **kwargs) -> GradientPass:
    """gradient_pass over this rank's share of the corpus, its sums added over every rank (float64 all-reduce)."""
    found = together(ranks, lambda: gradient_pass(*args, **kwargs))
    if not ranks.parallel:
        return found
    add = added(ranks)
    loss, tokens = add(np.array([found.loss, float(found.tokens)]))
    return GradientPass(float(loss), int(tokens), found.sums.summed_over(add))


def gradient_pass(
    capture,
    batches: Callable[[], Iterable[Batch]],
    layers: Sequence[int],
    heads: int,
    head_dim: int,
    *,
    edit: Callable[[Batch], list] = lambda batch: [],
    on_batch: Callable[[Batch], None] = lambda batch: None,
    curvature_of: Removal | None = None,
    moments: bool = False,
    window: Window | None = None,
    prefix: CleanPrefix | None = None,
) -> GradientPass:
    """One forward pass with gradients and one backward pass of the summed loss per batch (the parameters frozen:
    gradients of the head outputs only), recording the heads of `layers`. edit(batch): editors applied first (heads
    already removed, for prune's estimate on the model pruned so far); on_batch: progress; curvature_of: the removal
    whose second-order term the sums record too; moments: the sums that give any replacement's (OutputSums);
    window: the sums of windowing each head (OutputSums); prefix: the clean model's layers below every head edited
    or recorded, run once already (each pass starts after them, and its backward stops there)."""
    sums = OutputSums(layers, heads, head_dim, grad=True, curvature_of=curvature_of, moments=moments, window=window)
    loss, tokens = 0.0, 0
    for batch in batches():
        start_at = {"start_at": prefix.layer, "handed_on": prefix.for_gradients(batch)} if prefix is not None else {}
        output = capture.run(batch, editors=[*edit(batch), sums], grad=True, **start_at)
        with torch.enable_grad():
            losses, counts = token_losses(output.logits, batch)
            losses.sum().backward()
        sums.collect()
        loss += float(losses.detach().sum())
        tokens += int(counts.sum())
        on_batch(batch)
    return GradientPass(loss, tokens, sums)
