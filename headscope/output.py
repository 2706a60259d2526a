"""Output folders: all files appear together or not at all, and only what headscope made is ever replaced.

A command writes into a hidden work folder beside its target and renames it into place at the end, so an
interrupted or failed run never leaves a half-written folder, and a previous one stays intact until the new one
is complete. The rules, each checked before any work starts and again, atomically, when the folder is published:

- the target is resolved first (a symlink is followed: the link keeps pointing at the new folder);
- it may not be the current folder, one holding it, or one holding an input (the model, the corpus, a report);
- an existing, non-empty target is replaced only with `overwrite`, and only when it is a headscope folder of
  the kind the command writes (`layout.why_not_replaceable`): a folder holding anything else is never deleted;
- every work folder headscope makes holds a marker naming the run that made it (and locked while it lives); a
  later run removes leftovers beside its target only when their marker proves headscope made them for that
  target and their run is gone, and never finds them by a pattern built from the target's name;
- publishing takes a lock on the parent folder, so two runs into one target cannot both win: without
  `overwrite` the loser's rename fails because the folder is no longer empty, and it says so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
from collections.abc import Iterator, Mapping
from pathlib import Path

from headscope.errors import HeadscopeError, OutputError
from headscope.layout import KINDS, why_not_replaceable

try:  # POSIX only; elsewhere runs are not protected from each other, which the README says
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

MARKER = ".headscope-work"  # in every work folder: which run made it, for which target; locked while it lives
_WORK_SUFFIX = re.compile(r"(staging|old)-\d+|partial")  # .<target>.<suffix>


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


# What file systems answer when they refuse a write, and how libraries that wrap the error (pyarrow, safetensors'
# Rust writer) spell it: a full disk or quota, a file over the size limit, a read-only file system.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_DISK_WORDS = ("No space left on device", "Disk quota exceeded", "File too large", "Read-only file system",
               "StorageFull", "FileTooLarge", "ReadOnlyFilesystem")  # fmt: skip


def disk_refusal(error: BaseException) -> str | None:
    """Why the file system refused a write, if that is what `error` is (from any library), else None. headscope's
    own errors already say which file."""
    if isinstance(error, HeadscopeError):
        return None
    if isinstance(error, OSError) and error.errno in _DISK_ERRNOS:
        return error.strerror or os.strerror(error.errno)
    text = str(error)
    return next((word for word in _DISK_WORDS if word in text), None) if isinstance(error, Exception) else None


def _remove_quietly(path: Path) -> None:
    # Cleanup must never replace the error being reported (on a read-only mount, unlink fails too).
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def resolved(path: Path | str) -> Path:
    """Absolute, with every symlink followed (also for a path that does not exist yet); a path that cannot be
    resolved (links that loop, a name too long) is one line naming it."""
    try:
        return Path(path).expanduser().resolve(strict=False)
    except RuntimeError:  # Python < 3.13 reports a loop so
        raise OutputError(f"{path}: its symbolic links loop back on themselves") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OutputError(f"{path}: its symbolic links loop back on themselves") from None
        raise OutputError(f"{path}: {err.strerror or err}") from None


# The longest suffix headscope adds to a folder's name for its work folders: ".NAME.staging-PID".
_WORK_NAME_EXTRA = len("..staging-") + 10


def check_target(
    target: Path,
    *,
    kind: str,
    overwrite: bool,
    protected: Mapping[str, Path] | None = None,
    resumable: bool = False,
) -> None:
    """Refuse an output folder headscope must not write (see the module's rules). `target` is resolved;
    `protected` maps a description ("the model", "the corpus") to a path that must survive the run; resumable:
    this run continues (or starts) the checkpoint beside the target."""
    option = KINDS[kind].option
    try:
        _check_target(target, kind, option, overwrite, protected, resumable)
    except OSError as err:  # a name too long, a folder that cannot be read: one line naming the option's path
        raise OutputError(f"{option} {target}: {err.strerror or err}") from None


def _check_target(target: Path, kind: str, option: str, overwrite: bool, protected, resumable: bool) -> None:
    existing = next(path for path in target.parents if path.exists())
    if not existing.is_dir():
        raise OutputError(f"{option} {target} lies under {existing}, which is a file, not a folder")
    name_max = os.pathconf(target.parent, "PC_NAME_MAX") if target.parent.is_dir() else 255
    if len(os.fsencode(target.name)) + _WORK_NAME_EXTRA > name_max:
        raise OutputError(
            f"{option} names a folder whose name has {len(os.fsencode(target.name))} bytes; headscope needs "
            f"{_WORK_NAME_EXTRA} more for its work folder beside it (at most {name_max}): choose a shorter name"
        )
    if target.parent == target:
        raise OutputError(f"{option} {target} is the root of the file system; name a folder for the output")
    cwd = resolved(Path.cwd())
    if target == cwd or target in cwd.parents:
        raise OutputError(
            f"{option} {target} is the current folder or holds it; headscope replaces its output folder as a "
            f"whole, so name a folder inside it (e.g. {option} {target / 'report'})"
        )
    for what, path in (protected or {}).items():
        path = resolved(path)
        if path == target or target in path.parents:
            raise OutputError(f"{option} {target} holds {what} ({path}); choose another output folder")
    if target.exists() and not target.is_dir():
        raise OutputError(f"output path {target} exists and is not a folder")
    _check_checkpoint(target, option, continuing=resumable and kind == RESUMABLE_KIND)
    if not target.is_dir():
        return
    try:
        reason = why_not_replaceable(target, kind)
        empty = not any(target.iterdir())
    except OSError as err:
        raise OutputError(f"cannot read output folder {target}: {err.strerror or err}") from None
    if reason is not None:
        raise OutputError(
            f"output folder {target} is not {KINDS[kind].name} ({reason}); --overwrite replaces only "
            f"{KINDS[kind].name}, so choose another {option}"
        )
    if not empty and not overwrite:
        raise OutputError(f"output folder {target} holds {KINDS[kind].name}; pass --overwrite to replace it")


RESUMABLE_KIND = "report"  # the only kind a run checkpoints (analyze --resume)


def checkpoint_of(target: Path) -> Path:
    """Where a resumable run into `target` keeps its checkpoint."""
    return target.parent / f".{target.name}.partial"


def _check_checkpoint(target: Path, option: str, *, continuing: bool) -> None:
    """A checkpoint belongs to the run that wrote it: only the same command with --resume continues it (and
    consumes it when it publishes). Any other run into that folder name is refused, saying what is there, instead
    of replacing or deleting hours of measuring."""
    checkpoint = checkpoint_of(target)
    if continuing or not (checkpoint.is_dir() and _ours(checkpoint, target) and _holds_work(checkpoint)):
        return
    raise OutputError(
        f"{checkpoint} holds the checkpoint of an interrupted `headscope analyze --resume` run into {target}; "
        f"continue it (the same command with --resume), delete that folder, or choose another {option}"
    )


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends: renames that must happen together (the old folder out, the new
    one in; a set of files replaced in place) are never cut between two of them."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):  # pragma: no cover - no pthreads (Windows)
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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


def _mark(folder: Path, target: Path) -> None:
    """Say in `folder` that this process made it, as work for `target`."""
    (folder / MARKER).write_text(json.dumps({"target": target.name, "pid": os.getpid()}))


def _lock_marker(folder: Path) -> int | None:
    """Lock `folder`'s marker for as long as the returned descriptor is open: the folder is in use."""
    if fcntl is None:  # pragma: no cover
        return None
    descriptor = os.open(folder / MARKER, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        raise OutputError(f"another headscope run is using {folder}; wait for it to finish") from None
    return descriptor


def _ours(folder: Path, target: Path) -> bool:
    """Does `folder`'s marker prove headscope made it as work for `target`?"""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("target") == target.name


def _held(folder: Path) -> bool:
    """Is the work folder `folder` in use by a live run (its marker locked)?"""
    if fcntl is None:  # pragma: no cover
        return True  # cannot tell: leave it alone
    try:
        descriptor = os.open(folder / MARKER, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(descriptor)
    return False


class StagedDirectory:
    """Use as a context manager; write into `.path`, which becomes `target` on a clean exit.

    Everything that can be checked about the target is checked in the constructor, before any work.
    `cleaned` lists the leftovers of killed runs that entering removed (for the caller to report).
    """

    def __init__(
        self,
        target: Path,
        *,
        kind: str,
        overwrite: bool = False,
        resumable: bool = False,
        protected: Mapping[str, Path] | None = None,
    ) -> None:
        """kind: what the folder will be (layout.KINDS); resumable: the work folder has a fixed name and survives
        a failed or interrupted run, so that a later run can continue from the checkpoint inside it."""
        self.target = resolved(target)
        self.kind, self.overwrite, self.resumable = kind, overwrite, resumable
        check_target(self.target, kind=kind, overwrite=overwrite, protected=protected, resumable=resumable)
        self.path = checkpoint_of(self.target) if resumable else self._work(f"staging-{os.getpid()}")
        self.cleaned: list[str] = []
        self._lock: int | None = None

    def _work(self, suffix: str) -> Path:
        return self.target.parent / f".{self.target.name}.{suffix}"

    def __enter__(self) -> StagedDirectory:
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with _folder_lock(parent):
                self._remove_stale()
                busy = [p for p in self._leftovers() if p != self.path and _held(p)]
                if busy or (self.path.is_dir() and _held(self.path)):
                    raise OutputError(
                        f"another headscope run is writing {self.target} (its work folder {(busy or [self.path])[0]} "
                        f"is in use); wait for it to finish or choose another {KINDS[self.kind].option}"
                    )
                if self.path.exists() and not (self.path.is_dir() and _ours(self.path, self.target)):
                    raise OutputError(f"{self.path} is in the way and headscope did not make it; move it away")
                if not self.resumable:
                    shutil.rmtree(self.path, ignore_errors=True)
                self.path.mkdir(exist_ok=True)
                self._lock = self._take_lock()
        except OSError as err:
            raise OutputError(f"cannot create the output folder in {parent}: {err.strerror or err}") from None
        return self

    def _leftovers(self) -> list[Path]:
        """Folders beside the target named like headscope's work folders for it (matched as plain strings)."""
        prefix = f".{self.target.name}."
        return [
            entry
            for entry in self.target.parent.iterdir()
            if entry.name.startswith(prefix) and _WORK_SUFFIX.fullmatch(entry.name[len(prefix) :])
        ]

    def _remove_stale(self) -> None:
        """Remove work folders of runs that are gone (killed, or their machine rebooted), when their marker
        proves headscope made them for this target. A checkpoint (.partial) stays: --resume may want it."""
        for folder in self._leftovers():
            if folder.name.endswith(".partial") or folder == self.path:
                continue
            if folder.is_dir() and not folder.is_symlink() and _ours(folder, self.target) and not _held(folder):
                shutil.rmtree(folder, ignore_errors=True)
                self.cleaned.append(str(folder))

    def _take_lock(self) -> int | None:
        _mark(self.path, self.target)
        return _lock_marker(self.path)

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
        refused = disk_refusal(exc) if exc is not None else None
        if refused is not None:  # a full disk while writing (any library's error): one line, nothing published
            raise OutputError(f"cannot write {self.target}: {refused}; nothing there was changed") from None

    def _publish(self) -> None:
        parent = self.target.parent
        old = self._work(f"old-{os.getpid()}")
        with _folder_lock(parent), _signals_held():
            # What held when the run started may not hold now (another run published meanwhile): check again.
            try:
                check_target(self.target, kind=self.kind, overwrite=self.overwrite, resumable=self.resumable)
            except OutputError as err:
                shutil.rmtree(self.path, ignore_errors=True)
                raise OutputError(f"{err} (it changed while this run was working; nothing was written)") from None
            with contextlib.suppress(FileNotFoundError):
                (self.path / MARKER).unlink()  # not part of the output; the open descriptor keeps the lock
            try:
                if self.overwrite and self.target.exists():
                    os.rename(self.target, old)
                    _mark(old, self.target)  # the replaced folder is ours now: a later run may clean it up
                # Without overwrite this rename is the atomic "still empty?" test: it fails on a folder that
                # is not empty, whoever filled it.
                os.rename(self.path, self.target)
            except OSError as err:
                if old.exists() and not self.target.exists():
                    os.rename(old, self.target)
                    _remove_quietly(self.target / MARKER)
                shutil.rmtree(self.path, ignore_errors=True)
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputError(
                        f"output folder {self.target} was filled by another run while this one was working; "
                        "that one was kept (pass --overwrite to replace it)"
                    ) from None
                raise OutputError(f"cannot move the new output into {self.target}: {err.strerror}") from None
            shutil.rmtree(old, ignore_errors=True)


def _holds_work(folder: Path) -> bool:
    """Does a checkpoint folder hold anything worth resuming from (more than its marker)?"""
    return any(entry.name != MARKER for entry in folder.iterdir()) if folder.is_dir() else False


@contextlib.contextmanager
def replacing_files(folder: Path) -> Iterator[Path]:
    """Rewrite files of an existing headscope folder in place (plot and classify without --out): yield a hidden
    work folder beside it to write them into; when the block succeeds each file is moved into `folder`, with
    Ctrl-C held off while they move, so the folder holds all the old files or all the new ones, never a mix; when
    it fails (or is interrupted) nothing in `folder` changes. Its marker lets a later run clean it up if killed."""
    folder = resolved(folder)
    work = folder.parent / f".{folder.name}.staging-{os.getpid()}"
    try:
        with _folder_lock(folder.parent):
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            _mark(work, folder)
            lock = _lock_marker(work)
    except OSError as err:
        raise OutputError(f"cannot write beside {folder}: {err.strerror or err}") from None
    try:
        yield work
        with _signals_held():
            for path in sorted(work.iterdir()):
                if path.name != MARKER:
                    os.replace(path, folder / path.name)
    except Exception as err:
        refused = disk_refusal(err) or (err.strerror if isinstance(err, OSError) else None)
        if refused is None:
            raise
        raise OutputError(f"cannot write into {folder}: {refused}; nothing there was changed") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if lock is not None:
            os.close(lock)
