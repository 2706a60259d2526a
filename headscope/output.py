"""The output folder: all files appear together or not at all, and only headscope's own files are replaced.

A run writes into a hidden staging folder beside the target and renames it into place at the end, so an
interrupted or failed run never leaves a half-written report, and a previous report stays intact until
the new one is complete. The rules, each checked before any work starts and again, atomically, when the
report is published:

- the target is resolved first (a symlink is followed: the link keeps pointing at the new report);
- it may not be the current folder, one holding it, or one holding the model or the corpus;
- an existing, non-empty target is replaced only with `overwrite`, and only if it is a headscope report
  (`layout.why_not_a_report`): a folder holding anything else is never deleted;
- the staging folder holds a lock for as long as its run lives; a later run removes staging folders whose
  lock is free (their run was killed), and refuses to start while another live run writes the same target;
- publishing takes a lock on the parent folder, so two runs into one target cannot both win: without
  `overwrite` the loser's rename fails because the folder is no longer empty, and it says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

from headscope.errors import OutputError
from headscope.layout import why_not_a_report

try:  # POSIX only; elsewhere runs are not protected from each other, which the README says
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = ".headscope.lock"


def temporary_path(path: Path) -> Path:
    """A hidden sibling name to write `path` under before the atomic rename."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; rename it to `path` if the block succeeds.

    On any failure the temporary file is removed, so `path` is either the old file or the complete new
    one; an OSError (a full disk, a read-only mount) becomes an OutputError naming `path`.
    """
    path = Path(path)
    tmp = temporary_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        _remove_quietly(tmp)
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def _remove_quietly(path: Path) -> None:
    # Cleanup must never replace the error being reported (on a read-only mount, unlink fails too).
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def resolved(path: Path | str) -> Path:
    """Absolute, with every symlink followed (also for a path that does not exist yet)."""
    return Path(path).expanduser().resolve()


def check_target(target: Path, *, overwrite: bool, protected: Mapping[str, Path] | None = None) -> None:
    """Refuse an output folder headscope must not replace. `target` is resolved; `protected` maps a
    description ("the model", "the corpus") to a path that must survive the run."""
    if target.parent == target:
        raise OutputError(f"--out {target} is the root of the file system; name a folder for the report")
    cwd = resolved(Path.cwd())
    if target == cwd or target in cwd.parents:
        raise OutputError(
            f"--out {target} is the current folder or holds it; headscope replaces its output folder as a "
            f"whole, so name a folder inside it (e.g. --out {target / 'report'})"
        )
    for what, path in (protected or {}).items():
        path = resolved(path)
        if path == target or target in path.parents:
            raise OutputError(f"--out {target} holds {what} ({path}); choose another output folder")
    if target.exists() and not target.is_dir():
        raise OutputError(f"output path {target} exists and is not a folder")
    if not target.is_dir():
        return
    try:
        reason = why_not_a_report(target)
        empty = not any(target.iterdir())
    except OSError as err:
        raise OutputError(f"cannot read output folder {target}: {err.strerror or err}") from None
    if reason is not None:
        raise OutputError(
            f"output folder {target} is not a headscope report ({reason}); --overwrite replaces only "
            "reports, so choose another --out"
        )
    if not empty and not overwrite:
        raise OutputError(f"output folder {target} holds a report; pass --overwrite to replace it")


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` itself (flock on the directory): serialises cleanup and publishing."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def _held(folder: Path) -> bool:
    """Is `folder` (a staging or checkpoint folder) in use by a live run?"""
    lock = folder / LOCK_FILE
    if fcntl is not None and lock.is_file():
        try:
            descriptor = os.open(lock, os.O_RDONLY)
        except OSError:
            return True  # cannot tell: leave it alone
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(descriptor)
        return False
    # No lock file (killed before it was made): the process id in the name tells.
    pid = folder.name.rpartition("-")[2]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class StagedDirectory:
    """Use as a context manager; write into `.path`, which becomes `target` on a clean exit.

    Everything that can be checked about the target is checked in the constructor, before any work.
    `cleaned` lists the stale folders of killed runs that entering removed (for the caller to report).
    """

    def __init__(
        self,
        target: Path,
        *,
        overwrite: bool = False,
        resumable: bool = False,
        protected: Mapping[str, Path] | None = None,
    ) -> None:
        """resumable: the staging folder has a fixed name and survives a failed or interrupted run, so
        that a later run can continue from the checkpoint inside it."""
        self.target = resolved(target)
        self.overwrite = overwrite
        self.resumable = resumable
        check_target(self.target, overwrite=overwrite, protected=protected)
        suffix = "partial" if resumable else f"staging-{os.getpid()}"
        self.path = self.target.parent / f".{self.target.name}.{suffix}"
        self.checkpoint = self.target.parent / f".{self.target.name}.partial"
        self.cleaned: list[str] = []
        self._lock: int | None = None

    def __enter__(self) -> StagedDirectory:
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with _folder_lock(parent):
                self._remove_stale(f".{self.target.name}.staging-*", f".{self.target.name}.old-*")
                busy = [p for p in self._siblings(".staging-*", ".partial") if p != self.path and _held(p)]
                if busy or (self.path.is_dir() and _held(self.path)):
                    raise OutputError(
                        f"another headscope run is writing {self.target} (its work folder {(busy or [self.path])[0]} "
                        "is in use); wait for it to finish or choose another --out"
                    )
                if not self.resumable:
                    shutil.rmtree(self.path, ignore_errors=True)
                self.path.mkdir(exist_ok=True)
                self._lock = self._take_lock()
        except OSError as err:
            raise OutputError(f"cannot create the output folder in {parent}: {err.strerror or err}") from None
        return self

    def _siblings(self, *suffixes: str) -> list[Path]:
        return [p for suffix in suffixes for p in self.target.parent.glob(f".{self.target.name}{suffix}")]

    def _remove_stale(self, *patterns: str) -> None:
        """Remove staging folders of runs that are no longer alive (killed, or their machine rebooted)."""
        for pattern in patterns:
            for folder in self.target.parent.glob(pattern):
                if folder.is_dir() and not folder.is_symlink() and folder != self.path and not _held(folder):
                    shutil.rmtree(folder, ignore_errors=True)
                    self.cleaned.append(str(folder))

    def _take_lock(self) -> int | None:
        if fcntl is None:  # pragma: no cover
            return None
        descriptor = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            raise OutputError(f"another headscope run is using {self.path}; wait for it to finish") from None
        return descriptor

    def _release_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._publish()
            elif not self.resumable or not _holds_work(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._release_lock()

    def _publish(self) -> None:
        parent = self.target.parent
        old = parent / f".{self.target.name}.old-{os.getpid()}"
        with _folder_lock(parent):
            # What held when the run started may not hold now (another run published meanwhile): check again.
            try:
                check_target(self.target, overwrite=self.overwrite)
            except OutputError as err:
                shutil.rmtree(self.path, ignore_errors=True)
                raise OutputError(f"{err} (it changed while this run was measuring; nothing was written)") from None
            with contextlib.suppress(FileNotFoundError):
                (self.path / LOCK_FILE).unlink()  # not part of the report; the open descriptor keeps the lock
            try:
                if self.overwrite and self.target.exists():
                    os.rename(self.target, old)
                # Without overwrite this rename is the atomic "still empty?" test: it fails on a folder that
                # is not empty, whoever filled it.
                os.rename(self.path, self.target)
            except OSError as err:
                if old.exists() and not self.target.exists():
                    os.rename(old, self.target)
                shutil.rmtree(self.path, ignore_errors=True)
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputError(
                        f"output folder {self.target} was filled by another run while this one was measuring; "
                        "that report was kept (pass --overwrite to replace it)"
                    ) from None
                raise OutputError(f"cannot move the new report into {self.target}: {err.strerror}") from None
            shutil.rmtree(old, ignore_errors=True)
            if not self.resumable and self.checkpoint.is_dir() and not _held(self.checkpoint):
                # A checkpoint of an earlier interrupted run is superseded by this complete report.
                shutil.rmtree(self.checkpoint, ignore_errors=True)
                self.cleaned.append(str(self.checkpoint))


def _holds_work(folder: Path) -> bool:
    """Does a checkpoint folder hold anything worth resuming from (more than its lock)?"""
    return any(entry.name != LOCK_FILE for entry in folder.iterdir()) if folder.is_dir() else False
