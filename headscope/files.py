"""Files written so that no reader ever sees half of them, and the work folders they are staged in.

- one file: written under a temporary sibling name, then renamed (`atomic_path`);
- files of an existing headscope folder rewritten in place (plot, classify): written into a work folder beside
  it, then moved in together with Ctrl-C held off (`replacing_files`);
- every work folder holds a marker naming the run that made it, locked while that run lives (`mark`,
  `lock_marker`, `ours`, `held`), so that a later run removes only what a dead headscope run left;
- a write the file system refuses (a full disk, a file size limit, a read-only mount), whichever library met it,
  is recognised (`disk_refusal`) and reported in one line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

from headscope.errors import HeadscopeError, OutputError

try:  # POSIX only; elsewhere runs are not protected from each other, which docs/output.md says
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

MARKER = ".headscope-work"  # in every work folder: which run made it, for which target; locked while it lives


def cache_folder() -> Path:
    """Where headscope keeps what it computed once per model: $HEADSCOPE_CACHE, else $XDG_CACHE_HOME/headscope,
    else ~/.cache/headscope."""
    if os.environ.get("HEADSCOPE_CACHE"):
        return Path(os.environ["HEADSCOPE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "headscope"


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
        remove_quietly(tmp)
        raise OutputError(f"cannot write {path}: {err.strerror or err}") from None
    except BaseException:
        remove_quietly(tmp)
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


def remove_quietly(path: Path) -> None:
    # Cleanup must never replace the error being reported (on a read-only mount, unlink fails too).
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


# A signal handler's exception can be lost: raised while a finalizer (`__del__`) runs, Python prints "Exception
# ignored in ..." and carries on (a SIGTERM that arrived while the `regex` package collected a compiled pattern let a
# terminated analyze run to its end and publish, exit 0). The CLI's handlers note each signal here as they raise it;
# `signals_held`, entered before anything is published or replaced, raises a noted one again.
_NOTED: list[type[BaseException]] = []


def note_signal(error: type[BaseException]) -> None:
    """A signal handler is raising `error` (KeyboardInterrupt, the CLI's Terminated)."""
    _NOTED.append(error)


def forget_signals() -> None:
    """The noted signals were handled (their exception reached the command's handler)."""
    _NOTED.clear()


def raise_noted_signal() -> None:
    """Raise a signal's exception again, if one was noted and not handled (a finalizer swallowed it)."""
    if _NOTED:
        error = _NOTED[-1]
        _NOTED.clear()
        raise error


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends: renames that must happen together (the old folder out, the new
    one in; a set of files replaced in place) are never cut between two of them. A signal noted but lost before the
    block (`raise_noted_signal`) stops it from starting."""
    raise_noted_signal()
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
def folder_lock(folder: Path) -> Iterator[None]:
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


def mark(folder: Path, target: Path) -> None:
    """Say in `folder` that this process made it, as work for `target`."""
    (folder / MARKER).write_text(json.dumps({"target": target.name, "pid": os.getpid()}))


def lock_marker(folder: Path) -> int | None:
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


def ours(folder: Path, target: Path) -> bool:
    """Does `folder`'s marker prove headscope made it as work for `target`?"""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("target") == target.name


def held(folder: Path) -> bool:
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


def holds_work(folder: Path) -> bool:
    """Does a checkpoint folder hold anything worth resuming from (more than its marker)?"""
    return any(entry.name != MARKER for entry in folder.iterdir()) if folder.is_dir() else False


@contextlib.contextmanager
def replacing_files(folder: Path) -> Iterator[Path]:
    """Rewrite files of an existing headscope folder in place (plot and classify without --out): yield a hidden
    work folder beside it to write them into; when the block succeeds each file is moved into `folder`, with
    Ctrl-C held off while they move, so the folder holds all the old files or all the new ones, never a mix; when
    it fails (or is interrupted) nothing in `folder` changes. Its marker lets a later run clean it up if killed."""
    folder = Path(folder).resolve()
    work = folder.parent / f".{folder.name}.staging-{os.getpid()}"
    try:
        with folder_lock(folder.parent):
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            mark(work, folder)
            lock = lock_marker(work)
    except OSError as err:
        raise OutputError(f"cannot write beside {folder}: {err.strerror or err}") from None
    try:
        yield work
        with signals_held():
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
