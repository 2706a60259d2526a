"""Which keys each query row may see: the masks transformers builds, read and rebuilt block by block.

We register `boolean_mask` for our attention name, so a layer receives sdpa's boolean mask (True = visible),
or None for causal input without padding. Everything here builds visibility for a block of query rows only,
so memory follows the block, not the square of the sequence.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import sdpa_mask


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


def visible_keys(attention_mask: torch.Tensor) -> torch.Tensor:
    """Which keys each query row may attend to, from the mask the attention function receives.

    attention_mask: (batch, 1 or heads, q, k), either boolean (True = visible) or additive
    float (0 = visible, the dtype's minimum = hidden). Returns a boolean tensor of the same shape.
    """
    if attention_mask.dtype == torch.bool:
        return attention_mask
    # Additive masks use finfo.min (not -inf) for hidden keys; half of it is a safe cut.
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2


def causal_visible_keys(
    query_valid: torch.Tensor, rows: slice | torch.Tensor | None = None, keys: int | None = None
) -> torch.Tensor:
    """Visibility for plain causal attention over right- or left-padded sequences.

    query_valid: (batch, t) bool, True for real tokens. rows: the query positions wanted (a slice or a
    (rows,) long tensor; default all); keys: how many keys from the first (default t).
    Returns (batch, 1, rows, keys) bool, built for those rows only.
    """
    t = query_valid.shape[-1]
    keys = t if keys is None else keys
    positions = torch.arange(t, device=query_valid.device)
    queries = positions[slice(None) if rows is None else rows]  # (rows,)
    causal = positions[None, :keys] <= queries[:, None]  # (rows, keys)
    return causal[None, None] & query_valid[:, None, None, :keys]


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


def streaming_keys(seq_start: torch.Tensor, t: int, sink: int, window: int) -> torch.Tensor:
    """What a streaming KV cache keeps for each query row: key s for row t iff s is among the sentence's first
    `sink` tokens or t - s < `window` (positions counted from each sentence's first real token, so left padding
    changes nothing). seq_start: (batch,) long. Returns (batch, 1, t, t) bool, to be AND-ed with the model's own
    visibility (causal, padding, sliding windows), which this does not repeat."""
    positions = torch.arange(t, device=seq_start.device)
    recent = (positions[:, None] - positions[None, :]) < window  # (t, t): row - key < window
    first = positions[None, :] < (seq_start[:, None] + sink)  # (batch, t): the sentence's first `sink` keys
    return (recent[None] | first[:, None, :])[:, None]


def count_visible(visible: torch.Tensor) -> torch.Tensor:
    """How many keys each row of a (..., rows, keys) bool visibility may see: (..., rows) long.

    Summed as bytes, twice as fast as summing the bools (which widens each one to int64 first).
    """
    return visible.view(torch.uint8).sum(-1, dtype=torch.int32).long()


class TileVisibility:
    """Which keys query rows may see, asked tile by tile or key by key (the fused path never builds a row's
    whole visibility at once).

    mask: what the attention function received (see `key_visibility`); None is plain causal attention without
    padding. Rows are (rows,) long query positions, increasing.
    """

    def __init__(self, attention_mask: torch.Tensor | None) -> None:
        self.mask = attention_mask

    def _mask_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(batch or 1, 1, rows, kv) bool: the mask's rows `rows` (a view, not a copy, when they are consecutive:
        this is asked for every tile)."""
        first, stop = int(rows[0]), int(rows[-1]) + 1
        return visible_keys(_rows_of(self.mask, slice(first, stop) if stop - first == len(rows) else rows))

    def tile(self, rows: torch.Tensor, keys: slice) -> tuple[bool, torch.Tensor | None]:
        """(does any row see any key of the tile, which keys are hidden: a (batch or 1, 1, 1, rows, keys) bool, True =
        hidden; or, for plain causal attention, a (rows,) long of the last key each row sees counted from the
        tile's first; or None when every row sees every key)."""
        if self.mask is None:
            if keys.start > int(rows[-1]):
                return False, None
            if keys.stop - 1 <= int(rows[0]):
                return True, None
            return True, rows - keys.start  # causal: row r sees the tile's first r - start + 1 keys
        visible = self._mask_rows(rows)[..., keys]
        if not bool(visible.any()):
            return False, None
        if bool(visible.all()):
            return True, None
        return True, ~visible[:, :, None]

    def points(self, rows: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """May row r see key `key_positions[b, r, j]`? (batch, 1, rows, j) bool; positions outside the sequence
        are not visible."""
        if self.mask is None:
            seen = (key_positions >= 0) & (key_positions <= rows[None, :, None])
            return seen[:, None]
        mask_rows = self._mask_rows(rows)  # (batch or 1, 1, rows, kv)
        keys = mask_rows.shape[-1]
        inside = (key_positions >= 0) & (key_positions < keys)
        index = key_positions.clamp(0, keys - 1)[:, None]  # (batch, 1, rows, j)
        mask_rows = mask_rows.expand(index.shape[0], -1, -1, -1)
        return mask_rows.gather(-1, index) & inside[:, None]

    def counts(self, rows: torch.Tensor) -> torch.Tensor:
        """(batch or 1, 1, rows) long: how many keys each row may see."""
        if self.mask is None:
            return (rows + 1)[None, None]
        return count_visible(self._mask_rows(rows))
