"""The one way headscope touches a model: read every layer's attention, read or replace every head's output,
run only the layers after one, keep each layer's output, and leave the model as it was found.

How: an attention function named ``headscope`` is registered with transformers' attention interface (and a
mask function with the mask interface: FINDINGS pitfall 1, without one transformers builds no causal or
padding mask at all). `attached(model)` switches the model to it for the length of a block and routes each
attention module's calls to that block's `Capture`, which knows the module's layer from its place in the
model's list of decoder layers (not from counting calls). For each pass (`Capture.run`) the capture computes
every layer's output (see attention.readout), hands the attention probabilities to the measures that read the
layer, lets editors replace the heads' outputs, and stops the forward pass after the last layer anything
reads. Nothing holds more than one layer's attention (or one block of it) at a time.

On leaving the block the model is as it was: attention implementation, training mode, every parameter's
requires_grad, hooks and decoder layers.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from headscope.config import BLOCK_BYTES
from headscope.errors import ConfigError, ModelLoadError, ResourceError
from headscope.model.architecture import architecture_of
from headscope.model.attention.dispatch import TileKernel
from headscope.model.attention.readout import Readout, RowBlock
from headscope.model.batch import Batch
from headscope.model.layer_outputs import detached
from headscope.model.layers import LayerMap, describe_layers
from headscope.model.masks import boolean_mask, key_visibility, streaming_keys
from headscope.model.precision import ieee_float32
from headscope.model.turns import one_call_at_a_time
from headscope.model.write_path import WritePath, write_paths

ATTENTION_NAME = "headscope"


class Measure(Protocol):
    """A measurement riding on a forward pass. For every batch the capture calls `start`, then `attention`
    once or more (one call per block of rows) for every layer `wants` says yes to; then the caller collects
    what the measure kept (each measure has its own `finish`)."""

    def start(self, batch: Batch) -> None:
        """A batch is about to run."""

    def wants(self, layer: int) -> bool:
        """Does this measure read `layer`'s attention?"""

    def last_layer(self) -> int | None:
        """The last layer it reads (the forward pass may stop after the last one any measure reads); None: all."""

    def attention(self, layer: int, block: RowBlock) -> None:
        """Read one block of `layer`'s attention (never modify it; it is dropped after the call)."""


@dataclass(frozen=True)
class LayerOutput:
    """What a layer's attention wrote: for the measures that read heads' outputs (`OutputMeasure`)."""

    attention: torch.nn.Module  # the layer's attention module (its output projection inside)
    output: torch.Tensor  # (batch, t, heads, head_dim): every head's output, before the output projection
    value: torch.Tensor  # (batch, kv_heads, t, head_dim): the values the heads weighed
    mask: torch.Tensor | None  # as the attention function received it (see headscope.model.masks)
    residual_norm: torch.Tensor  # (batch, t) float32: the norm of the residual stream entering the layer
    query_valid: torch.Tensor  # (batch, t) bool
    seq_start: torch.Tensor  # (batch,) long
    path: WritePath  # how the attention's output reaches the residual stream (post-attention norm, scale)
    # headscope's C++ kernel summing what the heads write (TileKernel.sums("write_sums")), or None: torch's ops
    native_sums: Callable | None = None


@runtime_checkable
class OutputMeasure(Protocol):
    """A Measure that also reads what each layer it wants wrote (after its `attention` calls for that layer)."""

    def head_output(self, layer: int, written: LayerOutput) -> None:
        """Read `layer`'s heads' outputs (the model's own, before any editor replaces them)."""


class OutputEditor(Protocol):
    """Reads, and may replace, the heads' outputs of a layer: what the attention function returns for every
    query head before the output projection mixes them, (batch, t, heads, head_dim)."""

    def start(self, batch: Batch) -> None:
        """A batch is about to run."""

    def output(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """`layer`'s head outputs; return them, or a replacement of the same shape."""


@runtime_checkable
class MaskingEditor(Protocol):
    """An OutputEditor that can also have heads attend under a narrower mask (window removal: streaming heads)."""

    def start(self, batch: Batch) -> None:
        """A batch is about to run."""

    def masked_output(
        self, layer: int, output: torch.Tensor, attend_within: Callable[[int, int], torch.Tensor]
    ) -> torch.Tensor:
        """`layer`'s head outputs; return them or a replacement. attend_within(sink, size) is the layer's attention
        computed again, every head and row renormalised over the keys both the model's mask and a streaming cache
        keep (each sentence's first `sink` keys and the last `size`: masks.streaming_keys): (batch, t, heads,
        head_dim), from the same queries, keys and values, differentiable in a gradient pass; computed once per
        layer and window, whichever editors ask for it."""


class _StopForward(Exception):
    """Raised after the last layer a pass reads: later layers cannot change what it measures."""


# attention module -> (the capture it reports to, its layer), while a model is attached.
_ROUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (`layers` for Llama, `h` for GPT-2, ...): the largest list of modules
    as long as the model is deep."""
    depth = architecture_of(model.config)["layers"]
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    if not lists:
        raise ModelLoadError(f"{type(model).__name__} has no list of its {depth} decoder layers")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


class _HandOn(torch.nn.Module):
    """Stands in for a decoder layer that is skipped: returns what the layer returned on the clean pass."""

    def __init__(self, output) -> None:
        super().__init__()
        self.handed_on = output

    def forward(self, *args, **kwargs):
        return self.handed_on


class Capture:
    """The state of one `attached` block: the model's decoder layers, the pass in flight, and the readout
    (which checks each eager function on its first call, for this block alone)."""

    def __init__(self, model: torch.nn.Module, block_bytes: int, kernel: TileKernel | None = None) -> None:
        self.model = model
        self.decoder = decoder_layers(model)
        self.readout = Readout(block_bytes, kernel)
        parameters = inspect.signature(model.forward).parameters
        self._positions = "position_ids" in parameters
        # Can the LM head score some positions alone? `logits_to_keep`: the last k of every row; where the model slices
        # with transformers' `slice_logits_to_keep`, also one position per row ((rows, 1) positions).
        self.keeps_logits = "logits_to_keep" in parameters
        self.keeps_rows = self.keeps_logits and "slice_logits_to_keep" in _source(type(model).forward)
        self._measures: Sequence[Measure] = ()
        self._editors: Sequence[OutputEditor] = ()
        self._stop_after: int | None = None
        self._placed: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._residual_norms: dict[int, torch.Tensor] = {}  # layer -> (batch, t), for the OutputMeasures
        self.write_paths: list[WritePath] = []  # layer -> its WritePath, learned by the first pass that reads writes
        self._layer_map: LayerMap | None = None  # the layers' description (model/layers.py), found when first asked

    @property
    def paths(self) -> dict[str, str]:
        """attention class -> how its probabilities were read (for run.json)."""
        return self.readout.paths

    def run(
        self,
        batch: Batch,
        *,
        measures: Sequence[Measure] = (),
        editors: Sequence[OutputEditor] = (),
        grad: bool = False,
        start_at: int = 0,
        handed_on=None,
        logits_to_keep: int | torch.Tensor = 0,
    ):
        """One forward pass of `batch`; the measures keep what they read. Returns the model's output, or None
        when the pass stopped after the last layer a measure reads (it runs to the end with editors or `grad`).

        grad: build the autograd graph from the embeddings' output (the parameters stay frozen) for a backward
        pass through the editors' outputs; otherwise inference mode.
        start_at, handed_on: run only the decoder layers from `start_at`, the ones before it returning
        `handed_on` (what layer start_at - 1 returned on a clean pass of the same batch).
        logits_to_keep: the LM head scores only the last this many positions (0: all), or (with `keeps_rows`) the
        positions of a (rows, 1) tensor, where the model takes it (`scored_logits` reads the result either way).
        """
        lasts = [measure.last_layer() for measure in measures]
        whole = grad or editors or not lasts or None in lasts
        reads_writes = any(isinstance(measure, OutputMeasure) for measure in measures)
        if reads_writes:
            self._learn_write_paths(len(self.decoder) if None in lasts else max(lasts) + 1, batch.input_ids.device)
        self._measures, self._editors, self._stop_after = measures, editors, None if whole else max(lasts)
        self._start(batch)
        kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
        if self._positions:  # explicit positions, so that left padding is harmless
            kwargs["position_ids"] = batch.position_ids
        if self.keeps_logits and (isinstance(logits_to_keep, torch.Tensor) or logits_to_keep):
            kwargs["logits_to_keep"] = logits_to_keep
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.enable_grad() if grad else torch.inference_mode())
                if grad:
                    embeddings = self.model.get_input_embeddings()
                    hook = embeddings.register_forward_hook(lambda module, args, output: output.requires_grad_())
                    stack.callback(hook.remove)
                if start_at > 0:
                    stack.enter_context(self._skipping(start_at, handed_on))
                if reads_writes:
                    stack.enter_context(self._reading_residual())
                return self.model(**kwargs)
        except _StopForward:
            return None
        except (torch.OutOfMemoryError, MemoryError) as err:
            raise _out_of_memory(batch) from err
        except RuntimeError as err:
            if "can't allocate memory" not in str(err):  # the CPU allocator's own wording
                raise
            raise _out_of_memory(batch) from err
        finally:
            self._measures, self._editors = (), ()
            self._residual_norms = {}

    def layer_map(self, device: torch.device, through: int | None = None) -> LayerMap:
        """The description of decoder layers 0 .. through - 1 (default: every layer, and the final norm), found once
        by a pass over a few fixed tokens (model/layers.py) and kept: a later question is answered from it, unless it
        asks for layers the first pass stopped before. device: where the pass's ids go (the batches')."""
        known = self._layer_map
        whole = through is None or through >= len(self.decoder)
        if known is None or (whole and not known.whole) or len(known.layers) < (through or 0):
            architecture = architecture_of(self.model.config)

            def run(ids: torch.Tensor) -> None:
                self.run(Batch.unpadded(ids.to(device)))

            shape = {key: architecture[key] for key in ("heads", "kv_heads", "head_dim")}
            kept = None if whole else through
            self._layer_map = describe_layers(self.model, self.decoder, run, **shape, through=kept)
        return self._layer_map

    def _learn_write_paths(self, through: int, device: torch.device) -> None:
        """How layers 0 .. through - 1 write into the residual stream (headscope.model.write_path), from their
        description, once."""
        if len(self.write_paths) < through:
            self.write_paths = write_paths(self.layer_map(device, through), device)

    @contextlib.contextmanager
    def _reading_residual(self) -> Iterator[None]:
        """Keep the norm of the residual stream entering each decoder layer, per token (one number a row)."""

        def reader(index: int):
            def read(module, args, kwargs):
                hidden = args[0] if args else kwargs["hidden_states"]
                self._residual_norms[index] = torch.linalg.vector_norm(hidden.float(), dim=-1)

            return read

        hooks = [layer.register_forward_pre_hook(reader(i), with_kwargs=True) for i, layer in enumerate(self.decoder)]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def run_keeping_layers(
        self, batch: Batch, editors: Sequence[OutputEditor] = (), measures: Sequence[Measure] = (),
        through: int | None = None, **options,
    ) -> tuple[object, list]:  # fmt: skip
        """A pass (clean, or edited by `editors`; read by `measures`) that also keeps every decoder layer's output
        (detached): (model output, outputs). through: stop once the layers before it have run (a pass that only
        hands their outputs on; the model output is then None). options: as `run` takes them (logits_to_keep)."""
        outputs: list = [None] * len(self.decoder)

        def keeper(index: int):
            def keep(module, args, output):
                outputs[index] = detached(output)
                if through is not None and index == through - 1:
                    raise _StopForward

            return keep

        hooks = [layer.register_forward_hook(keeper(i)) for i, layer in enumerate(self.decoder)]
        try:
            # the measures read every layer (last_layer None), or the pass would stop before keeping them all
            assert all(measure.last_layer() is None for measure in measures)
            return self.run(batch, editors=editors, measures=measures, **options), outputs
        finally:
            for hook in hooks:
                hook.remove()

    @contextlib.contextmanager
    def _skipping(self, start_at: int, handed_on) -> Iterator[None]:
        originals = [self.decoder[i] for i in range(start_at)]
        try:
            for i in range(start_at):
                self.decoder[i] = _HandOn(handed_on)
            yield
        finally:
            for i, layer in enumerate(originals):
                self.decoder[i] = layer

    def _start(self, batch: Batch) -> None:
        query_valid, seq_start = batch.attention_mask.bool(), batch.seq_start
        self._placed = {query_valid.device: (query_valid, seq_start)}
        for consumer in (*self._measures, *self._editors):
            consumer.start(batch)

    def attend(self, layer: int, module, query, key, value, mask, **kwargs) -> tuple[torch.Tensor, None]:
        """The attention function of `layer`: its output, with its attention handed to the measures.

        query: (batch, heads, t, head_dim); key, value: (batch, kv_heads, t, head_dim); mask: what
        `boolean_mask` built, (batch or 1, 1, t, t) bool, or None for causal attention without padding.
        """
        if query.device not in self._placed:  # a device map: this layer lives elsewhere; small copies
            valid, start = next(iter(self._placed.values()))
            self._placed[query.device] = (valid.to(query.device), start.to(query.device))
        self.readout.query_valid, self.readout.seq_start = self._placed[query.device]
        readers = [measure for measure in self._measures if measure.wants(layer)]
        if readers:
            output = self.readout.read(readers, layer, module, query, key, value, mask, kwargs)
        else:
            output = self.readout.unread(module, query, key, value, mask, kwargs)
        for reader in readers:
            if isinstance(reader, OutputMeasure):
                valid, start = self._placed[query.device]
                residual, path = self._residual_norms[layer], self.write_paths[layer]
                # where the C++ kernel reduced the layer's probabilities (so on the CPU), it sums what they wrote
                native = self.readout.kernel.sums("write_sums") if self.readout.kernel_reduced else None
                written = LayerOutput(module, output, value, mask, residual, valid, start, path, native)
                reader.head_output(layer, written)
        within = None
        for editor in self._editors:
            if isinstance(editor, MaskingEditor):
                within = within or self._attending_within(module, query, key, value, mask, kwargs)
                output = editor.masked_output(layer, output, within)
            else:
                output = editor.output(layer, output)
        if self._stop_after is not None and layer >= self._stop_after:
            raise _StopForward
        return output, None

    def _attending_within(self, module, query, key, value, mask, kwargs) -> Callable[[int, int], torch.Tensor]:
        """This layer call's attend_within (MaskingEditor): the layer's output with every row's keys cut to what a
        streaming cache keeps of the model's own mask, computed afresh (never the probabilities masked after the
        fact) by the fastest correct function for the layer, once per window: a pass whose editors window heads
        and record the estimate (prune's gradient pass) shares it."""
        computed: dict[tuple[int, int], torch.Tensor] = {}

        def attend_within(sink: int, size: int) -> torch.Tensor:
            if (sink, size) not in computed:
                seq_start = self._placed[query.device][1]
                keep = streaming_keys(seq_start, key.shape[-2], sink, size)
                visible = key_visibility(mask, self.readout.query_valid, slice(None), key.shape[-2]) & keep
                computed[(sink, size)] = self.readout.unread(module, query, key, value, visible, kwargs)
            return computed[(sink, size)]

        return attend_within


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The function registered with transformers: the call goes to the capture of the module's model."""
    route = _ROUTES.get(module)
    if route is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention ran outside headscope.model.capture.attached()")
    capture, layer = route
    return capture.attend(layer, module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, boolean_mask)


@contextlib.contextmanager
def attached(
    model: torch.nn.Module, *, block_bytes: int = BLOCK_BYTES, kernel: TileKernel | None = None
) -> Iterator[Capture]:
    """Make `model` readable and editable (`Capture.run`) for the length of the block; put it back after.
    kernel: which kernels compute and reduce the attention (headscope.model.attention.dispatch.TileKernel; default: a
    fresh one)."""
    if not type(model)._can_set_attn_implementation():
        raise ModelLoadError(
            f"{type(model).__name__} does not route attention through transformers' attention interface; "
            "headscope cannot capture its attention"
        )
    # the LM and its base model share their decoder layers: one lock for both
    with one_call_at_a_time(decoder_layers(model)), ieee_float32(), _attached(model, block_bytes, kernel) as capture:
        yield capture


@contextlib.contextmanager
def _attached(model: torch.nn.Module, block_bytes: int, kernel: TileKernel | None) -> Iterator[Capture]:
    capture = Capture(model, block_bytes, kernel)
    routes = {}
    for index, layer in enumerate(capture.decoder):
        for module in layer.modules():
            if module in routes:
                raise ModelLoadError(f"{type(model).__name__} shares a module between decoder layers")
            routes[module] = (capture, index)
    if any(module in _ROUTES for module in routes):
        raise ConfigError("this model is already in use by a headscope call (attached() does not nest)")
    previous = model.config._attn_implementation
    training = [(module, module.training) for module in model.modules()]
    requires_grad = [(parameter, parameter.requires_grad) for parameter in model.parameters()]
    _ROUTES.update(routes)
    try:
        model.set_attn_implementation(ATTENTION_NAME)
        model.eval()  # no dropout: attention as the model computes it at inference
        for parameter, _ in requires_grad:
            parameter.requires_grad_(False)  # gradient passes want gradients of head outputs only
        yield capture
    finally:
        for module in routes:
            _ROUTES.pop(module, None)
        model.set_attn_implementation(previous)
        for module, mode in training:
            module.training = mode
        for parameter, wanted in requires_grad:
            parameter.requires_grad_(wanted)


def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):  # no source (a compiled or dynamically made model): assume the plain slice
        return ""


def _out_of_memory(batch: Batch) -> ResourceError:
    sentences, tokens = batch.input_ids.shape
    return ResourceError(
        f"out of memory on a batch of {sentences} sentences x {tokens} tokens; "
        "lower --max-memory or --batch-size, or cut sentences with --max-length"
    )
