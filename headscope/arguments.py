"""What a user names on the command line or from Python (layers, heads, ids, sizes, texts), as values the code uses.

Text is parsed (`parse_*`: "0-5,10", "18.6,17.4", "8GiB"), Python values are checked (`as_*`: a list of (layer,
head) pairs, a list of texts), with the same rules and messages either way: whole numbers in ASCII digits only,
no negative index (Python would wrap it to the last head), no bool or float where an index goes, and every count
capped before anything is expanded. No third-party imports.
"""

from __future__ import annotations

import numbers
import os
import re
from collections.abc import Iterator

from headscope.errors import ConfigError

# Layer numbers above this are refused while parsing, before a range is expanded into a set (a range to
# 10**10 once took 12 GB); the model's real depth is checked as soon as its config is read.
MAX_LAYER = 9_999
MAX_HEAD = 9_999  # head numbers likewise (the largest models have 128 heads a layer)
MAX_INSPECT_TEXTS = 1_000  # inspect: texts (given, corpus sentences, the probe) in one run
# Whole numbers as options write them: ASCII digits only ("²" and "٣" pass str.isdigit, "1_0" passes int()).
_DIGITS = re.compile(r"[0-9]{1,18}")  # int() of 4,300 digits or more raises: cap what is read


def _whole(text: str) -> int | None:
    """The number `text` writes in ASCII digits (surrounding spaces allowed), else None."""
    text = text.strip()
    return int(text) if _DIGITS.fullmatch(text) else None


def _ranges(text: str, option: str, example: str) -> Iterator[tuple[int, int]]:
    """'0-5,10' -> (0, 5), (10, 10): each part's bounds, checked (ASCII whole numbers, low <= high)."""
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = _whole(first), _whole(last) if last else _whole(first)
        if low is None or high is None:
            raise ConfigError(f"{option} takes {example}; got {part.strip()!r}")
        if high < low:
            raise ConfigError(f"{option} range {part.strip()!r} is empty")
        yield low, high


def parse_layers(text: str) -> tuple[int, ...]:
    """'0-5,10,12-13' -> (0, 1, 2, 3, 4, 5, 10, 12, 13)."""
    layers: set[int] = set()
    for low, high in _ranges(text, "--layers", "numbers and ranges like 0-5,10"):
        if high > MAX_LAYER:
            raise ConfigError(f"--layers names layer {high}; layer numbers stop at {MAX_LAYER} (no model is that deep)")
        layers.update(range(low, high + 1))
    return tuple(sorted(layers))


def parse_heads(text: str, option: str = "--heads") -> tuple[tuple[int, int], ...]:
    """'18.6,17.4' -> ((17, 4), (18, 6)): heads written LAYER.HEAD, as every command and output writes them."""
    heads: set[tuple[int, int]] = set()
    for part in text.split(","):
        layer, dot, head = part.strip().partition(".")
        pair = (_whole(layer), _whole(head)) if dot and layer == layer.strip() and head == head.strip() else None
        if pair is None or None in pair:
            raise ConfigError(f"{option} takes heads written LAYER.HEAD, like 18.6,17.4; got {part.strip()!r}")
        heads.add(_checked_head(pair, option))
    return tuple(sorted(heads))


def head_name(layer: int, head: int) -> str:
    """(18, 6) -> '18.6'."""
    return f"{layer}.{head}"


def whole_number(value) -> bool:
    """An int (numpy's too) that is not a bool: True is not head 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def as_number(value, option: str, *, whole: bool = False) -> int | float:
    """A number given to the Python API, as the code uses it: any real number (numpy's, Decimal, Fraction) or text
    that writes one, as the CLI reads it. A float32 is taken at the decimal it shows (np.float32(0.3) is 0.3, not
    0.30000001192...). `whole`: an int is wanted (a whole float such as 3.0 is not one: a count or index is never
    written so). Bools are refused: True is not 1."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        text = value.strip()
        value = int(text) if re.fullmatch(r"[+-]?[0-9]{1,18}", text) else float(text)
    if isinstance(value, bool) or not isinstance(value, numbers.Number) or isinstance(value, complex):
        wanted = "a whole number" if whole else "a number"
        raise ConfigError(f"{option} takes {wanted}; got {value!r} ({type(value).__name__})")
    if whole:
        if not isinstance(value, numbers.Integral):
            raise ConfigError(f"{option} takes a whole number; got {value!r}")
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if type(value).__module__ == "numpy" and getattr(value, "itemsize", 8) < 8:
        return float(str(value))  # numpy prints the shortest decimal that reads back as this float32 / float16
    return float(value)


def _checked_head(pair, option: str) -> tuple[int, int]:
    layer, head = pair
    if layer > MAX_LAYER or head > MAX_HEAD:
        raise ConfigError(f"{option} names head {head_name(layer, head)}; numbers stop at {MAX_LAYER}")
    return int(layer), int(head)


def as_heads(value, option: str = "heads") -> tuple[tuple[int, int], ...]:
    """Heads given to the Python API: (layer, head) pairs of whole numbers 0 or more (or "L.H" strings), sorted and
    without repeats. Negative numbers (which Python would wrap to the last head), bools and floats are refused."""
    if isinstance(value, str):
        return parse_heads(value, option)
    columns = getattr(value, "columns", None)
    if columns is not None and {"layer", "head"} <= set(columns):  # a table of heads (heads.parquet's rows)
        value = list(zip(value["layer"], value["head"], strict=True))
    elif hasattr(value, "tolist"):  # a numpy array of (layer, head) rows
        value = value.tolist()
    try:
        pairs = list(value)
    except TypeError:
        raise ConfigError(f"{option} takes (layer, head) pairs, like [(18, 6), (17, 4)]; got {value!r}") from None
    heads = set()
    for pair in pairs:
        if isinstance(pair, str):
            heads.update(parse_heads(pair, option))
            continue
        items = tuple(pair) if isinstance(pair, tuple | list) else None
        if items is None or len(items) != 2 or not all(whole_number(x) for x in items):
            raise ConfigError(f"{option} takes (layer, head) pairs of whole numbers, like (18, 6); got {pair!r}")
        if min(items) < 0:
            raise ConfigError(f"{option} names head {head_name(*items)}; layers and heads count from 0")
        heads.add(_checked_head(items, option))
    return tuple(sorted(heads))


def as_head_groups(value, option: str = "heads") -> list[tuple[tuple[int, int], ...]]:
    """Groups of heads (each removed together) given to the Python API: a list of lists of (layer, head) pairs.
    A flat list of pairs is refused: it could mean one group or one group per head."""
    if hasattr(value, "tolist") and not isinstance(value, str):  # a numpy array of groups
        value = value.tolist()
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(f"{option} takes a list of groups of (layer, head) pairs, like [[(18, 6), (17, 4)]]; "
                          f"got {value!r}")  # fmt: skip
    if value and all(isinstance(g, tuple | list) and len(g) == 2 and all(map(whole_number, g)) for g in value):
        raise ConfigError(
            f"{option} takes groups of heads: [{list(value)!r}] removes them together, "
            f"{[[tuple(g)] for g in value]!r} one at a time"
        )
    groups = [as_heads(group, option) for group in value]
    if any(not group for group in groups):
        raise ConfigError(f"{option} names a group with no head")
    return groups


def as_path(value, option: str):
    """A path given to the Python API (a str or os.PathLike), or None: anything else is refused naming the option."""
    if value is None or isinstance(value, str | os.PathLike):
        return value
    raise ConfigError(f"{option} takes a path (a str or pathlib.Path); got {value!r}")


def as_texts(value, option: str) -> tuple[str, ...]:
    """Texts or names given to the Python API: one string is one item (never its characters), else a list of
    strings."""
    if isinstance(value, str):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"{option} takes a string or a list of strings; got {value!r}") from None
    wrong = [item for item in items if not isinstance(item, str)]
    if wrong:
        raise ConfigError(f"{option} takes a string or a list of strings; got {wrong[0]!r} in it")
    return items


def as_ids(value, option: str, limit: int = MAX_INSPECT_TEXTS) -> tuple[int, ...]:
    """Ids given to the Python API: whole numbers 0 or more (or text the CLI takes, "0,5,10-12"), in order,
    without repeats."""
    if isinstance(value, str):
        return parse_ids(value, option, limit)
    try:
        items = list(value)
    except TypeError:
        raise ConfigError(f"{option} takes ids (whole numbers 0 or more); got {value!r}") from None
    wrong = [item for item in items if not whole_number(item) or item < 0]
    if wrong:
        raise ConfigError(f"{option} takes ids (whole numbers 0 or more); got {wrong[0]!r}")
    ids = tuple(dict.fromkeys(int(item) for item in items))
    if len(ids) > limit:
        raise ConfigError(f"{option} names more than {limit:,} ids")
    return ids


def parse_ids(text: str, option: str, limit: int = MAX_INSPECT_TEXTS) -> tuple[int, ...]:
    """'0,5,10-12' -> (0, 5, 10, 11, 12): ids, in the order given (repeats dropped), at most `limit` of them
    (refused as soon as the parts name more, before any range is expanded)."""
    ids: dict[int, None] = {}
    for low, high in _ranges(text, option, "ids and ranges like 0,5,10-12"):
        if high - low >= limit:  # checked before the range is expanded
            raise ConfigError(f"{option} names more than {limit:,} ids")
        ids.update(dict.fromkeys(range(low, high + 1)))
        if len(ids) > limit:
            raise ConfigError(f"{option} names more than {limit:,} ids")
    return tuple(ids)


def parse_batch_size(text: str) -> int | None:
    """'auto' -> None (sized from the memory budget); '16' -> 16."""
    if text.strip().lower() == "auto":
        return None
    number = _whole(text)
    if number is None or number < 1:
        raise ConfigError(f"--batch-size takes a whole number of 1 or more, or auto; got {text!r}")
    return number


def parse_bytes(text: str) -> int:
    """'8GiB', '512MB', '2g', '1000000' -> bytes (binary units either way)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text.lower())
    if not match:
        raise ConfigError(f"--max-memory takes a size like 8GiB or 512MiB; got {text!r}")
    number, unit = float(match.group(1)), match.group(2)
    return int(number * 1024 ** " kmgt".index(unit or " "))
