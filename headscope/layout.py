"""What a report folder holds, and how to tell a folder headscope wrote from anything else.

`analyze --overwrite` replaces a folder only when `why_not_a_report` finds nothing in it but the files
named here and a run.json that headscope wrote: this list is the list of files headscope may ever delete.
No third-party imports: an output folder is checked before anything heavy is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from headscope.config import CHART_FORMATS

SCHEMA_VERSION = 2  # of the tables and run.json; bumped when a column or key is added, changes or goes away

HEADS_FILE = "heads.parquet"
SENTENCES_FILE = "sentences.parquet"
SENTENCE_HEADS_FILE = "sentence_heads.parquet"
EXAMPLES_FILE = "examples.parquet"
LAYERS_FILE = "layers.parquet"
RUN_FILE = "run.json"
TABLE_FILES = (HEADS_FILE, LAYERS_FILE, SENTENCES_FILE, SENTENCE_HEADS_FILE, EXAMPLES_FILE)

CHART_NAMES = (
    "entropy_heatmap",
    "layer_gradient",
    "head_types",
    "head_roles",
    "probe_scores",
    "importance_heatmap",
    "importance_entropy",
    "classification_map",
    "examples",
)

PAGE_FILE = "report.html"  # the self-contained page of a report
COMPARE_PAGE = "compare.html"

# What `headscope compare` writes: a folder of its own, recognised by compare.json.
COMPARE_RECORD = "compare.json"
COMPARE_FILE = "compare.parquet"
COMPARE_LAYERS_FILE = "compare_layers.parquet"
COMPARE_BANDS_FILE = "compare_bands.parquet"
COMPARE_TABLES = (COMPARE_FILE, COMPARE_LAYERS_FILE, COMPARE_BANDS_FILE)
COMPARE_CHARTS = ("delta_heatmap", "layer_gradients", "transitions", "band_shares")


def is_report_file(name: str) -> bool:
    """Is `name` a file that headscope writes into a report (or comparison) folder?"""
    if name in (RUN_FILE, COMPARE_RECORD, PAGE_FILE, COMPARE_PAGE) or name in TABLE_FILES or name in COMPARE_TABLES:
        return True
    stem, _, extension = name.rpartition(".")
    return stem in CHART_NAMES + COMPARE_CHARTS and extension in CHART_FORMATS


def why_not_a_report(folder: Path) -> str | None:
    """None when `folder` is empty or a headscope report; otherwise what makes it something else."""
    entries = sorted(folder.iterdir())
    if not entries:
        return None
    foreign = [entry.name for entry in entries if entry.is_symlink() or not entry.is_file()]
    foreign += [entry.name for entry in entries if entry.is_file() and not is_report_file(entry.name)]
    if foreign:
        shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
        return f"it holds files headscope did not write ({shown})"
    record = folder / RUN_FILE if (folder / RUN_FILE).is_file() else folder / COMPARE_RECORD
    if not record.is_file():
        return f"it has no {RUN_FILE}"
    try:
        run = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"its {record.name} is unreadable"
    versions = run.get("versions") if isinstance(run, dict) and isinstance(run.get("versions"), dict) else None
    # Reports from before schema_version existed carry headscope's version instead.
    if not isinstance(run, dict) or not ("schema_version" in run or "headscope" in (versions or {})):
        return f"its {record.name} was not written by headscope"
    return None
