"""Which of headscope's kernels computes a capture's attention, and when (TileKernel): the tile loop of
attention.tile_loop op by op or compiled, headscope's C++ kernel (attention.cpu_kernel) or its Triton kernel
(attention.cuda_kernel) for the fused pass, and the C++ kernel for the row statistics of the eager path's
probabilities. Every kernel's first result is checked against the plain computation, and a kernel that cannot be
loaded, raises or disagrees is dropped with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from headscope.model.attention import cpu_kernel
from headscope.model.attention.finish_rows import RowValues, read_off
from headscope.model.attention.key_patterns import PatternRows, fold_reference
from headscope.model.attention.tile_loop import FOLD_STATE, TILE_KEYS, _fold, _fold_tiles, _tile_step

# Logits a capture folds op by op before compiling (see TileKernel): 2^25 is a quarter of SmolLM2's 30 layers on
# one 1,024-token sentence, a fifth of one layer at 8,192 tokens.
COMPILE_FROM = 2**25
# Logits a capture folds before it takes a kernel (C++, Triton): one layer of a 9-head, 1,000-token sentence. Loading
# the built kernel takes 0.07 s; building it (once per machine and source) 45 s, worth it only for long work. The fused
# path itself starts where a layer's (batch, heads, t, t) float32 weights exceed the block budget (32 MiB: 4M
# visible pairs), so by default the kernel takes every fused layer; the tile loop before it measured 0.8 s for
# SmolLM2's first 7 layers at 1,024 tokens where the kernel took 0.37 s for the other 23.
NATIVE_FROM = 2**22
# Probabilities (batch x heads x rows x keys) a capture reduces with torch before it builds the C++ kernel to reduce
# them, when that kernel is not built yet: a build costs about 45 s, what torch's passes over some 2^31 weights cost
# at about 20 ns each (benchmarks/README.md). Past that the build has paid for itself, and stopping there costs never
# more than twice what knowing the corpus in advance would (the ski-rental rule). A kernel built before is loaded
# from the first layer (0.07 s).
WEIGHTS_NATIVE_FROM = 2**31
# The kernel of each device type, as run.json and warnings name it.
KERNEL_NAMES = {"cpu": "C++", "cuda": "Triton"}
# What the kernels read: float32, and half precision read as float32 (float64 stays on the tile loop).
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows on which a kernel's first result is checked against the tile loop.
NATIVE_CHECK_ROWS = 8

_log = logging.getLogger(__name__)


@functools.cache
def _compiled_fold() -> Callable:
    # Static shapes but for the rows (marked dynamic at each call): the loop over a tile's keys is then fixed
    # and fully vectorised, which measured faster than dynamic=True's masked tails. No Python number may vary
    # between calls (each value would be compiled anew): the tile's first key is added outside.
    return torch.compile(_fold, dynamic=False)


def _compiled(scores, hidden, limit, *rest):
    # Rows vary with the batch; keys with the tile (full tiles are TILE_KEYS wide, the rest are few per block).
    for tensor in (scores, hidden, limit, *rest[:8]):
        if tensor is not None:
            torch._dynamo.mark_dynamic(tensor, 0)
    if scores.shape[-1] != TILE_KEYS:
        torch._dynamo.mark_dynamic(scores, 1)
        if hidden is not None:
            torch._dynamo.mark_dynamic(hidden, 1)
    return _compiled_fold()(scores, hidden, limit, *rest)


class TileKernel:
    """Chooses how a capture's fused passes run.

    - Tile steps (`step`) run op by op until `compile_from` logits have gone through this kernel (one per
      capture), compiled from then on (compiling costs about 20 s once per process, a few seconds from torch's
      disk cache, and pays off only on long work), op by op again if compiling fails. The maths is the same
      either way (tested to 1e-6).
    - Past `native_from` logits, float32 and half-precision attention (statistics and output, in float32) comes
      from headscope's C++ kernel on the CPU (headscope.model.attention.cpu_kernel) or its Triton kernel on CUDA
      (headscope.model.attention.cuda_kernel), once it is loaded and its first result agrees with the tile loop on a few
      rows; otherwise from the tile loop.
    """

    def __init__(
        self,
        compile_from: int = COMPILE_FROM,
        native_loader: Callable | None = None,
        native_from: int = NATIVE_FROM,
        triton_loader: Callable | None = None,
        weights_from: int = WEIGHTS_NATIVE_FROM,
        native_built: Callable[[], bool] | None = None,
    ) -> None:
        self.compile_from = compile_from
        self.native_from = native_from
        self.weights_from = weights_from
        self._native_built = native_built or cpu_kernel.is_built
        # device type -> () -> the kernel's module (its `row_state`), or why there is none (one line)
        self.loaders = {
            "cpu": native_loader or cpu_kernel.row_state_module,
            "cuda": triton_loader or cpu_kernel.triton_module,
        }
        self.folded = 0  # logits handed to `step` so far
        self.failed: str | None = None  # why compiling failed, once it has
        self.failed_kernels: dict[str, str] = {}  # device type -> why its kernel is not used, once that is known
        self.native_runs = 0  # passes whose row states a kernel computed: run.json names the path that ran
        self._checked: set[str] = set()  # device types whose kernel's first result was checked
        self._patterns_checked: set[str] = set()  # device types whose kernel's first patterns were checked
        self.weights_seen = 0  # probabilities offered to `weight_rows` so far
        self.weights_failed: str | None = None  # why the C++ kernel does not reduce probabilities, once that is known
        self.weight_runs = 0  # layers whose probabilities the C++ kernel reduced
        self._built: bool | None = None  # was the C++ kernel built before this capture? (asked once)
        self._weights_checked = False  # has the kernel's first reduction of probabilities been checked?
        self.sums_failed: str | None = None  # why the C++ kernel does not sum rows, once that is known
        self.patterns_failed: str | None = None  # why the C++ kernel does not read patterns of probabilities
        self._patterns_read_checked = False  # has its first reading of probabilities been checked?
        self._sums_checked: set[str] = set()  # the kernel's sums whose first result was checked

    def step(self, logits: int) -> Callable:
        """The tile step for a layer of `logits` (batch x heads x visible pairs) logits."""
        self.folded += logits
        if self.folded < self.compile_from or self.failed is not None:
            return _tile_step
        return self._compiled

    def _compiled(self, *args) -> tuple[torch.Tensor, ...]:
        if self.failed is None:
            try:
                return _tile_step(*args, fold=_compiled)
            except Exception as err:  # any compiler failure: the same maths, uncompiled
                self.failed = f"{type(err).__name__}: {err}".splitlines()[0]
                _log.warning("torch.compile of the fused statistics failed (%s); running them op by op", self.failed)
        return _tile_step(*args)

    def row_state(self, query: torch.Tensor, mask: torch.Tensor | None) -> Callable | None:
        """The kernel for a layer's row states and output on its device (the C++ kernel on the CPU, the Triton
        kernel on CUDA), after `step` has counted the layer; None where it does not apply: fewer logits than
        `native_from` so far, not float32, bfloat16 or float16, a mask it does not take (`mask`: what the attention
        function received), another device, or a kernel that could not be loaded or disagreed."""
        device = query.device.type
        if (
            self.folded < self.native_from
            or device not in self.loaders
            or device in self.failed_kernels
            or query.dtype not in NATIVE_DTYPES
            or not cpu_kernel.takes_mask(mask, query.shape[-2])
        ):
            return None
        module = self._loaded(device)
        return None if module is None else functools.partial(self._native, module)

    def _loaded(self, device: str):
        """`device`'s kernel module, or None when it cannot be loaded (why is kept in `failed_kernels`)."""
        module = self.loaders[device]()
        if isinstance(module, str):
            self.failed_kernels[device] = module
            return None
        return module

    def _native(
        self, module, query, key, value, positions, first_key, visibility, softcap, window, *, scaling, out=None,
        patterns=None,
    ) -> tuple | None:  # fmt: skip
        """The kernel's `cpu_kernel.row_state(...)` (the same arguments): (states, what it read of the patterns'
        targets), its first result checked against the tile loop's (and its first targets against
        key_patterns.fold_reference); None where it fails or disagrees (then dropped)."""
        device = query.device.type
        arguments = (query, key, value, positions, first_key, visibility, softcap, window)
        try:
            states, targets = cpu_kernel.row_state(module, *arguments, scaling=scaling, out=out, patterns=patterns)
        except Exception as err:  # a kernel that cannot compile here (Triton) or refuses its inputs: the tile loop
            return self._drop(device, f"failed ({cpu_kernel.one_line(err)})")
        if device in self._checked and (targets is None or device in self._patterns_checked):
            self.native_runs += 1
            return states, targets
        if device in self._checked:  # the first patterns this kernel folds: checked as its first states were
            if not self._same_folds(targets, query, key, positions, first_key, visibility, softcap, scaling, patterns):
                return self._drop(device, "what it read of the exemplars' patterns disagreed with torch's")
            self.native_runs += 1
            return states, targets
        # Its first result against the tile loop, on the last rows (they see the most keys).
        batch, heads, t, head_dim = query.shape
        rows = positions[-NATIVE_CHECK_ROWS:]
        grouped = query.view(batch, key.shape[1], heads // key.shape[1], t, head_dim).index_select(3, rows) * scaling
        expected = _fold_tiles(grouped, key, value, visibility, rows, softcap, _tile_step, TILE_KEYS, first_key)
        # The rows' finished output where the kernel wrote it in `out` (states[8] None): against the tile loop's
        # state read off as fused_attention finishes it (in place: that O is not compared after); else its O
        # against the tile loop's.
        finished = value is not None and states[8] is None
        output_agrees = not finished or torch.allclose(
            out[:, -len(rows) :].transpose(1, 2),
            read_off(grouped, key, value, visibility, rows, expected, softcap, first_key, window)[0],
            rtol=1e-5,
            atol=1e-5,
        )
        # Rows that see some key but the first (padding sees none; a row that sees only the first has no state).
        seen = expected[5] > 0
        got = [None if x is None else x[:, :, -len(rows) :][seen] for x in states]
        expected = [None if x is None else x[seen] for x in expected]
        close = (1, 2, 6, 7) if got[8] is None else (1, 2, 6, 7, 8)  # A, B, mean, spread (and O)
        agrees = output_agrees and all(torch.allclose(got[i], expected[i], rtol=1e-5, atol=1e-5) for i in close)
        agrees = agrees and torch.equal(got[3] > 1, expected[3] > 1) and torch.equal(got[5], expected[5])
        if len(states) > FOLD_STATE:  # key points folded by the kernel: the read-off's values against its picks
            state = [None if x is None else x[:, :, -len(rows) :] for x in states]
            state[8] = None  # the output is checked above
            read = functools.partial(read_off, grouped, key, None, visibility, rows, softcap=softcap, window=window)
            folded = read(state=state, seq_start=first_key)[1]
            picked = read(state=state[:FOLD_STATE], seq_start=first_key)[1]
            agrees = agrees and torch.equal(*torch.broadcast_tensors(folded.band_visible, picked.band_visible))
            agrees = agrees and all(
                torch.allclose(getattr(folded, name), getattr(picked, name), rtol=1e-5, atol=1e-6)
                for name in ("diagonal", "sink", "prev_token")
            )
        self._checked.add(device)
        if not agrees:
            return self._drop(device, "its first result disagreed with the tile loop")
        if targets is not None and not self._same_folds(
            targets, query, key, positions, first_key, visibility, softcap, scaling, patterns
        ):
            return self._drop(device, "what it read of the exemplars' patterns disagreed with torch's")
        self.native_runs += 1
        return states, targets

    def _same_folds(self, folded, query, key, positions, first_key, visibility, softcap, scaling, patterns) -> bool:
        """Does what a kernel folded of the patterns agree with key_patterns.fold_reference on the last rows (they
        see the most keys)? Sums and weights within 1e-5 (float32 exponentials, summed in another order), counts and
        keys exactly, or another key the row weighs as much within that (a near tie)."""
        self._patterns_checked.add(query.device.type)
        batch, heads, t, head_dim = query.shape
        rows = positions[-NATIVE_CHECK_ROWS:]
        grouped = query.view(batch, key.shape[1], heads // key.shape[1], t, head_dim).index_select(3, rows) * scaling
        got = [x[..., -len(rows) :] for x in folded]
        *expected, at_got = fold_reference(grouped, key, visibility, rows, softcap, first_key, patterns, got[3])
        close = all(torch.allclose(got[i], expected[i], rtol=1e-5, atol=1e-6) for i in (0, 2))
        tied = torch.isclose(at_got, expected[2], rtol=1e-5, atol=1e-6) & (got[3] >= 0)
        return close and torch.equal(got[1], expected[1]) and bool(((got[3] == expected[3]) | tied).all())

    def weight_rows(self, weights: torch.Tensor, visible: torch.Tensor, seq_start: torch.Tensor) -> Callable | None:
        """The C++ kernel for the per-row values of a layer's probabilities ((batch, heads, rows, keys), the model's
        eager ones; visible: (batch or 1, 1 or heads, rows, keys) bool; seq_start: (batch,) long), as
        `(window, row_offset, reference) -> RowValues`, `reference` computing the same with torch
        (headscope.measures.row_sums.weight_row_values): it is run on the kernel's first call to check it, and its
        values are used whenever the kernel fails. None where the kernel does not apply: not on the CPU, not
        float32, bfloat16 or float16, a kernel that could not be loaded or disagreed, or one not built yet while the
        probabilities reduced so far (this layer's included) are fewer than `weights_from`."""
        self.weights_seen += weights.numel()
        if (
            weights.device.type != "cpu"
            or weights.dtype not in NATIVE_DTYPES
            or self.weights_failed is not None
            or "cpu" in self.failed_kernels
        ):
            return None
        if self.weights_seen < self.weights_from:
            if self._built is None:
                self._built = self._native_built()
            if not self._built:
                return None
        module = self._loaded("cpu")
        return None if module is None else functools.partial(self._weight_rows, module, weights, visible, seq_start)

    def _weight_rows(self, module, weights, visible, seq_start, window, row_offset, reference) -> RowValues:
        try:
            values = cpu_kernel.weight_rows(module, weights, visible, seq_start, window, row_offset)
        except Exception as err:  # a kernel built from an older source, or refusing its inputs: torch's passes
            return self._drop_weights(f"failed ({cpu_kernel.one_line(err)})", reference())
        if not self._weights_checked:
            self._weights_checked = True
            expected = reference()
            if not _same_rows(values, expected):
                return self._drop_weights("its first result disagreed with torch's", expected)
        self.weight_runs += 1
        return values

    def pattern_rows(self, weights: torch.Tensor, visible: torch.Tensor) -> Callable | None:
        """The C++ kernel for the patterns' readings of a layer's probabilities (the eager path; where `weight_rows`
        offered the kernel for their statistics), as `(patterns, row_offset, reference) -> PatternRows`, `reference`
        computing the same with torch (key_patterns.read_probabilities): run on the kernel's first call to check it,
        and whenever the kernel fails. None where the kernel does not serve."""
        if self.patterns_failed is not None or self.weights_failed is not None or "cpu" in self.failed_kernels:
            return None
        module = self._loaded("cpu")
        if module is None or not hasattr(module, "pattern_rows"):
            return None
        return functools.partial(self._pattern_rows, module, weights, visible)

    def _pattern_rows(self, module, weights, visible, patterns, row_offset, reference) -> PatternRows:
        try:
            rows = cpu_kernel.pattern_rows(module, weights, visible, patterns, row_offset)
        except Exception as err:  # a kernel built from an older source, or refusing its inputs: torch's readings
            return self._drop_patterns(f"failed ({cpu_kernel.one_line(err)})", reference())
        if not self._patterns_read_checked:
            self._patterns_read_checked = True
            expected = reference()
            if not _same_readings(rows, expected):
                return self._drop_patterns("its first readings disagreed with torch's", expected)
        return rows

    def _drop_patterns(self, why: str, rows: PatternRows) -> PatternRows:
        """Stop reading patterns with the C++ kernel, with a warning; `rows` (torch's) stand for this layer."""
        self.patterns_failed = why
        _log.warning("headscope's C++ kernel no longer reads the exemplars' patterns (%s): torch does, for this "
                     "layer and the rest", why)  # fmt: skip
        return rows

    def sums(self, which: str) -> Callable | None:
        """One of the C++ kernel's sums over rows (`which`: "row_sums", a block's per-row values, or "write_sums",
        what a layer's heads write; headscope.model.attention.cpu_kernel), as `(*inputs, reference=..., **settings)
        -> sums` (float64), `reference` computing the same with torch: it runs on each kind's first call to check
        the kernel, and whenever the kernel fails. On short rows torch's dozens of operations a layer cost more than
        their arithmetic (benchmarks/README.md). Asked where the kernel reduces a layer's probabilities
        (`weight_rows` offered it), so that each layer is summed one way whichever layer came first; None where the
        kernel does not serve."""
        if self.weights_failed is not None or self.sums_failed is not None or "cpu" in self.failed_kernels:
            return None
        module = self._loaded("cpu")
        return None if module is None else functools.partial(self._sums, module, getattr(cpu_kernel, which))

    def _sums(self, module, summed: Callable, *inputs, reference: Callable, **settings) -> torch.Tensor:
        try:
            sums = summed(module, *inputs, **settings)
        except Exception as err:  # a kernel built from an older source, or refusing its inputs: torch's sums
            return self._drop_sums(f"failed ({cpu_kernel.one_line(err)})", reference())
        if summed.__name__ not in self._sums_checked:
            self._sums_checked.add(summed.__name__)
            expected = reference()
            if not _same_sums(sums, expected):
                return self._drop_sums(f"its first {summed.__name__} disagreed with torch's", expected)
        return sums

    def _drop_sums(self, why: str, sums: torch.Tensor) -> torch.Tensor:
        """Stop summing rows with the C++ kernel, with a warning; `sums` (torch's) stand for this call."""
        self.sums_failed = why
        _log.warning("headscope's C++ kernel no longer sums attention rows (%s): torch does, for this layer and the "
                     "rest", why)  # fmt: skip
        return sums

    def _drop_weights(self, why: str, values: RowValues) -> RowValues:
        """Stop reducing probabilities with the C++ kernel, with a warning; `values` (torch's) stand for this layer."""
        self.weights_failed = why
        _log.warning("headscope's C++ kernel no longer reduces attention probabilities (%s): torch does, for this "
                     "layer and the rest", why)  # fmt: skip
        return values

    def _drop(self, device: str, why: str) -> None:
        """Stop using `device`'s kernel, with a warning: the tile loop computes this pass and the next ones."""
        self.failed_kernels[device] = why
        _log.warning("headscope's %s attention kernel is dropped (%s): the tile loop computes this layer and the "
                     "rest", KERNEL_NAMES[device], why)  # fmt: skip


def _same_sums(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Do two blocks' row sums agree, within 1e-6 relative? Every value summed is >= 0, and the kernel and torch
    differ only where they round a row's float32 division or logarithm apart (an ulp, 1.2e-7 of the value), so each
    sum may differ by that much of itself, plus float64 summation order; counts are whole numbers either way."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    return bool(torch.allclose(got, expected, rtol=1e-6, atol=1e-9, equal_nan=True))


def _same_rows(got: RowValues, expected: RowValues) -> bool:
    """Do two rows' values agree (floats within 1e-5 relative, counts and keys exactly) wherever a row counts: a real
    row (finite entropy) with some mass off the sink (a row seeing only the first key has no top key off it)?"""
    counted = torch.isfinite(expected.entropy) & (expected.rest_mass > 0)
    if got.columns().keys() != expected.columns().keys():
        return False
    for name, want in expected.columns().items():
        have, want, where = torch.broadcast_tensors(got.columns()[name], want, counted)
        have, want = have[where], want[where]
        if want.is_floating_point():
            if not torch.allclose(have.double(), want.double(), rtol=1e-5, atol=1e-6):
                return False
        elif not torch.equal(have, want):
            return False
    return True


def _same_readings(got: PatternRows, expected: PatternRows) -> bool:
    """Do two readings of the same probabilities agree: sums within 1e-6 relative (float64 sums of the same float32
    weights in another order), weights exactly (the same numbers picked), counts and keys exactly?"""
    return (
        torch.allclose(got.match, expected.match, rtol=1e-6, atol=1e-9)
        and torch.equal(got.targets, expected.targets)
        and torch.equal(got.key, expected.key)
        and torch.equal(got.weight.float(), expected.weight.float())
    )
