"""A sentence_heads table read back sentence by sentence, a bounded number at a time, every read guarded: what
`compare` streams its paired bootstrap from, so that no corpus is ever whole in memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from headscope.errors import OutputError, one_line

SENTENCES_AT_ONCE = 512  # sentences of a sentence_heads table read, and bootstrapped, at once


def sentence_rows(path: Path, cells: int, metrics, chunk: int = SENTENCES_AT_ONCE) -> Iterator[tuple[np.ndarray, ...]]:
    """Complete sentences of a sentence_heads table, `chunk` at a time: (ids, n_tokens, values per metric),
    values as (sentences, cells). Rows run sentence by sentence, (layer, head) within, as analyze writes them."""
    columns = ["sentence_id", "n_tokens", *metrics]
    buffered: list[pd.DataFrame] = []
    rows = 0
    for batch in _batches(path, chunk * cells, columns):
        buffered.append(batch.to_pandas())
        rows += batch.num_rows
        if rows >= chunk * cells:
            frame = pd.concat(buffered, ignore_index=True)
            whole = (len(frame) // cells) * cells
            yield _shaped(frame.iloc[:whole], cells, metrics)
            buffered, rows = [frame.iloc[whole:]], len(frame) - whole
    frame = pd.concat(buffered, ignore_index=True) if buffered else pd.DataFrame(columns=columns)
    if len(frame):
        if len(frame) % cells:
            raise OutputError(f"{path} does not hold a row for every (layer, head) of every sentence")
        yield _shaped(frame, cells, metrics)


def _batches(path: Path, size: int, columns: list[str]) -> Iterator:
    """The table's record batches; an unreadable or truncated file (pyarrow raises several types) is one line."""
    try:
        yield from pq.ParquetFile(path).iter_batches(batch_size=size, columns=columns)
    except Exception as err:
        raise OutputError(f"{path} is not a readable Parquet file ({one_line(err)}); run analyze again") from None


def _shaped(frame: pd.DataFrame, cells: int, metrics) -> tuple[np.ndarray, ...]:
    ids = frame["sentence_id"].to_numpy().reshape(-1, cells)
    if (ids != ids[:, :1]).any():
        raise OutputError("a sentence_heads table is not sorted by sentence")
    n = frame["n_tokens"].to_numpy(float).reshape(-1, cells)[:, 0]
    return (ids[:, 0], n, *(frame[m].to_numpy(float).reshape(-1, cells) for m in metrics))
