"""classify and plot on a finished report: a plain classify prints and writes nothing; a re-label keeps the
thresholds it is not given and rewrites everything that shows the labels; plot in place keeps the page's links to
the report's tables."""

from __future__ import annotations

import json
import re

import pytest

from helpers import QUICK, run_cli, snapshot

pytestmark = pytest.mark.slow  # every chart drawn, more than once


@pytest.fixture
def drawn_report(planted_gpt2, corpus, tmp_path):
    """A report labelled with a custom role threshold, with its charts and page."""
    out = tmp_path / "report"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, *QUICK, "--role-sink-rate-min", "0.9")
    assert result.exit_code == 0, result.output
    return out


def page_files(page) -> list[str]:
    """The tables report.html links to."""
    return json.loads(re.search(r'"files":\s*(\[[^\]]*\])', page.read_text()).group(1))


def test_a_plain_classify_prints_with_the_reports_thresholds_and_writes_nothing(drawn_report):
    before = snapshot(drawn_report.parent)
    result = run_cli("classify", drawn_report)
    assert result.exit_code == 0, result.output
    assert "nothing written" in result.output and snapshot(drawn_report.parent) == before


def test_a_relabel_keeps_the_thresholds_it_is_not_given_and_redraws_what_shows_the_labels(drawn_report):
    charts = sorted(drawn_report.glob("*.png"))
    assert charts and (drawn_report / "report.html").is_file()
    stamps = {path.name: path.stat().st_mtime_ns for path in [*charts, drawn_report / "report.html"]}
    result = run_cli("classify", drawn_report, "--copy-max-norm-entropy", "0.2")
    assert result.exit_code == 0, result.output
    classification = json.loads((drawn_report / "run.json").read_text())["classification"]
    assert classification["role_thresholds"]["sink_rate_min"] == 0.9  # kept, not reset to the default 0.5
    assert classification["thresholds"]["copy_max_norm_entropy"] == 0.2
    for name, stamp in stamps.items():
        assert (drawn_report / name).stat().st_mtime_ns != stamp, f"{name} was left as it was: stale labels"
    assert "heads.parquet" in page_files(drawn_report / "report.html")


def test_plot_in_place_keeps_the_pages_links_to_the_tables(drawn_report):
    assert run_cli("plot", drawn_report).exit_code == 0
    assert {"heads.parquet", "layers.parquet", "run.json"} <= set(page_files(drawn_report / "report.html"))
