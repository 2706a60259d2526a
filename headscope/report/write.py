"""Writing what reads a report: charts and report.html (analyze, plot), relabelled heads (classify), and a
comparison folder (compare). Every file is written atomically; a comparison is staged and published whole."""

from __future__ import annotations

import shutil
from pathlib import Path

from headscope.config import CHART_FORMATS, RoleThresholds, Thresholds
from headscope.errors import ConfigError, OutputError
from headscope.layout import (
    COMPARE_BANDS_FILE,
    COMPARE_FILE,
    COMPARE_LAYERS_FILE,
    COMPARE_PAGE,
    COMPARE_RECORD,
    EXAMPLES_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    PAGE_FILE,
    RUN_FILE,
    why_not_a_report,
)
from headscope.output import atomic_path
from headscope.report.compare import Comparison
from headscope.report.report import Report
from headscope.tables import HEADS_SCHEMA, parquet_metadata, write_frame, write_json, write_table


def write_presentation(report: Report, folder: Path, *, fmt: str | None, page: bool) -> list[Path]:
    """The charts (as `fmt` files; none when None) and report.html of `report`, into `folder`."""
    written = []
    if fmt:
        from headscope.report.charts import draw_charts  # matplotlib only when charts are drawn

        written += draw_charts(report, folder=folder, fmt=fmt)
    if page:
        from headscope.report.page import report_page, write_page  # plotly only for the page

        written.append(write_page(report_page(report, files_in=folder), folder / PAGE_FILE))
    return written


def plot_report(folder: Path, *, fmt: str = CHART_FORMATS[0], out: Path | None = None, page: bool = True) -> list[Path]:
    """Draw every chart of the report in `folder`, and its report.html (into `out`, default the same folder);
    return their paths."""
    if fmt not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {fmt!r}")
    report = Report.open(folder).checked()
    target = Path(out) if out is not None else Path(folder)
    _make_folder(target)
    return write_presentation(report, target, fmt=fmt, page=page)


def reclassify(
    folder: Path, thresholds: Thresholds, roles: RoleThresholds | None = None, *, out: Path | None = None
) -> Report:
    """Re-label the heads of the report in `folder` (types and roles); write in place (atomically) or into `out`.

    With `out`, the new heads.parquet and run.json go there, with the tables the charts need.
    """
    folder = Path(folder)
    relabelled = Report.open(folder).relabelled(thresholds, roles or RoleThresholds())
    target = Path(out) if out is not None else folder
    _make_folder(target)
    problem = why_not_a_report(target)
    if problem is not None:  # classify writes heads.parquet and run.json: never over someone else's files
        raise OutputError(f"--out {target} is not a headscope report ({problem}); choose a new or empty folder")
    for name in (EXAMPLES_FILE, LAYERS_FILE):
        if target.resolve() != folder.resolve() and (folder / name).is_file():
            _copy_atomically(folder / name, target / name)
    write_table(relabelled.heads, target / HEADS_FILE, HEADS_SCHEMA, metadata=parquet_metadata(relabelled.run))
    write_json(relabelled.run, target / RUN_FILE)
    return relabelled


def write_comparison(
    comparison: Comparison, out: Path, *, a: Path, b: Path, overwrite: bool, fmt: str | None, page: bool = True
) -> Path:
    """Write the comparison's tables, compare.json, charts and page into `out` (staged, published atomically)."""
    from headscope.output import StagedDirectory

    stage = StagedDirectory(Path(out), overwrite=overwrite, protected={"report A": Path(a), "report B": Path(b)})
    with stage:
        tables = {COMPARE_LAYERS_FILE: comparison.layers, COMPARE_BANDS_FILE: comparison.bands}
        if comparison.heads is not None:
            tables[COMPARE_FILE] = comparison.heads
        for name, frame in tables.items():
            write_frame(frame, stage.path / name)
        write_json(comparison.record, stage.path / COMPARE_RECORD)
        if fmt:
            from headscope.report.compare_charts import draw_comparison  # matplotlib only when drawing

            draw_comparison(comparison, folder=stage.path, fmt=fmt)
        if page:
            from headscope.report.page import compare_page, write_page  # plotly only for the page

            write_page(compare_page(comparison), stage.path / COMPARE_PAGE)
    return stage.target


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"cannot create {folder}: {err.strerror or err}") from None


def _copy_atomically(source: Path, destination: Path) -> None:
    with atomic_path(destination) as tmp:
        shutil.copyfile(source, tmp)
