"""Writing what reads a report: charts and report.html (analyze, plot), relabelled heads (classify), and a
comparison folder (compare). A new folder is staged and published whole, tables, charts and page together
(headscope.output: only into an empty folder, or over one of the same kind with --overwrite), so an interrupted
run leaves the previous folder as it was; files rewritten in place are staged beside the folder and moved in
together. A chart or page that fails is reported and never takes the tables with it."""

from __future__ import annotations

import shutil
from pathlib import Path

from headscope.config import CHART_FORMATS, RoleThresholds, Thresholds
from headscope.errors import ConfigError
from headscope.files import replacing_files
from headscope.layout import (
    COMPARE_BANDS_FILE,
    COMPARE_FILE,
    COMPARE_LAYERS_FILE,
    COMPARE_PAGE,
    COMPARE_RECORD,
    EXAMPLES_FILE,
    EXEMPLARS_FILE,
    HEADS_FILE,
    LAYERS_FILE,
    PAGE_FILE,
    PLOT_RECORD,
    RUN_FILE,
    SCHEMA_VERSION,
)
from headscope.output import StagedDirectory, resolved
from headscope.report.compare import Comparison
from headscope.report.report import Report
from headscope.tables import heads_schema, parquet_metadata, write_frame, write_json, write_table


def write_presentation(
    report: Report, folder: Path, *, fmt: str | None, page: bool, beside: Path | None = None
) -> tuple[list[Path], list[str]]:
    """The charts (as `fmt` files; none when None) and report.html of `report`, into `folder`: the paths written,
    and for each one that could not be drawn, "NAME (the error)". A failed chart never stops the others. beside:
    the report's own folder, when `folder` is the work folder of files rewritten in place (the page links to the
    tables there)."""
    written, failed = [], []
    if fmt:
        from headscope.report.charts import draw_charts  # matplotlib only when charts are drawn

        drawn, missed = draw_charts(report, folder=folder, fmt=fmt)
        written, failed = written + drawn, failed + missed
    if page:
        from headscope.report.page import report_page, write_view  # plotly only for the page

        files_in = [folder] if beside is None else [folder, beside]
        missed = write_view(lambda: report_page(report, files_in=files_in), folder / PAGE_FILE)
        if missed is None:
            written.append(folder / PAGE_FILE)
        else:
            failed.append(missed)
    return written, failed


def plot_report(
    folder: Path,
    *,
    fmt: str = CHART_FORMATS[0],
    out: Path | None = None,
    page: bool = True,
    overwrite: bool = False,
) -> tuple[list[Path], list[str]]:
    """Draw every chart of the report in `folder`, and its report.html, into the report itself or into `out`
    (a new folder, or charts drawn there before, with `overwrite`). Returns what write_presentation returns."""
    if fmt not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {fmt!r}")
    report = Report.open(folder).checked()
    if out is None or resolved(out) == resolved(folder):
        with replacing_files(Path(folder)) as work:
            written, failed = write_presentation(report, work, fmt=fmt, page=page, beside=Path(folder))
        return [Path(folder) / path.name for path in written], failed
    stage = StagedDirectory(Path(out), kind="charts", overwrite=overwrite, protected={"the report": Path(folder)})
    with stage:
        record = {"schema_version": SCHEMA_VERSION, "report": str(resolved(folder)), "format": fmt}
        write_json(record, stage.path / PLOT_RECORD)
        written, failed = write_presentation(report, stage.path, fmt=fmt, page=page)
    return [stage.target / path.name for path in written], failed


def reclassify(
    folder: Path,
    thresholds: Thresholds,
    roles: RoleThresholds | None = None,
    *,
    out: Path | None = None,
    overwrite: bool = False,
) -> tuple[Report, list[str]]:
    """Re-label the heads of the report in `folder` (types and roles): in place, with everything that shows the
    labels (heads.parquet, run.json, the charts drawn there and report.html: all new, or all as they were), or as a
    new report in `out` (with the tables the charts need; an existing report there is replaced only with
    `overwrite`). Returns the report and, for a chart or page that could not be redrawn, "NAME (the error)"."""
    folder = Path(folder)
    relabelled = Report.open(folder).relabelled(thresholds, roles or RoleThresholds())
    if out is None or resolved(out) == resolved(folder):
        formats = [fmt for fmt in CHART_FORMATS if any(folder.glob(f"*.{fmt}"))]
        page = (folder / PAGE_FILE).is_file()
        with replacing_files(folder) as work:  # every file that shows the labels moves in together
            _write_labels(relabelled, work)
            failed = []
            for index, fmt in enumerate(formats or [None]):
                failed += write_presentation(relabelled, work, fmt=fmt, page=page and index == 0, beside=folder)[1]
        return relabelled, failed
    stage = StagedDirectory(Path(out), kind="report", overwrite=overwrite, protected={"the report": folder})
    with stage:
        for name in (EXAMPLES_FILE, LAYERS_FILE, EXEMPLARS_FILE):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, stage.path / name)
        _write_labels(relabelled, stage.path)
    return relabelled, []


def _write_labels(report: Report, folder: Path) -> None:
    write_table(report.heads, folder / HEADS_FILE, heads_schema(report.heads), metadata=parquet_metadata(report.run))
    write_json(report.run, folder / RUN_FILE)


def write_comparison(
    comparison: Comparison, out: Path, *, a: Path, b: Path, overwrite: bool, fmt: str | None, page: bool = True
) -> tuple[Path, list[str]]:
    """Write the comparison into `out`: its tables, compare.json, charts and page staged and published together.
    Returns the folder and, for each chart or page that could not be drawn, "NAME (error)"."""
    stage = StagedDirectory(
        Path(out), kind="comparison", overwrite=overwrite, protected={"report A": Path(a), "report B": Path(b)}
    )
    failed = []
    with stage:
        tables = {COMPARE_LAYERS_FILE: comparison.layers, COMPARE_BANDS_FILE: comparison.bands}
        if comparison.heads is not None:
            tables[COMPARE_FILE] = comparison.heads
        for name, frame in tables.items():
            write_frame(frame, stage.path / name)
        write_json(comparison.record, stage.path / COMPARE_RECORD)
        if fmt:
            from headscope.report.compare_charts import draw_comparison  # matplotlib only when drawing

            failed += draw_comparison(comparison, folder=stage.path, fmt=fmt)[1]
        if page:
            from headscope.report.page import compare_page, write_view  # plotly only for the page

            missed = write_view(lambda: compare_page(comparison), stage.path / COMPARE_PAGE)
            failed += [] if missed is None else [missed]
    return stage.target, failed
