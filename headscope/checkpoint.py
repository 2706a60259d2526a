"""Where measured chunks go until the report is complete: memory, or part files with resumable checkpoints.

With an output folder, every chunk of sentences (RunConfig.chunk_sentences) leaves two part files in the
staging folder, and with --resume also a checkpoint of the corpus-wide sums after it. The parts are merged
into the final tables at the end. A resumed run restores the sums bit for bit and reuses the batching
limits of the first run, so it produces exactly the tables an uninterrupted run would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from headscope.errors import OutputError
from headscope.output import atomic_path
from headscope.tables import to_arrow, write_json

CHECKPOINT_FILE = "checkpoint.json"
SUMS_FILE = "checkpoint-sums.npy"


@dataclass
class Progress:
    """Everything needed to continue after `chunks_done` chunks."""

    chunks_done: int = 0
    tokens: int = 0
    truncated: int = 0
    batches: int = 0
    batching: dict | None = None  # the limits the run started with, reused on resume


class MemoryChunks:
    """Keeps measured chunks in memory (the Python API without an output folder)."""

    def __init__(self) -> None:
        self.sentences: list[pd.DataFrame] = []
        self.sentence_heads: list[pd.DataFrame] = []

    def add(self, index: int, sentences: pd.DataFrame, sentence_heads: pd.DataFrame | None) -> None:
        self.sentences.append(sentences)
        if sentence_heads is not None:
            self.sentence_heads.append(sentence_heads)

    def save_progress(self, progress: Progress, sums: np.ndarray | None) -> None:
        pass

    def sentences_table(self) -> pd.DataFrame:
        return pd.concat(self.sentences, ignore_index=True)

    def sentence_heads_table(self) -> pd.DataFrame | None:
        return pd.concat(self.sentence_heads, ignore_index=True) if self.sentence_heads else None


class PartFiles:
    """Writes each chunk as part files in `folder`; optionally checkpoints progress after each chunk."""

    def __init__(self, folder: Path, fingerprint: dict, *, checkpoints: bool) -> None:
        self.folder = folder
        self.fingerprint = fingerprint
        self.checkpoints = checkpoints

    def _part(self, kind: str, index: int) -> Path:
        return self.folder / f"{kind}.part-{index:06d}.parquet"

    def add(self, index: int, sentences: pd.DataFrame, sentence_heads: pd.DataFrame | None) -> None:
        from headscope.tables import SENTENCE_HEADS_SCHEMA, SENTENCES_SCHEMA

        self._write(to_arrow(sentences, SENTENCES_SCHEMA), self._part("sentences", index))
        if sentence_heads is not None:
            self._write(to_arrow(sentence_heads, SENTENCE_HEADS_SCHEMA), self._part("sentence_heads", index))

    def _write(self, table: pa.Table, path: Path) -> None:
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)

    def save_progress(self, progress: Progress, sums: np.ndarray | None) -> None:
        if not self.checkpoints:
            return
        with atomic_path(self.folder / SUMS_FILE) as tmp, open(tmp, "wb") as handle:
            np.save(handle, sums)
        # The JSON goes last: a checkpoint counts only once its sums are on disk.
        write_json({"fingerprint": self.fingerprint, "progress": asdict(progress)}, self.folder / CHECKPOINT_FILE)

    def load_progress(self) -> tuple[Progress, np.ndarray | None]:
        """The checkpoint left in the folder by an interrupted run (a fresh start if there is none)."""
        path = self.folder / CHECKPOINT_FILE
        if not path.is_file():
            return Progress(), None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            sums = np.load(self.folder / SUMS_FILE)
        except (OSError, ValueError) as err:
            raise OutputError(f"the checkpoint in {self.folder} is unreadable ({err}); delete the folder") from None
        if saved.get("fingerprint") != self.fingerprint:
            raise OutputError(
                f"the checkpoint in {self.folder} is from a different run (model, corpus or settings differ); "
                "delete that folder or run without --resume"
            )
        return Progress(**saved["progress"]), sums

    def merged(self, kind: str, schema: pa.Schema, destination: Path, chunks: int) -> None:
        """Concatenate the part files of `kind`, in chunk order, into `destination`; remove the parts."""
        parts = [self._part(kind, index) for index in range(chunks) if self._part(kind, index).exists()]
        with atomic_path(destination) as tmp, pq.ParquetWriter(tmp, schema) as writer:
            for part in parts:
                writer.write_table(pq.read_table(part, schema=schema))
        for part in parts:
            part.unlink()

    def discard_checkpoint(self) -> None:
        for name in (CHECKPOINT_FILE, SUMS_FILE):
            (self.folder / name).unlink(missing_ok=True)
