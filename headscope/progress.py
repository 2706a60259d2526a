"""Progress reporting, the contract: the library only calls a Reporter; the CLI and notebooks decide how it looks
(headscope.run.progress: the terminal's bar and log lines, the notebook's display).

``NullReporter`` says nothing. ``printable`` is how any reporter shows text that came from data.
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

    def start(self, total_sentences: int, what: str = "measuring", unit: str = "sentences") -> None:
        """A pass (`what`: measuring, importance...) starts over `total_sentences` sentences (or other `unit`s: patch
        counts patched runs, one pair with one head patched)."""

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

    def start(self, total_sentences: int, what: str = "measuring", unit: str = "sentences") -> None:
        pass

    def advance(self, sentences: int, tokens: int) -> None:
        pass

    def finish(self) -> None:
        pass
