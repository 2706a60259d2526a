"""Where measured chunks go until the report is complete: part files, and resumable checkpoints.

Every chunk of sentences (RunConfig.chunk_sentences) leaves two part files in the run's work folder (the
staging folder of the report, or a temporary one), and with --resume also a checkpoint of the corpus-wide
sums after it. The parts are merged into the final tables at the end, so no per-sentence table is ever
whole in memory. A resumed run restores the sums bit for bit and reuses the batching limits of the first
run, so it produces exactly the tables an uninterrupted run would have.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from headscope.errors import OutputError
from headscope.files import atomic_path
from headscope.run.distributed import ONE_PROCESS, Ranks
from headscope.tables import SENTENCE_HEADS_SCHEMA, SENTENCES_SCHEMA, to_arrow, write_json


@dataclass
class Progress:
    """Everything needed to continue after `chunks_done` chunks."""

    chunks_done: int = 0
    measured_sentences: int = 0  # sentences with at least one token: each has a row per (layer, head)
    empty_sentences: int = 0  # sentences the tokenizer turned into no token at all
    tokens: int = 0
    truncated: int = 0
    capped: int = 0  # ... of them so long that their text was cut before tokenizing (feed.char_limit)
    batches: int = 0
    # Token count -> [sentences of that length, the first one's id]: the example views are chosen from it
    # (run.example_views.choose_examples), so the choice streams, survives a resume and merges across ranks.
    lengths: dict[str, list[int]] = field(default_factory=dict)


class PartFiles:
    """Writes each chunk as part files in `folder`; optionally checkpoints progress after each chunk."""

    def __init__(
        self, folder: Path, fingerprint: dict, *, checkpoints: bool, ranks: Ranks = ONE_PROCESS, in_memory: bool = False
    ) -> None:
        """ranks: in a data-parallel run each rank writes the parts of its own chunks and checkpoints its own
        progress (files named after the rank), so that --resume continues every rank where it stopped.
        in_memory: a report kept in memory (no output folder, one process, no checkpoints): the parts are held as
        tables and merged in memory (`merged_frames`), never written; writing and reading them back cost 5% of a
        run of short sentences (benchmarks/README.md)."""
        if in_memory and (checkpoints or ranks.parallel):
            raise ValueError("parts held in memory are neither checkpointed nor shared between ranks")
        self.folder = folder
        self.fingerprint = fingerprint
        self.checkpoints = checkpoints
        self.ranks = ranks
        self._checkpoint = f"checkpoint-rank{ranks.rank}" if ranks.parallel else "checkpoint"
        # kind -> chunk index -> its part (in memory), then kind -> the merged table
        self._held: dict[str, dict[int, pa.Table]] | None = {} if in_memory else None
        self._merged: dict[str, pa.Table] = {}

    def _part(self, kind: str, index: int) -> Path:
        return self.folder / f"{kind}.part-{index:06d}.parquet"

    def add(self, index: int, sentences: pd.DataFrame, sentence_heads: pd.DataFrame | None) -> None:
        self._keep("sentences", index, to_arrow(sentences, SENTENCES_SCHEMA))
        if sentence_heads is not None:  # kept even when empty, so a missing part always means a lost one
            self._keep("sentence_heads", index, to_arrow(sentence_heads, SENTENCE_HEADS_SCHEMA))

    def _keep(self, kind: str, index: int, table: pa.Table) -> None:
        if self._held is not None:
            self._held.setdefault(kind, {})[index] = table
            return
        with atomic_path(self._part(kind, index)) as tmp:
            pq.write_table(table, tmp, compression="none")  # read once and merged: compressing them buys nothing

    def save_progress(self, progress: Progress, arrays: dict[str, np.ndarray], plan: dict) -> None:
        """Checkpoint `progress`, the running sums (`arrays`: name -> array, e.g. the per-head sums) and the plan
        (`Plan.record`): batches decide the order of the float sums, so a resumed run batches as this one did
        and its tables equal an uninterrupted run's bit for bit."""
        if not self.checkpoints:
            return
        for name, array in arrays.items():
            with atomic_path(self.folder / f"{self._checkpoint}-{name}.npy") as tmp, open(tmp, "wb") as handle:
                np.save(handle, array)
        # The JSON goes last: a checkpoint counts only once its sums are on disk.
        record = {
            "fingerprint": self.fingerprint,
            "ranks": self.ranks.world,
            "progress": asdict(progress),
            "plan": plan,
            "arrays": sorted(arrays),
        }
        write_json(record, self.folder / f"{self._checkpoint}.json")

    def load_progress(
        self, shapes: dict[str, tuple[int, ...]], kinds: tuple[str, ...]
    ) -> tuple[Progress, dict[str, np.ndarray], dict | None]:
        """The checkpoint left in the folder by an interrupted run: its progress, running sums and plan (a
        fresh start, zeros and None, if there is none).

        shapes: name -> shape of every running sum. The checkpoint is refused unless it is whole: from the
        same run (fingerprint), every sum of its shape, and a part file of every kind in `kinds` for every
        chunk it says is done.
        """
        path = self.folder / f"{self._checkpoint}.json"
        self._check_ranks(path)
        if not path.is_file():
            return Progress(), {name: np.zeros(shape) for name, shape in shapes.items()}, None
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            progress, plan = Progress(**saved["progress"]), dict(saved["plan"])
            if set(plan["sizing"]) != {"batch_size", "max_memory", "memory_budget"}:
                raise KeyError("sizing")
            arrays = {name: np.load(self.folder / f"{self._checkpoint}-{name}.npy") for name in shapes}
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise OutputError(f"the checkpoint in {self.folder} is unreadable ({err}); delete that folder") from None
        if saved.get("fingerprint") != self.fingerprint:
            raise OutputError(
                f"the checkpoint in {self.folder} is from a different run (model, corpus or settings differ); "
                "delete that folder or run without --resume"
            )
        missing = [
            self._part(kind, index).name
            for index in range(progress.chunks_done)
            for kind in kinds
            if self.ranks.owns(index) and not self._part(kind, index).is_file()
        ]
        wrong = [name for name, shape in shapes.items() if arrays[name].shape != tuple(shape)]
        if missing or wrong:
            problem = f"{missing[0]} is missing" if missing else f"its {wrong[0]} have shape {arrays[wrong[0]].shape}"
            raise OutputError(f"the checkpoint in {self.folder} is incomplete ({problem}); delete that folder")
        return progress, arrays, plan

    def _check_ranks(self, path: Path) -> None:
        """Refuse, on every rank alike, a checkpoint written by another number of processes: its chunks were dealt
        among them, and each rank continues only its own."""
        found = [path] if path.is_file() else sorted(self.folder.glob("checkpoint*.json"))
        if not found:
            return
        try:
            written = json.loads(found[0].read_text(encoding="utf-8")).get("ranks", 1)
        except (OSError, ValueError, AttributeError):
            return  # unreadable: load_progress says so
        if written != self.ranks.world:
            how = "one process (no torchrun)" if written == 1 else f"torchrun --nproc-per-node {written}"
            raise OutputError(
                f"the checkpoint in {self.folder} was written by {written} process(es), and this run has "
                f"{self.ranks.world}: resume it as it was started ({how}), or delete that folder"
            )

    def merged(self, kind: str, schema: pa.Schema, destination: Path, chunks: int) -> int:
        """Concatenate the part files of `kind`, in chunk order, into `destination`; remove the parts (with
        checkpoints, only in `discard_checkpoint`: a run interrupted after this still has what --resume needs).

        Returns the number of rows written, for the caller to check against what the run measured. Parts held in
        memory are merged into a table `merged_frames` hands over; nothing is written.
        """
        if self._held is not None:
            held = self._held.pop(kind, {})
            if set(held) != set(range(chunks)):
                raise OutputError(f"the {kind} of chunks {sorted(set(range(chunks)) - set(held))} were never measured")
            self._merged[kind] = pa.concat_tables([held[index] for index in range(chunks)]).cast(schema)
            return self._merged[kind].num_rows
        parts = [self._part(kind, index) for index in range(chunks)]
        rows = 0
        with atomic_path(destination) as tmp, pq.ParquetWriter(tmp, schema) as writer:
            for part in parts:
                try:
                    table = pq.read_table(part, schema=schema)
                except FileNotFoundError:
                    raise OutputError(f"{part} is missing; the checkpoint in {self.folder} is incomplete") from None
                except Exception as err:  # pyarrow raises several unrelated types for unreadable files
                    raise OutputError(f"{part} is unreadable ({err}); delete {self.folder}") from None
                writer.write_table(table)
                rows += table.num_rows
        if not self.checkpoints:
            for part in parts:
                part.unlink()
        return rows

    def merged_frames(self) -> dict[str, pd.DataFrame]:
        """The tables merged in memory, by kind ("sentences", "sentence_heads"), as a read of their files gives."""
        return {kind: table.to_pandas() for kind, table in self._merged.items()}

    def discard_checkpoint(self) -> None:
        """The report is complete: the checkpoint and the parts it counts are not part of it (every rank's)."""
        for pattern in ("checkpoint*.json", "checkpoint*.npy", "*.part-*.parquet"):
            for path in self.folder.glob(pattern):
                path.unlink(missing_ok=True)
