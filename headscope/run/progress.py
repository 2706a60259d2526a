"""How progress looks: ``RichReporter`` (the CLI's) draws a progress bar on stderr when it is a terminal; otherwise
(nohup, CI, a pipe) it writes log lines: one per stage, and one per tenth of a long pass with its rate and an
estimate of the time left. In a Jupyter kernel the library's default is ``NotebookReporter``: one display that
updates in place; elsewhere it is ``headscope.progress.NullReporter`` (silent). The contract, ``Reporter``, is
headscope.progress.
"""

from __future__ import annotations

import time

from headscope.progress import NullReporter, Reporter, printable


class RichReporter:
    """A rich progress bar on a terminal (sentences done, tokens per second, time left); log lines elsewhere."""

    def __init__(self, console=None, steps: int = 10) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self._progress = None
        self._task = None
        self._log = None  # off a terminal: the pass being logged
        self._tokens = 0
        self._steps = steps

    def _line(self, text: str, style: str | None = None) -> None:
        self.console.print(printable(text), style=style, markup=False, highlight=False, soft_wrap=True)

    def _stamped(self, text: str) -> None:
        """A log line off a terminal: the wall-clock time, then the text."""
        self._line(f"{time.strftime('%H:%M:%S')} {text}")

    def stage(self, message: str) -> None:
        if self.console.is_terminal:
            self._line(message, style="dim")
        else:
            self._stamped(message)

    def note(self, message: str) -> None:
        self._line(f"note: {message}")

    def warn(self, message: str) -> None:
        self._line(f"warning: {message}")

    def start(self, total_sentences: int, what: str = "measuring", unit: str = "sentences") -> None:
        if not self.console.is_terminal:
            self._log = _PassLog(what, total_sentences, self._steps, unit=unit)
            self._stamped(f"{what}: {total_sentences:,} {unit}")
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn(printable(what), markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(printable(unit), markup=False),
            TextColumn("{task.fields[rate]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("measure", total=total_sentences, rate="-")
        self._tokens = 0

    def advance(self, sentences: int, tokens: int) -> None:
        if self._log is not None:
            line = self._log.advance(sentences, tokens)
            if line:
                self._stamped(line)
            return
        if self._progress is None:
            return
        self._tokens += tokens
        elapsed = self._progress.tasks[0].elapsed or 0.0
        rate = f"{self._tokens / elapsed:,.0f}" if elapsed > 0 else "-"
        self._progress.update(self._task, advance=sentences, rate=rate)

    def finish(self) -> None:
        self._log = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class _PassLog:
    """A pass's progress as log lines: one each time another 1/steps of the sentences is done."""

    def __init__(self, what: str, total: int, steps: int, clock=time.monotonic, unit: str = "sentences") -> None:
        self.what, self.total, self.steps, self.clock, self.unit = what, total, steps, clock, unit
        self.started = clock()
        self.done = self.tokens = self.logged = 0

    def advance(self, sentences: int, tokens: int) -> str | None:
        self.done += sentences
        self.tokens += tokens
        step = self.done * self.steps // self.total if self.total else self.steps
        if step <= self.logged:
            return None
        self.logged = step
        elapsed, rate, left = self.pace()
        return (
            f"{self.what}: {100 * self.done // max(self.total, 1)}% ({self.done:,}/{self.total:,} {self.unit}), "
            f"{'-' if rate is None else f'{rate:,.0f}'} tokens/s, {_duration(elapsed)} elapsed, "
            f"about {_duration(left or 0.0)} left"
        )

    def pace(self) -> tuple[float, float | None, float | None]:
        """(seconds elapsed, tokens per second, seconds left at this rate) so far; None where not known yet."""
        elapsed = self.clock() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else None
        left = elapsed * (self.total - self.done) / self.done if self.done else None
        return elapsed, rate, left


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class NotebookReporter:
    """In a Jupyter kernel: one display that updates in place (IPython's display ids, no widget library), showing
    the current stage, the pass's bar (done of total, tokens/s, time left) and the notes and warnings so far.
    Updates are throttled to one per `interval` seconds; the last state is always drawn."""

    def __init__(self, interval: float = 0.25, clock=time.monotonic) -> None:
        from headscope.model.once import QUIET

        QUIET["bars"] = True  # this display is the cell's progress: transformers' own bars stay out of it
        self.interval, self.clock = interval, clock
        self._handle = None
        self._drawn = -float("inf")
        self._stage = ""
        self._lines: list[tuple[str, str]] = []  # (kind, text): notes and warnings
        self._pass: _PassLog | None = None

    def stage(self, message: str) -> None:
        self._stage, self._pass = message, None
        self._draw(force=True)

    def note(self, message: str) -> None:
        self._lines.append(("note", message))
        self._draw(force=True)

    def warn(self, message: str) -> None:
        self._lines.append(("warning", message))
        self._draw(force=True)

    def start(self, total_sentences: int, what: str = "measuring", unit: str = "sentences") -> None:
        self._pass = _PassLog(what, total_sentences, 1, clock=self.clock, unit=unit)
        self._draw(force=True)

    def advance(self, sentences: int, tokens: int) -> None:
        if self._pass is not None:
            self._pass.advance(sentences, tokens)
            self._draw()

    def finish(self) -> None:
        self._draw(force=True)

    def html(self) -> str:
        """What the display shows now."""
        from headscope.report.notebook import progress

        bar, detail = None, ""
        if self._pass is not None:
            done, total = self._pass.done, self._pass.total
            _, rate, left = self._pass.pace()
            rate = f"{rate:,.0f} tokens/s" if rate is not None and self._pass.tokens else ""
            left = f"about {_duration(left)} left" if left is not None and done < total else ""
            bar = (done, total, f"{self._pass.what}: {done:,}/{total:,} {self._pass.unit}")
            detail = f"{rate} {left}".strip()
        return progress(self._stage, bar, detail, self._lines)

    def _draw(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._drawn < self.interval:
            return
        self._drawn = now
        from IPython.display import HTML, display

        if self._handle is None:
            self._handle = display(HTML(self.html()), display_id=True)
        else:
            self._handle.update(HTML(self.html()))


def in_notebook() -> bool:
    """Is this a Jupyter kernel (where a display can update in place)?"""
    import sys

    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def default_reporter() -> Reporter:
    """What a library call reports to when given no reporter: one updating display in a notebook, else nothing."""
    return NotebookReporter() if in_notebook() else NullReporter()
