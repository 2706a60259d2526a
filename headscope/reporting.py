"""Progress reporting. The library only calls a Reporter; the CLI decides how it looks.

``NullReporter`` is the library default (silent). ``RichReporter`` draws a
progress bar on stderr and stays quiet when stderr is not a terminal.
"""

from __future__ import annotations

import re
from typing import Protocol

# C0 and C1 control characters and DEL: a model's config or a file name can hold terminal escape sequences.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` safe to print on a terminal: control characters written as escapes (ESC as \\x1b), never sent raw."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], str(text))


class Reporter(Protocol):
    def stage(self, message: str) -> None:
        """A step without a measurable size has started (loading, writing...)."""

    def note(self, message: str) -> None:
        """Something the user should hear about even when not watching progress (cleaned-up leftovers...)."""

    def warn(self, message: str) -> None:
        """Something went wrong that did not stop the run (a chart that could not be drawn...)."""

    def start(self, total_sentences: int) -> None:
        """Measuring starts over `total_sentences` sentences."""

    def advance(self, sentences: int, tokens: int) -> None:
        """`sentences` more sentences (with `tokens` tokens) are measured."""

    def finish(self) -> None:
        """Measuring is over."""


class NullReporter:
    def stage(self, message: str) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        pass

    def start(self, total_sentences: int) -> None:
        pass

    def advance(self, sentences: int, tokens: int) -> None:
        pass

    def finish(self) -> None:
        pass


class RichReporter:
    """A rich progress bar: sentences done, tokens per second, time left."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self._progress = None
        self._task = None
        self._tokens = 0

    def stage(self, message: str) -> None:
        if self.console.is_terminal:
            self.console.print(printable(message), style="dim", markup=False, highlight=False, soft_wrap=True)

    def note(self, message: str) -> None:
        self.console.print(f"note: {printable(message)}", markup=False, highlight=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        self.console.print(f"warning: {printable(message)}", markup=False, highlight=False, soft_wrap=True)

    def start(self, total_sentences: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("measuring"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("sentences"),
            TextColumn("{task.fields[rate]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("measure", total=total_sentences, rate="-")
        self._tokens = 0

    def advance(self, sentences: int, tokens: int) -> None:
        if self._progress is None:
            return
        self._tokens += tokens
        elapsed = self._progress.tasks[0].elapsed or 0.0
        rate = f"{self._tokens / elapsed:,.0f}" if elapsed > 0 else "-"
        self._progress.update(self._task, advance=sentences, rate=rate)

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
