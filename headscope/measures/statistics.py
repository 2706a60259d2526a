"""The corpus statistics measure: rides on the capture (headscope.model.capture.Measure and OutputMeasure) and
reduces every layer's attention rows (headscope.measures.row_sums) and what its heads wrote
(headscope.measures.writes) to per-(sentence, head) sums, one slot per entry of ``headscope.columns.STATS``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from headscope.columns import STATS
from headscope.errors import ModelLoadError
from headscope.measures.exemplars import SHARP, WRITE, TopRows, evidence_rows
from headscope.measures.row_sums import head_row_sums_from_logits, head_row_sums_from_values, weight_row_values
from headscope.measures.rows import without_first
from headscope.measures.writes import OUTPUT_INDEX, head_write_sums, sink_value_ratios, write_norms
from headscope.model.attention.finish_rows import RowValues
from headscope.model.batch import Batch
from headscope.model.capture import LayerOutput
from headscope.model.masks import key_visibility
from headscope.model.projection import head_grams
from headscope.model.write_path import share_scale

# Rows (batch x heads x rows) whose values wait to be summed together: summing them is some hundred small tensor
# operations whatever their number (1.6 ms a layer of a 128-token text, more than the C++ kernel takes to compute
# them), so a batch's layers are summed a few at a time: at most this many rows' values (some 70 bytes a row, 2 MiB
# in all) wait, so that memory does not grow with depth (29 layers of a 9-head 128-token text at once, 4 at 1,024).
WAITING_ROWS = 2**15
# Rows of a masked layer up to which headscope's C++ kernel sums what the heads write (`head_output`).
NATIVE_MASKED_ROWS = 512


class AttentionStatistics:
    """Per-(sentence, head) sums of every row statistic in ``STATS``, for the layers asked for.

    A Measure: after each batch, `finish` returns (wanted layers, batch, heads, stats) sums, left on the device
    of the batch (nothing synchronises per layer or per batch; the caller moves many batches' sums at once).
    """

    def __init__(
        self,
        *,
        window: int,
        sink_threshold: float,
        accum_dtype: torch.dtype,
        layers: Sequence[int] | None = None,
        exemplars: TopRows | None = None,
    ) -> None:
        self.window = window
        # where each row's sharpness and write norm go to find the heads' exemplars (None: nowhere)
        self.exemplars = exemplars
        self._top_keys: dict[int, list] = {}  # layer -> [(first row, top key, its weight, rows counted)] of sharp
        self.sink_threshold = sink_threshold
        self.accum_dtype = accum_dtype
        self.layers = sorted(set(layers)) if layers is not None else None
        self._batch: Batch | None = None
        self._first_at_zero = True  # every sentence of the batch starts at position 0 (right padding)
        self._sums: dict[int, torch.Tensor] = {}  # layer -> (batch, heads, stats), summed over its blocks
        # (row_offset, rows, mass_tolerance, device, has a mass) -> [(layer, values, query_valid, seq_start)]: rows'
        # values waiting to be summed together (WAITING_ROWS)
        self._waiting: dict[tuple, list] = {}
        self._waiting_rows = 0
        self._grams: dict[int, torch.Tensor] = {}  # layer -> W_h^T W_h of its output projection, per head

    @classmethod
    def from_plan(cls, plan, exemplars: TopRows | None = None) -> AttentionStatistics:
        """The statistics a run's plan asks for: its window, sink threshold, accumulation dtype and layers."""
        settings = plan.settings
        return cls(
            window=settings.window,
            sink_threshold=settings.sink_threshold,
            accum_dtype=plan.accumulate,
            layers=plan.layers,
            exemplars=exemplars,
        )

    def start(self, batch: Batch) -> None:
        self._batch = batch
        self._first_at_zero = bool((batch.seq_start == 0).all())  # once a batch, not once a block
        self._sums = {}
        self._waiting, self._waiting_rows = {}, 0
        self._top_keys = {}

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def last_layer(self) -> int | None:
        return None if self.layers is None else self.layers[-1]

    def attention(self, layer, block) -> None:
        rows = {
            "key_visible": block.visible,
            "seq_start": block.seq_start,
            "window": self.window,
            "row_offset": block.first_row,
            "first_at_zero": self._first_at_zero,
        }
        if block.logits is not None:
            if self.exemplars is not None:
                probs = block.probabilities()
                rest, shift = without_first(probs, block.seq_start, None)
                self._offer_sharp(layer, block, rest.argmax(-1) + shift, rest.amax(-1).float())
            sums = head_row_sums_from_logits(
                block.logits,
                query_valid=block.query_valid,
                accum_dtype=self.accum_dtype,
                sink_threshold=self.sink_threshold,
                **rows,
            )
            self._add(layer, sums)
            return
        by_torch = functools.partial(weight_row_values, block.weights, **rows)
        # headscope's C++ kernel where the capture offers it (checked against torch on its first call), else torch.
        values = by_torch() if block.native_rows is None else block.native_rows(self.window, block.first_row, by_torch)
        if self.exemplars is not None:
            top = values.rest_top_key
            self._offer_sharp(layer, block, top, block.weights.gather(-1, top[..., None]).squeeze(-1).float())
        # float32 rows sum to 1 within ~1e-6; half-precision probabilities are rounded to ~3 digits.
        tolerance = 1e-3 if block.weights.dtype == torch.float32 else 2e-2
        if block.native_sums is None:
            self._wait(layer, values, block.query_valid, block.seq_start, block.first_row, tolerance)
            return
        # The kernel sums a block in one pass: nothing to gain by waiting for other layers' rows.
        sums = head_row_sums_from_values(
            values,
            query_valid=block.query_valid,
            seq_start=block.seq_start,
            row_offset=block.first_row,
            accum_dtype=self.accum_dtype,
            mass_tolerance=tolerance,
            sink_threshold=self.sink_threshold,
            kernel=block.native_sums,
        )
        self._add(layer, sums)

    def row_values(self, layer: int, values: RowValues, query_valid: torch.Tensor, seq_start: torch.Tensor) -> None:
        """A whole layer's per-row values from the fused pass (attention.tile_loop), computed with our `window`."""
        if self.exemplars is not None:
            rows = _Rows(0, query_valid, seq_start)
            self._offer_sharp(layer, rows, values.rest_top_key, values.rest_max_weight)
        self._wait(layer, values, query_valid, seq_start, 0, 1.0)

    def _offer_sharp(self, layer: int, block, top_key: torch.Tensor, weight: torch.Tensor) -> None:
        """A block's rows for the exemplars of kind sharp: their largest weight off the first token (rows that see
        no other key do not count) and that key, which the write kind names too. Both kinds are offered together
        once the layer's write norms come (`_offer_write`): one merge per layer, not two."""
        evidence = evidence_rows(block.first_row, weight.shape[-1], block.seq_start)
        counted = (block.query_valid & evidence)[:, None, :] & (weight > 0)
        self._top_keys.setdefault(layer, []).append((block.first_row, top_key, weight, counted))

    def _offer_write(self, layer: int, norms: torch.Tensor, written: LayerOutput) -> None:
        """The layer's rows to the exemplars of kinds sharp (kept by `_offer_sharp`) and write: every row's write
        norm, with the row's top key off the first token (none, -1, for a row that sees no other key)."""
        blocks = sorted(self._top_keys.pop(layer, []), key=lambda block: block[0])
        if not blocks:  # the layer's attention was not offered (cannot happen in a capture); no key to name
            return
        top, weight, sharp = (torch.cat([block[i] for block in blocks], dim=-1) for i in (1, 2, 3))
        named = torch.where(weight > 0, top, written.seq_start[:, None, None] - 1)
        counted = (written.query_valid & evidence_rows(0, norms.shape[-1], written.seq_start))[:, None, :]
        shape = norms.shape
        scores = torch.stack([weight.double().expand(shape), norms.double()])
        rows = torch.stack([sharp.expand(shape), counted.expand(shape)])
        keys = torch.stack([top.expand(shape), named.expand(shape)])
        self.exemplars.offer(layer, [SHARP, WRITE], scores, rows, keys, weight.expand(shape)[None],
                             sentence_ids=self._batch.sentence_ids, seq_start=written.seq_start)  # fmt: skip

    def _wait(self, layer, values: RowValues, query_valid, seq_start, row_offset: int, tolerance: float) -> None:
        """Keep a block's rows' values to be summed with other layers' (`_sum_waiting`)."""
        key = (row_offset, values.entropy.shape[-1], tolerance, values.entropy.device, values.mass is None)
        self._waiting.setdefault(key, []).append((layer, values, query_valid, seq_start))
        self._waiting_rows += values.entropy.numel()
        if self._waiting_rows >= WAITING_ROWS:
            self._sum_waiting()

    def _sum_waiting(self) -> None:
        """Sum the waiting rows' values, the layers of each kind at once, their heads side by side."""
        for (row_offset, _, tolerance, _, _), waiting in self._waiting.items():
            layers, values, query_valid, seq_start = zip(*waiting, strict=True)
            sums = head_row_sums_from_values(
                heads_side_by_side(values),
                query_valid=query_valid[0],  # the same rows of the same batch, every layer
                seq_start=seq_start[0],
                row_offset=row_offset,
                accum_dtype=self.accum_dtype,
                mass_tolerance=tolerance,
                sink_threshold=self.sink_threshold,
            )
            heads = [layer_values.entropy.shape[1] for layer_values in values]
            for layer, layer_sums in zip(layers, sums.split(heads, dim=1), strict=True):
                self._add(layer, layer_sums)
        self._waiting, self._waiting_rows = {}, 0

    def head_output(self, layer: int, written: LayerOutput) -> None:
        """What the layer's heads wrote (headscope.measures.writes): the OUTPUT_SLOTS of its sums."""
        _, t, heads, head_dim = written.output.shape
        path = written.path
        if layer not in self._grams:  # the weights do not change within a run
            self._grams[layer] = head_grams(written.attention, heads, head_dim, path.gain)
        # what reaches the residual stream: ||g * (W_h z)|| (g = 1 without a post-attention norm), times the row's
        # |scale| / rms(o) (headscope.model.write_path)
        norms = write_norms(written.output, self._grams[layer]) * share_scale(path, written.output, layer)[:, None]
        if self.exemplars is not None:
            self._offer_write(layer, norms, written)

        def visible_rows(rows: slice) -> torch.Tensor:
            return key_visibility(written.mask, written.query_valid, rows, t)

        masked = None if written.mask is None else visible_rows  # None: plain causal, summed as running sums
        residual, valid, start = written.residual_norm, written.query_valid, written.seq_start

        def by_torch() -> torch.Tensor:
            value_ratio, defined = sink_value_ratios(written.value, valid, start, heads, masked)
            return head_write_sums(norms, residual, value_ratio, defined, valid, self.accum_dtype)

        # The C++ kernel scans each row's visibility per head where torch multiplies it per KV head: past short rows
        # (where torch's dozens of operations cost more than their arithmetic) torch's blocks are the faster.
        short = masked is None or t <= NATIVE_MASKED_ROWS
        if written.native_sums is None or not short or self.accum_dtype != torch.float64:
            sums = by_torch()
        else:  # one pass of the C++ kernel (checked against torch's on its first call)
            value_norms = torch.linalg.vector_norm(written.value.float(), dim=-1)
            visible = None if masked is None else visible_rows(slice(None))
            sums = written.native_sums(norms, residual, value_norms, valid, start, visible, reference=by_torch)
        if layer not in self._sums:  # the layer's attention is read first; in case it was not, start from 0
            self._sums[layer] = sums.new_zeros(*sums.shape[:2], len(STATS))
        self._sums[layer][..., OUTPUT_INDEX] += sums

    def _add(self, layer: int, sums: torch.Tensor) -> None:
        self._sums[layer] = sums if layer not in self._sums else self._sums[layer] + sums

    def finish(self) -> torch.Tensor:
        """The batch's sums, (wanted layers, batch, heads, stats), in layer order, on the batch's device (with a
        device map, each layer's small sums move there from the device its attention ran on)."""
        self._sum_waiting()
        if not self._sums:
            raise ModelLoadError(
                "the model never called an attention function headscope can read (no attention layers?)"
            )
        device = self._batch.input_ids.device
        # Asynchronous only towards an accelerator: a non-blocking copy into host memory may not be done yet.
        asynchronous = device.type != "cpu"
        sums = torch.stack([self._sums[layer].to(device, non_blocking=asynchronous) for layer in sorted(self._sums)])
        self._sums = {}
        return sums


class _Rows(NamedTuple):
    """Where a block of rows lies (a RowBlock's geometry, for the fused pass's rows, which come without one)."""

    first_row: int
    query_valid: torch.Tensor
    seq_start: torch.Tensor


def heads_side_by_side(parts: Sequence[RowValues]) -> RowValues:
    """Several layers' values of the same rows as one RowValues, (batch, their heads together, rows) each."""
    batch, _, rows = parts[0].entropy.shape
    columns = [(part.columns(), (batch, part.entropy.shape[1], rows)) for part in parts]
    return RowValues(
        **{
            name: torch.cat([present[name].expand(shape) for present, shape in columns], dim=1)
            for name in columns[0][0]
        }
    )
