"""The output folder: all files appear together, or not at all.

A run writes into a hidden staging folder beside the target and renames it
into place at the end, so an interrupted or failed run never leaves a
half-written report, and a previous report stays intact until the new one is
complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from headscope.errors import OutputError


class StagedDirectory:
    """Use as a context manager; write into `.path`, which becomes `target` on a clean exit."""

    def __init__(self, target: Path, *, overwrite: bool = False, resumable: bool = False) -> None:
        """resumable: the staging folder has a fixed name and survives a failed or interrupted run, so
        that a later run can continue from the checkpoint inside it."""
        self.target = Path(target)
        self.resumable = resumable
        if self.target.exists() and not self.target.is_dir():
            raise OutputError(f"output path {self.target} exists and is not a folder")
        if self.target.is_dir() and any(self.target.iterdir()) and not overwrite:
            raise OutputError(f"output folder {self.target} is not empty; pass --overwrite to replace it")
        suffix = "partial" if resumable else f"staging-{os.getpid()}"
        self.path = self.target.parent / f".{self.target.name}.{suffix}"

    def __enter__(self) -> StagedDirectory:
        try:
            if not self.resumable:
                shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputError(f"cannot create the output folder in {self.target.parent}: {err.strerror}") from None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            if not self.resumable:
                shutil.rmtree(self.path, ignore_errors=True)
            return
        self._publish()

    def _publish(self) -> None:
        old = self.target.parent / f".{self.target.name}.old-{os.getpid()}"
        try:
            if self.target.exists():
                os.rename(self.target, old)
            os.rename(self.path, self.target)
        except OSError as err:
            if old.exists() and not self.target.exists():
                os.rename(old, self.target)
            shutil.rmtree(self.path, ignore_errors=True)
            raise OutputError(f"cannot move the new report into {self.target}: {err.strerror}") from None
        shutil.rmtree(old, ignore_errors=True)
