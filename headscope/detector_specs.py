"""Detectors as the user defines them (see headscope.measures.detectors for what each family targets and how it
is scored): names, SPECs and callables checked, torch-free (the settings hold them)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from headscope.errors import ConfigError

FAMILIES = ("offset:K", "same-token", "after-same-token", "token:REGEX", "first", "far:S,W")
MODES = ("mul", "abs")
# Exemplar kinds of headscope's own (measures.exemplars: sharp, write and the probes' patterns) and its own detector
# (far_mass, run.head_evidence): no detector's name.
RESERVED = ("sharp", "write", "induction", "duplicate", "previous", "far_mass")
NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


@dataclass(frozen=True)
class Detector:
    """One detector: its name (a column `detect_<name>`), and its family and parameter or its callable."""

    name: str
    family: str  # offset, same-token, after-same-token, token, first, far, callable
    parameter: int | str | tuple[int, int] | None = None  # K of offset, REGEX of token, (S, W) of far
    pattern: Callable | None = field(default=None, compare=False)  # tokens -> (T, T), for family "callable"
    mode: str = "mul"  # how a callable's pattern is scored

    @property
    def spec(self) -> str:
        """The SPEC that defines it (a callable: its module and name, and its mode), as run.json records it."""
        if self.family == "callable":
            where = f"{getattr(self.pattern, '__module__', '?')}.{getattr(self.pattern, '__qualname__', '?')}"
            return f"callable:{where}:{self.mode}"
        if self.family == "far":
            return "far:{},{}".format(*self.parameter)
        return self.family if self.parameter is None else f"{self.family}:{self.parameter}"

    @property
    def min_tokens(self) -> int:
        """The fewest tokens a sentence needs for any row of it to have a target: far:S,W's rows start at S + W (a
        batch of shorter sentences is not read for it at all); 1 for the others."""
        return sum(self.parameter) + 1 if self.family == "far" else 1

    @property
    def weighs_rows(self) -> bool:
        """Scored over every row by its mode (a callable), rather than over the rows a target is defined on."""
        return self.family == "callable"


def parse_detector(text: str) -> Detector:
    """'NAME=SPEC' (the CLI's --detector) -> a Detector, or a one-line ConfigError naming what was expected."""
    name, equals, spec = text.partition("=")
    if not equals:
        raise ConfigError(f"--detector takes NAME=SPEC (SPEC one of {', '.join(FAMILIES)}); got {text!r}")
    return make_detector(name.strip(), spec.strip())


def make_detector(name: str, spec: str | Callable | tuple) -> Detector:
    """A detector from its name and SPEC text, a callable, or (callable, mode)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(
            f"detector name {name!r}: lower-case letters, digits and _ (starting with a letter, at most 40)"
        )
    if name in RESERVED:
        raise ConfigError(f"detector name {name!r} is taken by an exemplar kind ({', '.join(RESERVED)})")
    return detector_of(name, spec)


def detector_of(name: str, spec: str | Callable | tuple) -> Detector:
    """The detector `spec` defines, under `name` (not checked: headscope's own patterns take reserved names)."""
    where = f"detector {name!r}"
    if isinstance(spec, tuple) and len(spec) == 2 and callable(spec[0]):
        pattern, mode = spec
        if mode not in MODES:
            raise ConfigError(f"{where}: a callable's mode is one of {', '.join(MODES)}; got {mode!r}")
        return Detector(name, "callable", pattern=pattern, mode=mode)
    if callable(spec):
        return Detector(name, "callable", pattern=spec)
    if not isinstance(spec, str):
        raise ConfigError(f"{where} takes a SPEC text or a callable; got {spec!r}")
    family, colon, parameter = spec.partition(":")
    if family == "offset":
        if not re.fullmatch(r"[0-9]+", parameter) or not 0 < int(parameter) <= 100_000:
            raise ConfigError(f"{where}: offset:K takes a whole number K of 1 or more; got {spec!r}")
        return Detector(name, "offset", int(parameter))
    if family == "token":
        try:
            re.compile(parameter)
        except re.error as error:
            raise ConfigError(f"{where}: token:REGEX takes a regular expression; {parameter!r}: {error}") from None
        if not colon or not parameter:
            raise ConfigError(f"{where}: token:REGEX takes a regular expression after 'token:'; got {spec!r}")
        return Detector(name, "token", parameter)
    if family == "far":
        if not re.fullmatch(r"[0-9]+,[0-9]+", parameter) or int(parameter.split(",")[1]) < 1:
            raise ConfigError(f"{where}: far:S,W takes whole numbers S >= 0 and W >= 1 (e.g. far:4,64); got {spec!r}")
        sink, window = (int(part) for part in parameter.split(","))
        return Detector(name, "far", (sink, window))
    if family in ("same-token", "after-same-token", "first") and not colon:
        return Detector(name, family)
    raise ConfigError(f"{where}: SPEC is one of {', '.join(FAMILIES)}; got {spec!r}")


def as_detectors(value) -> tuple[Detector, ...]:
    """RunConfig's detectors from what Python or the CLI gives: {name: spec or callable}, ['NAME=SPEC', ...] or
    Detectors; names must differ."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        detectors = [make_detector(name, spec) for name, spec in value.items()]
    elif isinstance(value, str):
        detectors = [parse_detector(value)]
    elif isinstance(value, Sequence):
        detectors = [item if isinstance(item, Detector) else parse_detector(item) for item in value]
    else:
        raise ConfigError(f"--detector takes NAME=SPEC texts (or a dict name -> spec); got {value!r}")
    names = [detector.name for detector in detectors]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"--detector names must differ; {', '.join(repeated)} given twice")
    return tuple(detectors)
