"""classify and plot on report folders: planted heads, re-labelling, charts of every model shape."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

import headscope
from headscope.cli import app
from headscope.columns import MEASURED_COLUMNS
from headscope.config import Thresholds
from headscope.layout import CHART_NAMES, RUN_FILE
from headscope.report.write import plot_report
from headscope.tables import read_metadata

from planted import FIRST, PREVIOUS, UNIFORM
from synthetic import synthetic_report

runner = CliRunner()
CHARTS = tuple(name for name in CHART_NAMES if not name.startswith("importance"))  # drawn without --importance


def words_of(lines: list[str]) -> list[str]:
    return sorted({w for line in lines for w in line.split() if w.isalpha()})


@pytest.mark.parametrize("length", [5, 40])
def test_planted_heads_classify_on_short_and_long_sentences(planted_gpt2, corpus_lines, length):
    words = words_of(corpus_lines)
    rng = np.random.default_rng(length)
    sentences = [" ".join(rng.choice(words, size=length)) for _ in range(12)]
    result = headscope.analyze(str(planted_gpt2), sentences, sentence_heads=False)
    assert (result.sentences["n_tokens"] == length).all()
    layer0 = result.heads[result.heads["layer"] == 0].set_index("head")
    assert layer0.loc[UNIFORM, "head_type"] == "broad"
    assert layer0.loc[PREVIOUS, "head_type"] == "local"
    assert layer0.loc[FIRST, "head_type"] == "copy"


@pytest.fixture
def report(planted_gpt2, tmp_path):
    out = tmp_path / "report"
    result = runner.invoke(app, ["analyze", str(planted_gpt2), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow  # analyze with every chart
def test_analyze_writes_charts_and_records_thresholds(report):
    for name in CHARTS:
        assert (report / f"{name}.png").stat().st_size > 10_000, name
    run = json.loads((report / RUN_FILE).read_text())
    assert run["classification"]["thresholds"] == Thresholds().to_dict()
    assert sum(run["classification"]["counts"].values()) == 6
    assert read_metadata(report / "heads.parquet")["classification"] == run["classification"]
    heads = pd.read_parquet(report / "heads.parquet")
    assert heads["type_reason"].str.len().gt(0).all()


@pytest.mark.slow  # analyze with every chart
def test_classify_in_place_changes_labels_and_keeps_the_file_readable(report):
    before = pd.read_parquet(report / "heads.parquet")
    result = runner.invoke(
        app, ["classify", str(report), "--local-min-locality", "1", "--copy-max-norm-entropy", "0.0001"]
    )
    assert result.exit_code == 0, result.output
    assert "heads per head type" in result.output and "heads per role" in result.output
    after = pd.read_parquet(report / "heads.parquet")
    layer0 = after[after["layer"] == 0].set_index("head")["head_type"]
    assert layer0[PREVIOUS] != "local" and layer0[FIRST] != "copy"
    pd.testing.assert_frame_equal(
        after[list(MEASURED_COLUMNS)], before[list(MEASURED_COLUMNS)]
    )  # every measurement kept
    run = json.loads((report / RUN_FILE).read_text())
    assert run["classification"]["thresholds"]["local_min_locality"] == 1.0
    assert not [p for p in report.iterdir() if p.name.startswith(".")]


@pytest.mark.slow  # analyze with every chart, then plot
def test_classify_into_another_folder_then_plot_it(report, tmp_path):
    other = tmp_path / "relabelled"
    result = runner.invoke(app, ["classify", str(report), "--out", str(other), "--broad-min-norm-entropy", "0.95"])
    assert result.exit_code == 0, result.output
    original = pd.read_parquet(report / "heads.parquet")
    assert (original[original["layer"] == 0]["head_type"] == ["broad", "local", "copy"]).all()
    result = runner.invoke(app, ["plot", str(other), "--format", "svg"])
    assert result.exit_code == 0, result.output
    for name in CHARTS:
        assert (other / f"{name}.svg").read_text().lstrip().startswith("<?xml"), name


@pytest.mark.slow  # analyze with every chart
def test_classify_refuses_bad_thresholds_and_missing_reports(report, tmp_path):
    result = runner.invoke(app, ["classify", str(report), "--copy-max-norm-entropy", "0.9"])
    assert result.exit_code == 2  # a usage error
    assert result.stderr.startswith("Error: --copy-max-norm-entropy (0.9) must be below --broad-min-norm-entropy")
    result = runner.invoke(app, ["plot", str(tmp_path / "nothing")])
    assert result.exit_code == 1
    assert "run.json not found" in result.stderr


@pytest.mark.slow  # every chart of a 64 x 64 grid
@pytest.mark.parametrize(("layers", "heads"), [(12, 12), (30, 9), (1, 4), (64, 64)])
def test_charts_for_every_model_shape(tmp_path, layers, heads):
    folder = tmp_path / f"m{layers}x{heads}"
    synthetic_report(folder, layers, heads)
    written, failed = plot_report(folder, page=False)
    assert failed == []
    assert [p.stem for p in written] == [c for c in CHARTS if c != "examples"]  # no example without a model run
    for path in written:
        height, width = imread(path).shape[:2]
        assert 500 <= width <= 3200 and 400 <= height <= 3200, (path.name, width, height)


def test_a_chart_title_fits_its_figure_whatever_the_paths():
    """A long model path used to run off the figure's edge (patch_heatmap, head_roles): it shows as its last two
    parts, and lines wrap at 80 characters."""
    from headscope.report.charts import title_text

    long = "/home/someone/experiments/2026/finetunes/checkpoints/step-120000/my-finetuned-model-v2"
    title = title_text(f"{long} on /data/corpora/english/sentences.txt (100 sentences)\nhead roles per layer")
    assert "…/step-120000/my-finetuned-model-v2" in title and "/home/someone" not in title
    assert all(len(line) <= 80 for line in title.splitlines()) and title.endswith("head roles per layer")


@pytest.mark.slow  # over 1.5 s on two cores: out of the fast loop (docs/tests.md)
def test_characters_the_chart_font_lacks_are_one_warning_line(tmp_path):
    """A corpus named in a script the charts' font (DejaVu Sans) has no glyphs for: matplotlib warns once per
    character and chart, two lines each (issue 65: about 20 lines on one run); headscope says it once, in one
    `warning:` line naming the characters and the charts, and draws every chart."""
    folder = tmp_path / "report"
    synthetic_report(folder, 2, 2)
    run = json.loads((folder / RUN_FILE).read_text())
    run["corpus"]["path"] = "/data/文章.txt"
    (folder / RUN_FILE).write_text(json.dumps(run))
    result = runner.invoke(app, ["plot", str(folder)])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if "glyph" in line]
    assert len(said) == 1 and "UserWarning" not in result.stderr, result.stderr
    assert said[0].startswith("warning: the chart font has no glyph for 2 characters (文, 章), drawn as boxes in")
    assert "entropy_heatmap.png, layer_gradient.png" in said[0] and len(list(folder.glob("*.png"))) >= 6
