"""Run batches through a model and reduce each layer's attention as soon as it exists.

How: we register an attention function named ``headscope`` with transformers' attention interface.
For every layer it reduces the attention probabilities to per-(sentence, head) sums and returns no
weights, so nothing holds more than one layer's attention (or one block of it) at a time.

Where the probabilities come from:
- ``eager``: the model's *own* module-level ``eager_attention_forward`` (so grouped KV heads,
  scaling, softcapping, sinks and sliding windows are the model's), which materialises the full
  (batch, heads, t, t) matrix.
- ``blockwise``: the layer's output comes from ``sdpa`` (fast, no t x t matrix) and the probabilities
  are recomputed block of query rows by block, bounding memory by (batch x heads x block x keys).
  Used only when the model's eager function is, to the letter, one of the standard ones (Llama's or
  GPT-2's: softmax(q k^T * scaling + mask)) *and* the recomputed probabilities matched the eager
  ones on the first real call. Anything else stays on the model's own eager function.

Two pitfalls this module exists to avoid (see FINDINGS.md):
- a custom attention name needs a *mask* function too, or transformers builds no causal or padding
  mask at all: we register sdpa's boolean one (see `boolean_mask`);
- the attention function never sees the 2-D padding mask, so the reducer is told which query rows
  are real before every forward.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from headscope.batching import Batch
from headscope.errors import ModelLoadError, ResourceError
from headscope.metrics import causal_visible_keys, head_row_sums, head_row_sums_from_logits, visible_keys

ATTENTION_NAME = "headscope"
BLOCK_BYTES = 32 * 2**20  # float32 logits per block of query rows; temporaries take a few times this
# Rows per block, at most: small blocks let causal attention skip most keys after each block's last row.
MAX_BLOCK_ROWS = 128


def _normalised_source(function: Callable) -> str:
    source = inspect.getsource(function)
    source = re.sub(r"#[^\n]*", "", source)  # comments
    return re.sub(r"\s+", "", source)


# Eager functions whose maths is exactly softmax(q k^T * scaling + mask) with repeated KV heads.
_STANDARD_EAGER = {
    _normalised_source(modeling_llama.eager_attention_forward),
    _normalised_source(modeling_gpt2.eager_attention_forward),
}
_eager_by_class: dict[type, Callable] = {}
_standard_source: dict[Callable, bool] = {}
_verified: dict[Callable, bool] = {}  # eager function -> recomputed probabilities matched it
_causal: dict[Callable, bool] = {}  # eager function -> its weights above the diagonal were exactly 0


class _StopForward(Exception):
    """Raised after the last wanted layer: later layers cannot change what we measure."""


def standard_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    visible: torch.Tensor,
    scaling: float | None,
    rows: slice | torch.Tensor,
    keys: int,
) -> torch.Tensor:
    """q k^T * scaling, hidden keys at the dtype's minimum, for query rows `rows` and the first `keys` keys,
    as the standard eager functions compute them.

    query: (batch, heads, t, head_dim); key: (batch, heads, t, head_dim) with KV heads already repeated;
    visible: (batch or 1, 1, rows, keys) bool from `key_visibility`; rows: a slice or (rows,) long positions.
    Returns (batch, heads, rows, keys); softmax over the last axis (in float32) gives the eager probabilities.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Scaling the (rows, head_dim) queries instead of the (rows, keys) scores: the same numbers up to
    # float rounding (verified against the eager weights), at a fraction of the memory traffic.
    scores = torch.matmul(_rows_of(query, rows) * scaling, key[:, :, :keys].transpose(2, 3))
    return scores.masked_fill(~visible, torch.finfo(scores.dtype).min)


def _rows_of(x: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    """x[..., rows, :] for a slice (a view) or a (rows,) long tensor of positions (a copy)."""
    return x[..., rows, :] if isinstance(rows, slice) else x.index_select(-2, rows.to(x.device))


def key_visibility(
    attention_mask: torch.Tensor | None, query_valid: torch.Tensor, rows: slice | torch.Tensor, keys: int
) -> torch.Tensor:
    """Which of the first `keys` keys query rows `rows` may see, built for those rows only.

    attention_mask: what the attention function received: (batch or 1, 1, t, kv) bool from our registered
    mask function (True = visible), an additive float mask from a model that builds its own, or None
    (plain causal attention without padding, which transformers leaves to sdpa's is_causal).
    query_valid: (batch, t) bool. Returns (batch or 1, 1, rows, keys) bool.
    """
    if attention_mask is None:
        return causal_visible_keys(query_valid, rows, keys)
    return visible_keys(_rows_of(attention_mask[..., :keys], rows))


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask eager attention functions add to their scores: 0 where visible, the minimum elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


def _repeat_kv(key: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, kv_heads, keys, d) -> (batch, heads, keys, d): query head h reads KV head h // groups."""
    groups = heads // key.shape[1]
    return key if groups == 1 else key.repeat_interleave(groups, dim=1)


class LayerReducer:
    """Receives one layer's attention at a time and keeps only per-(sentence, head) sums."""

    def __init__(
        self,
        *,
        window: int,
        accum_dtype: torch.dtype,
        layers: Sequence[int] | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.window = window
        self.accum_dtype = accum_dtype
        self.layers = sorted(set(layers)) if layers is not None else None
        self.block_bytes = block_bytes
        self.paths: dict[str, str] = {}  # attention class -> path used, for run.json
        self._batch: Batch | None = None
        self._query_valid: torch.Tensor | None = None
        self._layer = -1
        self._layer_sums: list[torch.Tensor] = []

    @property
    def query_valid(self) -> torch.Tensor | None:
        """(batch, t) bool, True on real tokens of the current batch."""
        return self._query_valid

    def start(self, batch: Batch) -> None:
        self._batch = batch
        self._query_valid = batch.attention_mask.bool()
        self._layer = -1
        self._layer_sums = []

    def next_layer(self) -> int:
        self._layer += 1
        return self._layer

    def wants(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def is_last_wanted(self, layer: int) -> bool:
        return self.layers is not None and layer >= self.layers[-1]

    def fits_one_block(self, query: torch.Tensor) -> bool:
        """Is the whole (batch, heads, t, t) matrix within the block budget? Then the eager weights are cheapest."""
        batch, heads, t, _ = query.shape
        return 4 * batch * heads * t * t <= self.block_bytes

    def consume(self, attn: torch.Tensor, visible: torch.Tensor) -> None:
        """attn: (batch, heads, t, t) probabilities; visible: (batch or 1, 1, t, t) bool, the keys each row may see."""
        self._layer_sums.append(
            head_row_sums(
                attn,
                key_visible=visible,
                query_valid=self._query_valid,
                seq_start=self._batch.seq_start,
                window=self.window,
                accum_dtype=self.accum_dtype,
                # float32 rows sum to 1 within ~1e-6; half-precision probabilities are rounded to ~3 digits.
                mass_tolerance=1e-3 if attn.dtype == torch.float32 else 2e-2,
            )
        )

    def consume_blocks(self, query, key, attention_mask, scaling, *, causal: bool) -> None:
        """Recompute the logits block of query rows by block and reduce each block.

        With causal attention the rows of a block ending at position r see no key after r, so only
        keys < r are computed: about half the work of the full matrix.
        """
        batch, heads, t, _ = query.shape
        key = _repeat_kv(key, heads)
        rows_per_block = max(1, min(MAX_BLOCK_ROWS, self.block_bytes // (4 * batch * heads * key.shape[-2])))
        total = None
        for first in range(0, t, rows_per_block):
            rows = slice(first, min(first + rows_per_block, t))
            keys = rows.stop if causal else key.shape[-2]
            visible = key_visibility(attention_mask, self._query_valid, rows, keys)  # (batch or 1, 1, rows, keys)
            sums = head_row_sums_from_logits(
                standard_logits(query, key, visible, scaling, rows, keys),
                key_visible=visible,
                query_valid=self._query_valid[:, rows],
                seq_start=self._batch.seq_start,
                window=self.window,
                row_offset=first,
                accum_dtype=self.accum_dtype,
            )
            total = sums if total is None else total + sums
        self._layer_sums.append(total)

    def finish(self) -> torch.Tensor:
        """Sums of the batch, (wanted layers, batch, heads, stats), moved to the CPU in one transfer."""
        if not self._layer_sums:
            raise ModelLoadError(
                "the model never called an attention function headscope can read (no attention layers?)"
            )
        sums = torch.stack(self._layer_sums).cpu()
        self._batch = None
        self._layer_sums = []
        return sums


class AttentionKeeper:
    """Keeps every layer's attention of a one-sentence batch, for the example charts (small by design)."""

    def __init__(self) -> None:
        self.layers: list[torch.Tensor] = []
        self.paths: dict[str, str] = {}
        self.query_valid: torch.Tensor | None = None  # one unpadded sentence: every row is real

    def fits_one_block(self, query: torch.Tensor) -> bool:
        return True  # always keep the model's own weights

    def next_layer(self) -> int:
        return len(self.layers)

    def wants(self, layer: int) -> bool:
        return True

    def is_last_wanted(self, layer: int) -> bool:
        return False

    def consume(self, attn: torch.Tensor, visible: torch.Tensor) -> None:
        self.layers.append(attn[0].float().cpu())  # (heads, t, t)


_active: LayerReducer | AttentionKeeper | None = None


def _eager_forward_for(module: torch.nn.Module) -> Callable:
    """The `eager_attention_forward` defined next to the attention module's class."""
    cls = type(module)
    if cls not in _eager_by_class:
        function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if function is None:
            raise ModelLoadError(
                f"{cls.__name__} has no eager attention function in {cls.__module__}; "
                "headscope cannot read its attention weights"
            )
        _eager_by_class[cls] = function
        _standard_source[function] = _normalised_source(function) in _STANDARD_EAGER
    return _eager_by_class[cls]


# Query rows of one sentence on which a standard eager function is checked before the block-wise path is
# trusted: enough to see the first row (which a causal model lets see only itself) and rows across the
# sentence, few enough that the check costs (1, heads, CHECK_ROWS, keys) whatever the sequence length.
CHECK_ROWS = 16


def check_rows(query_valid: torch.Tensor | None, t: int) -> tuple[int, torch.Tensor]:
    """(sentence, query positions) to check on: up to CHECK_ROWS real rows spread over the longest sentence.

    query_valid: (batch, t) bool or None (every row real). Returns the batch index and (rows,) long positions.
    """
    if query_valid is None:
        sentence, positions = 0, torch.arange(t)
    else:
        sentence = int(query_valid.sum(-1).argmax())
        positions = query_valid[sentence].nonzero().squeeze(-1).cpu()
    if len(positions) > CHECK_ROWS:
        positions = positions[torch.linspace(0, len(positions) - 1, CHECK_ROWS).round().long()]
    return sentence, positions


def _inspect_standard(eager: Callable, name: str, module, query, key, value, mask, kwargs, query_valid) -> None:
    """On the first call of a standard eager function: refuse bidirectional attention, and record whether
    our q k^T * scaling + mask softmax reproduces the model's own weights (which allows the block-wise path).

    Both are judged on a few query rows of one sentence (`check_rows`), so the check's memory does not grow
    with the square of the sequence: the model's eager function takes the rows as a shorter query.
    """
    sentence, positions = check_rows(query_valid, query.shape[-2])
    one = slice(sentence, sentence + 1)
    positions = positions.to(query.device)
    if mask is not None and mask.shape[0] > 1:
        mask = mask[one]
    valid = _all_valid(query) if query_valid is None else query_valid
    visible = key_visibility(mask, valid[one], positions, key.shape[-2])  # (1, 1, rows, keys)
    rows_query = query[one].index_select(-2, positions)
    _, weights = eager(module, rows_query, key[one], value[one], additive_mask(visible, query.dtype), **kwargs)
    _check_causal(eager, name, weights, positions)
    logits = standard_logits(
        rows_query, _repeat_kv(key[one], query.shape[1]), visible, kwargs.get("scaling"), slice(None), key.shape[-2]
    )
    expected = torch.softmax(logits, dim=-1, dtype=torch.float32)
    tolerance = 1e-5 if weights.dtype == torch.float32 else 1e-2  # half types round probabilities to ~3 digits
    _verified[eager] = bool((weights.float() - expected).abs().max() <= tolerance)


def _full_visibility(mask, query: torch.Tensor, key: torch.Tensor, query_valid) -> torch.Tensor:
    """(batch or 1, 1, t, keys) bool for every query row: what the eager path needs."""
    valid = _all_valid(query) if query_valid is None else query_valid
    return key_visibility(mask, valid, slice(None), key.shape[-2])


def _all_valid(query: torch.Tensor) -> torch.Tensor:
    """(batch, t) all True: every row real (a batch without padding)."""
    return torch.ones(query.shape[0], query.shape[-2], dtype=torch.bool, device=query.device)


def _check_causal(eager: Callable, name: str, weights: torch.Tensor, positions: torch.Tensor, rows=None) -> None:
    """Refuse a model whose weights (batch, heads, len(positions), keys) reach keys after their query.

    positions: (len(positions),) the query position of each row; rows: (batch, len(positions)) bool, the
    rows to judge (padding rows may attend anywhere), or None for all.
    """
    later = torch.arange(weights.shape[-1], device=weights.device)[None, :] > positions[:, None]  # (rows, keys)
    above_diagonal = weights * later
    if rows is not None:
        above_diagonal = above_diagonal * rows[:, None, :, None]
    # `> 0`, not `max() == 0`: a NaN row (float16 overflow) is not attention to later tokens.
    _causal[eager] = not bool((above_diagonal > 0).any())
    if not _causal[eager]:
        raise ModelLoadError(
            f"{name} lets tokens attend to later tokens (bidirectional attention, an encoder?); "
            "headscope measures causal language models"
        )


def _measured_layer(consumer, eager: Callable, name: str, module, query, key, value, mask, kwargs):
    """The layer's output, with its attention probabilities handed to `consumer` on the way.

    mask: what our registered mask function built: (batch or 1, 1, t, t) bool, or None for causal attention
    without padding. sdpa takes it as it is; the model's eager function gets the additive form it expects.
    """
    query_valid = consumer.query_valid
    if eager not in _causal and _standard_source[eager]:
        _inspect_standard(eager, name, module, query, key, value, mask, kwargs, query_valid)
    if _verified.get(eager) and not consumer.fits_one_block(query):
        output, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
        consumer.consume_blocks(query, key, mask, kwargs.get("scaling"), causal=_causal[eager])
        consumer.paths[name] = "blockwise (sdpa output, probabilities by blocks of query rows)"
        return output
    # The full (batch, heads, t, t) weights exist on this path anyway, so a full-size mask costs no more.
    visible = _full_visibility(mask, query, key, query_valid)
    output, weights = eager(module, query, key, value, additive_mask(visible, query.dtype), **kwargs)
    if weights is None:
        raise ModelLoadError(f"{name}'s eager attention returned no weights")
    if eager not in _causal:  # a model with its own attention maths: judged on the weights it computed anyway
        _check_causal(eager, name, weights, torch.arange(weights.shape[-2], device=weights.device), query_valid)
    consumer.consume(weights, visible)
    consumer.paths.setdefault(name, "eager (the model's own attention function)")
    return output


def _unmeasured_layer(eager: Callable, module, query, key, value, mask, kwargs, query_valid) -> torch.Tensor:
    """A layer that is run but not measured (--layers): the fastest correct output."""
    if _standard_source[eager]:
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
    visible = _full_visibility(mask, query, key, query_valid)
    return eager(module, query, key, value, additive_mask(visible, query.dtype), **kwargs)[0]


def _measuring_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention-interface entry: compute the layer's output, reduce its probabilities, return no weights."""
    consumer = _active
    if consumer is None:
        raise RuntimeError("headscope attention ran outside headscope.capture.measuring()")
    eager = _eager_forward_for(module)
    layer = consumer.next_layer()
    if consumer.wants(layer):
        name = type(module).__name__
        output = _measured_layer(consumer, eager, name, module, query, key, value, attention_mask, kwargs)
    else:
        output = _unmeasured_layer(eager, module, query, key, value, attention_mask, kwargs, consumer.query_valid)
    if consumer.is_last_wanted(layer):
        raise _StopForward
    return output, None


def boolean_mask(*args, **kwargs) -> torch.Tensor | None:
    """The mask our attention name gets: sdpa's boolean one (1 byte per entry), or None for causal input
    without padding, instead of eager's additive float one (4 bytes, always built): at 8,192 tokens that is
    256 MiB per sentence we no longer hold. A bidirectional mask is always built, never skipped, so that
    None means "causal" and nothing else (a skipped encoder mask would make BERT look causal).
    A registered mask function is a must (FINDINGS pitfall 1: without one, transformers builds no causal or
    padding mask at all).
    """
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _measuring_attention)
AttentionMaskInterface.register(ATTENTION_NAME, boolean_mask)


@contextlib.contextmanager
def measuring(model: torch.nn.Module, consumer: LayerReducer | AttentionKeeper) -> Iterator[None]:
    """Switch `model` to the measuring attention for the duration of the block, then restore it."""
    global _active
    if not type(model)._can_set_attn_implementation():
        raise ModelLoadError(
            f"{type(model).__name__} does not route attention through transformers' attention interface; "
            "headscope cannot capture its attention"
        )
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    _active = consumer
    try:
        yield
    finally:
        _active = None
        model.set_attn_implementation(previous)


def forward_kwargs(model: torch.nn.Module, batch: Batch) -> dict:
    """Arguments for a forward pass: explicit positions (so left padding is harmless) when accepted."""
    kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "use_cache": False}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = batch.position_ids
    return kwargs


def _forward(model: torch.nn.Module, batch: Batch) -> None:
    with torch.inference_mode(), contextlib.suppress(_StopForward):
        model(**forward_kwargs(model, batch))


def measure_batch(model: torch.nn.Module, reducer: LayerReducer, batch: Batch) -> torch.Tensor:
    """One forward pass under `measuring`; returns (wanted layers, batch, heads, stats) sums on the CPU."""
    reducer.start(batch)
    try:
        _forward(model, batch)
    except (torch.OutOfMemoryError, MemoryError) as err:
        raise _out_of_memory(batch) from err
    except RuntimeError as err:
        if "can't allocate memory" not in str(err):  # the CPU allocator's own wording
            raise
        raise _out_of_memory(batch) from err
    return reducer.finish()


def _out_of_memory(batch: Batch) -> ResourceError:
    sentences, tokens = batch.input_ids.shape
    return ResourceError(
        f"out of memory on a batch of {sentences} sentences x {tokens} tokens; "
        "lower --max-memory or --batch-size, or cut sentences with --max-length"
    )


def sentence_attention(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """All layers' attention of a one-sentence batch: (layers, heads, t, t) on the CPU."""
    if len(batch.sentence_ids) != 1:
        raise ValueError("sentence_attention takes a batch of exactly one sentence")
    keeper = AttentionKeeper()
    with measuring(model, keeper):
        _forward(model, batch)
    return torch.stack(keeper.layers)
