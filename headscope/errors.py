"""Exceptions a user can act on.

The CLI prints ``Error: <message>`` and exits 1 for every ``HeadscopeError``;
anything else is a bug and is allowed to show its traceback.
"""


class HeadscopeError(Exception):
    """Base class: the message is one line naming what is wrong and what to do."""


class CorpusError(HeadscopeError):
    """The corpus cannot be read or holds no usable sentence."""


class ModelLoadError(HeadscopeError):
    """The model or tokenizer cannot be found, loaded or used for attention capture."""


class OutputError(HeadscopeError):
    """The output folder or one of its files cannot be written or read."""


class ConfigError(HeadscopeError):
    """An option has a value outside what it accepts."""


class ResourceError(HeadscopeError):
    """The run needs more memory (or disk) than there is."""


def one_line(error: BaseException) -> str:
    """An exception as one line: its message's first line, or its type when it has none."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
