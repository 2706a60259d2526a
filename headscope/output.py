"""The output folder: all files appear together, or not at all.

A run writes into a hidden staging folder beside the target and renames it
into place at the end, so an interrupted or failed run never leaves a
half-written report, and a previous report stays intact until the new one is
complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from headscope.errors import OutputError


def temporary_path(path: Path) -> Path:
    """A hidden sibling name to write `path` under before the atomic rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; rename it to `path` if the block succeeds.

    On any failure the temporary file is removed, so `path` is either the old file or the complete new
    one; an OSError (a full disk, say) becomes an OutputError naming `path`.
    """
    path = Path(path)
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
