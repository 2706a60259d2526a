"""Output folders: all files appear together or not at all, and only what headscope made is ever replaced.

A command writes into a hidden work folder beside its target and renames it into place at the end, so an
interrupted or failed run never leaves a half-written folder, and a previous one stays intact until the new one
is complete. The rules, each checked before any work starts and again, atomically, when the folder is published:

- the target is resolved first (a symlink is followed: the link keeps pointing at the new folder);
- it may not be the current folder, one holding it, or one holding an input (the model, the corpus, a report);
- an existing, non-empty target is replaced only with `overwrite`, and only when it is a headscope folder of
  the kind the command writes (`why_not_replaceable`, over registry.py's kinds): a folder holding anything else is
  never deleted;
- every work folder headscope makes holds a marker naming the run that made it (and locked while it lives); a
  later run removes leftovers beside its target only when their marker proves headscope made them for that
  target and their run is gone, and never finds them by a pattern built from the target's name;
- publishing takes a lock on the parent folder, so two runs into one target cannot both win: without
  `overwrite` the loser's rename fails because the folder is no longer empty, and it says so;
- a `--resume` checkpoint beside the target belongs to its run: only the same command with --resume takes it;
- the path itself must be usable: no symlink loop, no file on the way, a name short enough for the work folder's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from headscope.errors import OutputError
from headscope.files import (
    MARKER,
    disk_refusal,
    folder_lock,
    held,
    holds_work,
    lock_marker,
    mark,
    ours,
    raise_noted_signal,
    remove_quietly,
    signals_held,
)
from headscope.layout import CIRCUIT_PATCHED, CIRCUIT_RECORD, CIRCUIT_SCORES, PRUNE_JOURNAL, PRUNE_RECORD
from headscope.registry import kinds, resumable_kinds

_WORK_SUFFIX = re.compile(r"(staging|old)-\d+|partial")  # .<target>.<suffix>


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
    option = kinds()[kind].option
    try:
        _check_target(target, kind, option, overwrite, protected, resumable)
    except OSError as err:  # a name too long, a folder that cannot be read: one line naming the option's path
        raise OutputError(f"{option} {target}: {err.strerror or err}") from None


def _check_target(target: Path, kind: str, option: str, overwrite: bool, protected, resumable: bool) -> None:
    if target.parent == target:  # first: the root has no parent to look for, nor a name
        raise OutputError(f"{option} {target} is the root of the file system; name a folder for the output")
    existing = next(path for path in target.parents if path.exists())
    if not existing.is_dir():
        raise OutputError(f"{option} {target} lies under {existing}, which is a file, not a folder")
    name_max = os.pathconf(target.parent, "PC_NAME_MAX") if target.parent.is_dir() else 255
    if len(os.fsencode(target.name)) + _WORK_NAME_EXTRA > name_max:
        raise OutputError(
            f"{option} names a folder whose name has {len(os.fsencode(target.name))} bytes; headscope needs "
            f"{_WORK_NAME_EXTRA} more for its work folder beside it (at most {name_max}): choose a shorter name"
        )
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
    _check_checkpoint(target, option, kind, continuing=resumable and kind in resumable_kinds())
    if not target.is_dir():
        return
    try:
        reason = why_not_replaceable(target, kind)
        empty = not any(target.iterdir())
    except OSError as err:
        raise OutputError(f"cannot read output folder {target}: {err.strerror or err}") from None
    name = kinds()[kind].name
    if reason is not None:
        raise OutputError(
            f"output folder {target} is not {name} ({reason}); --overwrite replaces only {name}, so choose another "
            f"{option}"
        )
    if not empty and not overwrite:
        raise OutputError(f"output folder {target} holds {name}; pass --overwrite to replace it")


# the files that say which command's checkpoint a work folder is (none of these: analyze's)
CHECKPOINT_OWNERS = {
    "prune": (PRUNE_JOURNAL, PRUNE_RECORD),
    "circuit": (CIRCUIT_SCORES, CIRCUIT_PATCHED, CIRCUIT_RECORD),
}
_KEPT: list[Path] = []  # checkpoints this process's failed or interrupted runs left for --resume


def kept_checkpoints() -> list[Path]:
    """The checkpoints this process's failed or interrupted runs kept (for the message that says so)."""
    return list(_KEPT)


def checkpoint_of(target: Path) -> Path:
    """Where a resumable run into `target` keeps its checkpoint."""
    return target.parent / f".{target.name}.partial"


def _check_checkpoint(target: Path, option: str, kind: str, *, continuing: bool) -> None:
    """A checkpoint belongs to the run that wrote it: only the same command with --resume continues it (and
    consumes it when it publishes). Any other run into that folder name is refused, saying what is there, instead
    of replacing or deleting hours of measuring."""
    checkpoint = checkpoint_of(target)
    if not (checkpoint.is_dir() and ours(checkpoint, target) and holds_work(checkpoint)):
        return
    # prune's checkpoint is its search's journal (its record, once it publishes); circuit's its scores and patched
    # sets (its record); analyze's are part files and sums
    owner = next((command for command, names in CHECKPOINT_OWNERS.items()
                  if any((checkpoint / name).exists() for name in names)), "analyze")  # fmt: skip
    if continuing and owner == resumable_kinds()[kind]:
        return
    raise OutputError(
        f"{checkpoint} holds the checkpoint of an interrupted `headscope {owner}` run into {target}; "
        f"continue it (the same command with --resume), delete that folder, or choose another {option}"
    )


def kind_of(folder: Path) -> str | None:
    """The kind of headscope folder `folder` is, by the record file in it (None: none of them)."""
    for name, kind in kinds().items():
        if (folder / kind.record).is_file():
            return name
    return None


def why_not_replaceable(folder: Path, kind: str) -> str | None:
    """None when `folder` is empty, or a headscope folder of `kind` holding only files that kind writes;
    otherwise what makes it something else (for a message: "--out X is not ... (REASON)")."""
    entries = sorted(folder.iterdir())
    if not entries:
        return None
    found = kind_of(folder)
    if found is not None and found != kind:
        return f"it holds {kinds()[found].name}, and this command writes {kinds()[kind].name}"
    wanted = kinds()[kind]
    foreign = [entry.name for entry in entries if entry.is_symlink() or not entry.is_file()]
    foreign += [entry.name for entry in entries if entry.is_file() and not wanted.holds(entry.name)]
    if foreign:
        shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
        return f"it holds files headscope did not write ({shown})"
    record = folder / wanted.record
    if not record.is_file():
        return f"it has no {wanted.record}"
    try:
        content = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"its {wanted.record} is unreadable"
    if not isinstance(content, dict):
        return f"its {wanted.record} was not written by headscope"
    versions = content.get("versions") if isinstance(content.get("versions"), dict) else {}
    # Reports from before schema_version existed carry headscope's version instead.
    if not ("schema_version" in content or "headscope" in versions):
        return f"its {wanted.record} was not written by headscope"
    return None


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
        continuing: bool | None = None,
        protected: Mapping[str, Path] | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        """kind: what the folder will be (registry.kinds()); resumable: the work folder has a fixed name and survives
        a failed or interrupted run, so that a later run can continue from the checkpoint inside it; continuing:
        this run may take such a checkpoint (default: `resumable`; otherwise one left there is refused); notify(text):
        told of each leftover of a killed run that entering removes (the command's reporter's note)."""
        self.target = resolved(target)
        self.kind, self.overwrite, self.resumable = kind, overwrite, resumable
        self.continuing = resumable if continuing is None else continuing
        check_target(self.target, kind=kind, overwrite=overwrite, protected=protected, resumable=self.continuing)
        self.path = checkpoint_of(self.target) if resumable else self._work(f"staging-{os.getpid()}")
        self.cleaned: list[str] = []
        self._notify = notify
        self._lock: int | None = None

    def _work(self, suffix: str) -> Path:
        return self.target.parent / f".{self.target.name}.{suffix}"

    def __enter__(self) -> StagedDirectory:
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            with folder_lock(parent):
                self._remove_stale()
                busy = [p for p in self._leftovers() if p != self.path and held(p)]
                if busy or (self.path.is_dir() and held(self.path)):
                    raise OutputError(
                        f"another headscope run is writing {self.target} (its work folder {(busy or [self.path])[0]} "
                        f"is in use); wait for it to finish or choose another {kinds()[self.kind].option}"
                    )
                if self.path.exists() and not (self.path.is_dir() and ours(self.path, self.target)):
                    raise OutputError(f"{self.path} is in the way and headscope did not make it; move it away")
                if not self.resumable:
                    shutil.rmtree(self.path, ignore_errors=True)
                self.path.mkdir(exist_ok=True)
                self._lock = self._take_lock()
        except OSError as err:
            raise OutputError(f"cannot create the output folder in {parent}: {err.strerror or err}") from None
        if self._notify is not None:
            for removed in self.cleaned:
                self._notify(f"removed {removed}, left behind by an interrupted run")
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
            if folder.is_dir() and not folder.is_symlink() and ours(folder, self.target) and not held(folder):
                shutil.rmtree(folder, ignore_errors=True)
                self.cleaned.append(str(folder))

    def _take_lock(self) -> int | None:
        mark(self.path, self.target)
        return lock_marker(self.path)

    def _release_lock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                try:
                    raise_noted_signal()  # a signal whose exception a finalizer swallowed: the run was stopped
                except BaseException:
                    self._abandon()
                    raise
                self._publish()
            else:
                self._abandon()
        finally:
            self._release_lock()
        refused = disk_refusal(exc) if exc is not None else None
        if refused is not None:  # a full disk while writing (any library's error): one line, nothing published
            raise OutputError(f"cannot write {self.target}: {refused}; nothing there was changed") from None

    def _abandon(self) -> None:
        """The run did not finish: its work folder removed, or kept for --resume where it holds work."""
        if not self.resumable or not holds_work(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            _KEPT.append(self.path)

    def _publish(self) -> None:
        parent = self.target.parent
        old = self._work(f"old-{os.getpid()}")
        with folder_lock(parent), signals_held():
            # What held when the run started may not hold now (another run published meanwhile): check again.
            try:
                # (the checkpoint beside the target is now this run's own work folder)
                check_target(self.target, kind=self.kind, overwrite=self.overwrite, resumable=self.resumable)
            except OutputError as err:
                shutil.rmtree(self.path, ignore_errors=True)
                raise OutputError(f"{err} (it changed while this run was working; nothing was written)") from None
            with contextlib.suppress(FileNotFoundError):
                (self.path / MARKER).unlink()  # not part of the output; the open descriptor keeps the lock
            try:
                if self.overwrite and self.target.exists():
                    os.rename(self.target, old)
                    mark(old, self.target)  # the replaced folder is ours now: a later run may clean it up
                # Without overwrite this rename is the atomic "still empty?" test: it fails on a folder that
                # is not empty, whoever filled it.
                os.rename(self.path, self.target)
            except OSError as err:
                if old.exists() and not self.target.exists():
                    os.rename(old, self.target)
                    remove_quietly(self.target / MARKER)
                shutil.rmtree(self.path, ignore_errors=True)
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputError(
                        f"output folder {self.target} was filled by another run while this one was working; "
                        "that one was kept (pass --overwrite to replace it)"
                    ) from None
                raise OutputError(f"cannot move the new output into {self.target}: {err.strerror}") from None
            shutil.rmtree(old, ignore_errors=True)
