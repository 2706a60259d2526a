"""A finished report: its run record, its tables (read when first used, every read guarded) and what they imply
(the model's depth and its bands, the thresholds it was labelled with, its title). `analyze` returns one;
`plot`, `classify`, `compare` and the page read one. Never imports torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from headscope.arguments import MAX_HEAD, MAX_LAYER, whole_number
from headscope.columns import MEASURED_COLUMNS
from headscope.config import RoleThresholds, Thresholds
from headscope.errors import ConfigError, OutputError
from headscope.labels import classification_record, label_heads
from headscope.layout import (
    EXAMPLES_FILE,
    EXEMPLARS_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    PROBES_FILE,
    RUN_FILE,
    SENTENCE_HEADS_FILE,
    SENTENCES_FILE,
)
from headscope.summary import depth_bands, layer_entropy
from headscope.tables import DETECTOR_PREFIX, REPORT_SCHEMAS, read_table


@dataclass(frozen=True)
class RoleRemoval:
    """One role's heads removed together (analyze --importance): its delta on each scoring, where measured."""

    role: str
    mode: str
    heads: tuple[str, ...]
    effects: dict[str, dict]  # scoring ("all", "repeats") -> tokens, delta, delta_ci_low, delta_ci_high, ...


@dataclass(frozen=True)
class RunFacts:
    """What run.json says about the run, typed: what the printout reads (run.record builds run.json; this is
    its one reader for them). Absent values (an older report) are None or 0."""

    model: str
    layers: int | None
    heads: int | None
    device: str
    dtype: str
    sentences: int
    tokens: int
    truncated: int
    cut_before_tokenizing: int
    tokens_per_second: float | None
    nonfinite_rows: int
    heads_with_nonfinite_rows: int
    unnormalised_rows: int
    heads_with_unnormalised_rows: int
    clean_loss: float | None  # with importance
    role_removals: tuple[RoleRemoval, ...]

    @classmethod
    def of(cls, run: dict) -> RunFacts:
        model, corpus = _section(run, "model"), _section(run, "corpus")
        architecture, numerics = _section(model, "architecture"), _section(run, "numerics")
        importance = _section(run, "importance")
        removals = tuple(
            RoleRemoval(entry["role"], entry["mode"], tuple(entry["heads"]),
                        {scoring: entry[scoring] for scoring in ("all", "repeats") if scoring in entry})
            for entry in importance.get("roles") or ()
        )  # fmt: skip
        return cls(
            model=str(model.get("input", "?")),
            layers=architecture.get("layers"),
            heads=architecture.get("heads"),
            device=str(run.get("device", "?")),
            dtype=str(run.get("dtype", "?")),
            sentences=corpus.get("sentences") or 0,
            tokens=corpus.get("tokens") or 0,
            truncated=corpus.get("truncated_sentences") or 0,
            cut_before_tokenizing=corpus.get("cut_before_tokenizing") or 0,
            tokens_per_second=_section(run, "timings").get("tokens_per_second"),
            nonfinite_rows=numerics.get("nonfinite_rows") or 0,
            heads_with_nonfinite_rows=numerics.get("heads_with_nonfinite_rows") or 0,
            unnormalised_rows=numerics.get("unnormalised_rows") or 0,
            heads_with_unnormalised_rows=numerics.get("heads_with_unnormalised_rows") or 0,
            clean_loss=importance.get("clean_loss"),
            role_removals=removals,
        )


class Report:
    """A report, from its folder (`Report.open`) or from the frames a run has in hand.

    heads            one row per (layer, head): the measurements, the head type and role
    layers           one row per layer (None for a report without it)
    examples         every head's attention on the example views (corpus sentences, a probe sequence), long-form
    probes           each probe sequence's score per (layer, head, probe) (None without probes)
    sentences        one row per corpus sentence (None when not kept)
    sentence_heads   one row per (sentence, layer, head) (None when the run skipped it)
    run              everything run.json holds
    """

    def __init__(
        self,
        run: dict,
        *,
        folder: Path | None = None,
        tables: Mapping[str, pd.DataFrame | Callable[[], pd.DataFrame] | None] | None = None,
    ) -> None:
        """tables: frames in hand by file name; a callable is a table computed when first read (analyze's example
        views of a report kept in memory: a second forward pass nobody may ask for)."""
        self.run = run
        self.folder = Path(folder) if folder is not None else None
        self._tables: dict[str, pd.DataFrame | Callable | None] = dict(tables or {})

    def __repr__(self) -> str:
        facts = self.facts
        where = f", folder={str(self.folder)!r}" if self.folder is not None else ""
        return f"Report(model={facts.model!r}, {facts.layers} layers x {facts.heads} heads{where})"

    def _repr_html_(self) -> str:
        """In a notebook: the run's facts, each role's strongest heads, then report.html's heatmap and head panel."""
        return self._view(share_plotly=True)

    def to_html(self) -> str:
        """The view a notebook shows (`_repr_html_`) as a string that stands alone (plotly.js inlined)."""
        return self._view(share_plotly=False)

    def _view(self, *, share_plotly: bool) -> str:
        from headscope.arguments import head_name
        from headscope.report.notebook import block, facts, framed, table
        from headscope.report.page import report_page
        from headscope.summary import top_heads_per_role

        run = self.facts
        header = facts([("model", run.model), ("sentences", run.sentences), ("tokens", run.tokens),
                        ("grid", f"{run.layers} layers x {run.heads} heads"), ("device", run.device)])  # fmt: skip
        roles = table(
            ["role", "heads", "evidence", "strongest heads"],
            [
                (
                    entry["role"],
                    entry["heads"],
                    entry["evidence"],
                    ", ".join(
                        head_name(layer, head) + (f" ({score:.3f})" if math.isfinite(score) else "")
                        for layer, head, score in entry["top"]
                    ),
                )
                for entry in top_heads_per_role(self.heads, 3)
            ],
            caption="the strongest heads of each role, by the evidence for it",
        )
        return block(f"headscope report: {run.model}", header, roles,
                     framed(report_page(self), share_plotly=share_plotly))  # fmt: skip

    @classmethod
    def open(cls, folder: Path | str) -> Report:
        """The report in `folder` (its run.json read now, its tables when first used)."""
        if not isinstance(folder, str | os.PathLike):
            raise ConfigError(f"a report is opened from its folder (a path); got {folder!r}")
        folder = Path(folder)
        return cls(read_run(folder), folder=folder)

    @property
    def heads(self) -> pd.DataFrame:
        return self._table(HEADS_FILE)

    def head_roles(self) -> dict[tuple[int, int], str]:
        """(layer, head) -> the head's role, for commands that show the roles of a report's heads."""
        return {(int(r.layer), int(r.head)): str(r.role) for r in self.heads.itertuples()}

    @property
    def layers(self) -> pd.DataFrame | None:
        return self._table(LAYERS_FILE)

    @property
    def examples(self) -> pd.DataFrame | None:
        return self._table(EXAMPLES_FILE)

    @property
    def probes(self) -> pd.DataFrame | None:
        """Each probe sequence's score per (layer, head, probe), or None without probes."""
        return self._table(PROBES_FILE)

    @property
    def exemplars(self) -> pd.DataFrame | None:
        """Each head's strongest corpus rows per kind (measures.exemplars), or None when the run kept none."""
        return self._table(EXEMPLARS_FILE)

    @property
    def sentences(self) -> pd.DataFrame | None:
        return self._table(SENTENCES_FILE)

    @property
    def sentence_heads(self) -> pd.DataFrame | None:
        return self._table(SENTENCE_HEADS_FILE)

    def _table(self, name: str) -> pd.DataFrame | None:
        if name not in self._tables:
            if self.folder is None:
                return None
            path = self.folder / name
            self._tables[name] = _read_heads(path, _grid(self.run)) if name == HEADS_FILE else _READERS[name](path)
        if callable(self._tables[name]):
            self._tables[name] = self._tables[name]()
        return self._tables[name]

    @property
    def facts(self) -> RunFacts:
        """What run.json says about the run, typed."""
        return RunFacts.of(self.run)

    @property
    def depth(self) -> int:
        """The model's number of layers (run.json's architecture), whichever layers the report measured."""
        layers = _grid(self.run)[0]
        return layers if layers is not None else int(self.heads["layer"].max()) + 1

    @property
    def head_count(self) -> int:
        return int(self.heads["head"].max()) + 1

    @property
    def bands(self) -> dict[str, range]:
        """early, middle, late layers of the model (summary.depth_bands)."""
        return depth_bands(self.depth)

    @property
    def thresholds(self) -> Thresholds:
        """The head-type thresholds the report was labelled with."""
        return _recorded(self.run, "thresholds", Thresholds)

    @property
    def role_thresholds(self) -> RoleThresholds:
        """The role thresholds the report was labelled with."""
        return _recorded(self.run, "role_thresholds", RoleThresholds)

    @property
    def title(self) -> str:
        """'model on corpus.txt (N sentences)', for charts and pages."""
        corpus = _section(self.run, "corpus")
        return f"{self.label} ({corpus.get('sentences', '?')} sentences)"

    @property
    def label(self) -> str:
        """'model on corpus.txt'."""
        model, corpus = _section(self.run, "model"), _section(self.run, "corpus")
        return f"{model.get('name') or model.get('input', '?')} on {Path(str(corpus.get('path', 'corpus'))).name}"

    @property
    def corpus_sha256(self) -> str | None:
        return _section(self.run, "corpus").get("sha256")

    def tables(self, *names: str) -> dict[str, pd.DataFrame | None]:
        """The tables of these file names, read now if they were not in hand."""
        return {name: self._table(name) for name in names}

    def checked(self) -> Report:
        """Read the heads, layers and examples now (every read is checked), so that a bad table stops a command
        before it writes anything."""
        for name in (HEADS_FILE, LAYERS_FILE, EXAMPLES_FILE):
            self._table(name)
        return self

    def layer_entropy(self) -> pd.Series:
        """Mean entropy per layer (nats): the seed analysis's layer-depth gradient."""
        return layer_entropy(self.heads)["mean"]

    def relabelled(self, thresholds: Thresholds, roles: RoleThresholds) -> Report:
        """The same report with its heads labelled again (types and roles), and run.json saying how."""
        heads = label_heads(self.heads[list(MEASURED_COLUMNS)], thresholds, roles)
        detectors = [name for name in self.heads.columns if name.startswith(DETECTOR_PREFIX)]
        heads = heads.assign(**{name: self.heads[name].to_numpy() for name in detectors})  # kept as measured
        run = {**self.run, "classification": classification_record(heads, thresholds, roles)}
        tables = {HEADS_FILE: heads, LAYERS_FILE: self.layers, EXAMPLES_FILE: self.examples,
                  EXEMPLARS_FILE: self.exemplars}  # fmt: skip
        return Report(run, folder=self.folder, tables=tables)


def read_run(folder: Path) -> dict:
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        raise OutputError(f"{path} not found; is {folder} a headscope report folder?")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise OutputError(f"cannot read {path}: {err.strerror or err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise OutputError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(run, dict):
        raise OutputError(f"{path} is not a headscope run record (a JSON object)")
    model, corpus = run.get("model"), run.get("corpus")
    if not isinstance(model, dict) or not isinstance(model.get("input"), str) or not isinstance(corpus, dict):
        raise OutputError(f"{path} is not a headscope run record (it has no model and corpus); run analyze again")
    _check_architecture(run, path)
    return run


def _grid(run: dict) -> tuple[int | None, int | None]:
    """The model's (layers, heads per layer) as run.json records them (None where it does not; read_run has
    checked what it does record)."""
    architecture = _section(_section(run, "model"), "architecture")
    return architecture.get("layers"), architecture.get("heads")


def _check_architecture(run: dict, path: Path) -> None:
    """run.json's layers and heads size every grid a report draws: they must be counts a model can have."""
    for key, limit in zip(("layers", "heads"), (MAX_LAYER, MAX_HEAD), strict=True):
        value = _section(_section(run, "model"), "architecture").get(key)
        if value is not None and not (whole_number(value) and 1 <= value <= limit + 1):
            raise OutputError(f"{path} says the model has {value!r} {key}; a damaged run record: run analyze again")


def _read_heads(path: Path, grid: tuple[int | None, int | None] = (None, None)) -> pd.DataFrame:
    """The heads table, refused unless it has one row per (layer, head), each within the model's grid (run.json's
    layers and heads, or the largest any model has): a number read from a table never sizes anything unchecked."""
    heads = read_table(path, REPORT_SCHEMAS[HEADS_FILE])
    if heads.empty:
        raise OutputError(f"{path} has no rows; run `headscope analyze` again")
    if heads[["layer", "head"]].isna().any().any():
        raise OutputError(f"{path} has rows without a layer or head number")
    if (heads[["layer", "head"]] < 0).any().any():
        raise OutputError(f"{path} has negative layer or head numbers")
    layers, count = grid[0] or MAX_LAYER + 1, grid[1] or MAX_HEAD + 1
    beyond = heads[(heads["layer"] >= layers) | (heads["head"] >= count)]
    if len(beyond):
        layer, head = (int(x) for x in beyond.iloc[0][["layer", "head"]])
        raise OutputError(
            f"{path} lists head {layer}.{head}, beyond the model's {layers} layers x {count} heads (run.json): a "
            "damaged report; run analyze again"
        )
    repeated = heads.duplicated(["layer", "head"])
    if repeated.any():
        first = heads[repeated].iloc[0]
        raise OutputError(f"{path} lists layer {first['layer']}, head {first['head']} more than once")
    return heads


def _read_examples(path: Path) -> pd.DataFrame | None:
    """Every head's attention on the example views, or None when the report has none."""
    if not path.is_file():
        return None
    examples = read_table(path, REPORT_SCHEMAS[EXAMPLES_FILE])
    positions = examples[["query", "key"]]
    if examples.empty:
        return None
    if positions.isna().any().any() or (positions < 0).any().any() or (positions.max() > 4096).any():
        raise OutputError(f"{path} is not a headscope table: query and key must be token positions")
    return examples


def _optional(schema):
    def read(path: Path) -> pd.DataFrame | None:
        return read_table(path, schema) if path.is_file() else None

    return read


# How each table but heads (`_read_heads`) is read: with its schema, or None where the run did not write it; the
# examples are checked further.
_READERS = {name: _optional(schema) for name, schema in REPORT_SCHEMAS.items() if name != HEADS_FILE} | {
    EXAMPLES_FILE: _read_examples
}


def _section(run: dict, key: str) -> dict:
    value = run.get(key)
    return value if isinstance(value, dict) else {}


def _recorded(run: dict, key: str, kind):
    recorded = _section(run, "classification").get(key)
    try:
        return kind(**recorded) if recorded else kind()
    except (TypeError, ConfigError) as err:
        raise OutputError(f"run.json holds unusable classification {key.replace('_', ' ')} ({err})") from None
