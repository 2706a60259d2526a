"""circuit's checkpoint: an interrupted run continues where it stopped (`--resume`).

Scoring every edge (minutes to hours of EAP-IG) and the exact patched passes (one forward per pair and edge set:
--verify and the curve) are saved as they finish, in the run's checkpoint folder (output.checkpoint_of):
- CIRCUIT_SCORES: every pair's edge scores, DLA and clean/corrupt metric, written once scoring ends, before any
  patched pass;
- CIRCUIT_PATCHED: the metric with each edge set patched, keyed by the set's content (sha256 of its mask), written
  after every group of PATCH_GROUP sets.

A resumed run reads the scores back instead of scoring again, and patches only the sets not saved: its numbers are
the ones an uninterrupted run gives (saved as float64 and float32 as computed, read back to the bit). Both files
carry a fingerprint of everything their numbers depend on (model, pairs, settings; the scores also the method, its
steps and the roles); a checkpoint from other inputs is refused in one line, not used. The patched sets depend on
neither the method nor --verify, --target or --select, so a resumed run may change those and keep what it can.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from headscope.errors import OutputError
from headscope.files import atomic_path
from headscope.interventions.edges import EdgeScores
from headscope.layout import CIRCUIT_PATCHED, CIRCUIT_SCORES

# edge sets patched between saves: each group runs the corrupt prompts and the senders' writes again, about 4 s on
# SmolLM2's 48 IOI pairs against 1.3-8 s a set (2 CPU cores): the default 19 sets are one group
PATCH_GROUP = 32
SCORE_FIELDS = ("scores", "dla", "clean", "corrupt", "pair_ids")


class CircuitCheckpoint:
    """The scores and patched sets of one circuit run, saved in `folder` (written by rank 0 only: `writes`) and,
    with `resume`, read back from an interrupted run's; with no folder (no --out), nothing is saved or read."""

    def __init__(self, folder: Path | None, fingerprint: dict, request: dict, *, resume: bool, writes: bool,
                 notify: Callable[[str], None]) -> None:  # fmt: skip
        """fingerprint: what every number depends on; request: what the scores depend on besides (method...);
        notify(text): told of what is read back (the reporter's note)."""
        self.folder, self.writes, self.resume = folder, writes and folder is not None, resume and folder is not None
        self.notify = notify
        self.patched_key = _digest(fingerprint)
        self.scores_key = _digest({"fingerprint": fingerprint, "request": request})

    def scores(self, compute: Callable[[], EdgeScores], graph) -> EdgeScores:
        """The saved scores where a resumed run has them, else compute(), saved before returning."""
        if self.folder is None:
            return compute()
        path = self.folder / CIRCUIT_SCORES
        if self.resume and path.is_file():
            saved = _load(path, self.scores_key, "edge scores", " (another --method, --steps or --by-role?)")
            self.notify(f"resuming the interrupted run: the edge scores of {len(saved['pair_ids'])} pairs read back "
                        f"from {path}")  # fmt: skip
            return EdgeScores(graph, *(saved[name] for name in SCORE_FIELDS), by_role=saved.get("by_role"),
                              eap=saved.get("eap"))  # fmt: skip
        found = compute()
        arrays = {name: getattr(found, name) for name in SCORE_FIELDS}
        arrays |= {name: getattr(found, name) for name in ("by_role", "eap") if getattr(found, name) is not None}
        self._save(path, self.scores_key, arrays)
        return found

    def patched(self, masks: Sequence[np.ndarray], compute: Callable[[list[np.ndarray]], np.ndarray]) -> np.ndarray:
        """(sets, pairs): the metric with each mask's edges patched; saved sets read back, the others computed
        PATCH_GROUP at a time (compute(masks) -> (len(masks), pairs)) and saved after each group."""
        if self.folder is None:
            return compute(list(masks)) if masks else np.zeros((0, 0))
        path = self.folder / CIRCUIT_PATCHED
        known: dict[str, np.ndarray] = {}
        if self.resume and path.is_file():
            saved = _load(path, self.patched_key, "patched edge sets", "")
            known = dict(zip(saved["keys"].tolist(), saved["values"], strict=True))
        keys = [_mask_key(mask) for mask in masks]
        reused = sum(key in known for key in set(keys))
        if reused:
            self.notify(f"resuming the interrupted run: {reused} of {len(set(keys))} patched edge sets read back from "
                        f"{path}")  # fmt: skip
        missing = list(dict.fromkeys(key for key in keys if key not in known))
        by_key = dict(zip(keys, masks, strict=True))
        for start in range(0, len(missing), PATCH_GROUP):
            group = missing[start : start + PATCH_GROUP]
            known |= dict(zip(group, compute([by_key[key] for key in group]), strict=True))
            arrays = {"keys": np.array(list(known)), "values": np.stack(list(known.values()))}
            self._save(path, self.patched_key, arrays)
        if not masks:
            return np.zeros((0, 0))
        return np.stack([known[key] for key in keys])

    def _save(self, path: Path, key: str, arrays: dict[str, np.ndarray]) -> None:
        if not self.writes:
            return
        with atomic_path(path) as tmp, tmp.open("wb") as file:
            np.savez(file, fingerprint=np.array(key), **arrays)

    def remove(self) -> None:
        """Drop the checkpoint files from the folder about to be published (a finished run needs none)."""
        for name in (CIRCUIT_SCORES, CIRCUIT_PATCHED) if self.writes else ():
            (self.folder / name).unlink(missing_ok=True)


def _load(path: Path, key: str, what: str, hint: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        raise OutputError(
            f"{path}: cannot read the interrupted run's {what} ({err}); delete it to start over"
        ) from None
    if str(arrays.pop("fingerprint", "")) != key:
        raise OutputError(f"{path} holds the {what} of a circuit with other inputs{hint}; run the same command as the "
                          f"interrupted one, or delete {path.parent} to start over")  # fmt: skip
    return arrays


def _digest(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _mask_key(mask: np.ndarray) -> str:
    mask = np.asarray(mask, dtype=bool)
    return hashlib.sha256(np.packbits(mask).tobytes() + str(mask.shape).encode()).hexdigest()
