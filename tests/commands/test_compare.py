"""headscope compare: deltas, paired and unpaired intervals, FDR, different grids, refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from headscope.columns import INTERVAL_METRICS
from headscope.layout import SCHEMA_VERSION
from headscope.report.compare import _normal_delta, benjamini_hochberg, compare_reports, head_deltas

from helpers import assert_one_line_error, run_cli, snapshot, tiny_model_folder
from planted import FIRST, PREVIOUS, UNIFORM, build_planted_gpt2, build_planted_induction, expected_attention
from reference import corpus_means
from synthetic import synthetic_report

METRICS = ("entropy", "norm_entropy", "sink", "diagonal")


@pytest.fixture(scope="module")
def planted_pair(tmp_path_factory, corpus_lines):
    """Reports of two planted GPT-2s on the same corpus: layer 0's planted heads score 8 (A) and 6 (B)."""
    root = tmp_path_factory.mktemp("pair")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines) + "\n")
    reports = {}
    for name, beta in (("a", 8.0), ("b", 6.0)):
        model = build_planted_gpt2(root / f"model-{name}", corpus_lines, beta=beta)
        reports[name] = root / f"report-{name}"
        result = run_cli("analyze", model, "--corpus", corpus, "--out", reports[name], "--no-charts", "--no-probes")
        assert result.exit_code == 0, result.output
    return reports["a"], reports["b"], corpus


def test_paired_intervals_find_a_known_shift(planted_pair):
    a, b, _ = planted_pair
    comparison = compare_reports(a, b, replicates=400)
    assert comparison.record["method"].startswith("paired")
    heads = comparison.heads.set_index(["layer", "head"])
    lengths = pd.read_parquet(a / "sentences.parquet")["n_tokens"].tolist()
    for head in (PREVIOUS, FIRST):
        true = {beta: corpus_means([expected_attention(head, n, beta)[None] for n in lengths]) for beta in (8.0, 6.0)}
        for metric in METRICS:
            shift = float(true[6.0][metric][0] - true[8.0][metric][0])
            row = heads.loc[(0, head)]
            assert row[f"{metric}_delta"] == pytest.approx(shift, abs=1e-5), (head, metric)
            assert row[f"{metric}_delta_ci_low"] <= shift <= row[f"{metric}_delta_ci_high"], (head, metric)
            if abs(shift) > 1e-3:
                assert row[f"{metric}_delta_ci_low"] * row[f"{metric}_delta_ci_high"] > 0  # excludes 0
                assert row[f"{metric}_significant"]
    uniform = heads.loc[(0, UNIFORM)]
    assert uniform["entropy_delta"] == pytest.approx(0.0, abs=1e-6) and not uniform["entropy_significant"]


def test_deltas_are_b_minus_a_for_every_column(planted_pair):
    a, b, _ = planted_pair
    comparison = compare_reports(a, b, replicates=50)
    ha = pd.read_parquet(a / "heads.parquet").set_index(["layer", "head"])
    hb = pd.read_parquet(b / "heads.parquet").set_index(["layer", "head"])
    heads = comparison.heads.set_index(["layer", "head"])
    deltas = [c[: -len("_delta")] for c in heads.columns if c.endswith("_delta")]
    assert {"entropy", "sink", "sink_rate", "locality", "n_rows"} <= set(deltas)
    # The ends of an interval and what chance gives have no delta that means anything.
    assert not [c for c in deltas if c.endswith(("_ci_low", "_ci_high", "_chance"))]
    for column in deltas:
        np.testing.assert_array_equal(heads[f"{column}_delta"], hb[column] - ha[column], err_msg=column)
        np.testing.assert_array_equal(heads[f"{column}_a"], ha[column])
    assert (heads["head_type_b"] == hb["head_type"]).all() and (heads["role_a"] == ha["role"]).all()


def test_a_report_compared_with_itself_changes_nothing(planted_pair):
    a, _, _ = planted_pair
    comparison = compare_reports(a, a, replicates=100)
    heads = comparison.heads
    for metric in METRICS:
        assert (heads[f"{metric}_delta"] == 0).all() and not heads[f"{metric}_significant"].any()
        assert (heads[f"{metric}_delta_ci_low"] == 0).all() and (heads[f"{metric}_delta_ci_high"] == 0).all()
    assert not comparison.layers["entropy_significant"].any()
    assert comparison.record["significant_heads"] == dict.fromkeys(INTERVAL_METRICS, 0)


def test_different_corpora_are_compared_unpaired(planted_pair, tmp_path, corpus_lines):
    a, _, _ = planted_pair
    model = build_planted_gpt2(tmp_path / "model", corpus_lines, beta=6.0)
    other = tmp_path / "other.txt"
    other.write_text("\n".join(corpus_lines[:60]) + "\n")
    b = tmp_path / "b"
    assert run_cli("analyze", model, "--corpus", other, "--out", b, "--no-charts", "--no-probes").exit_code == 0
    comparison = compare_reports(a, b)
    assert comparison.record["method"].startswith("unpaired (different sentences)")
    row = comparison.heads.set_index(["layer", "head"]).loc[(0, PREVIOUS)]
    assert row["entropy_delta_ci_low"] < row["entropy_delta"] < row["entropy_delta_ci_high"]


def test_probe_deltas_only_when_the_probes_differ():
    """The probes measure the model, not the corpus: one model on two corpora has no probe delta to offer."""
    a = pd.DataFrame({"layer": [0, 0], "head": [0, 1], "entropy": [1.0, 2.0], "probe_induction": [0.1, 0.9]})
    for label in ("head_type", "role", "top_offset"):
        a[label] = "x"
    same, other = a.copy(), a.copy()
    same["entropy"] = [1.5, 2.5]
    other["probe_induction"] = [0.2, 0.9]
    assert "probe_induction_delta" not in head_deltas(a, same)
    np.testing.assert_allclose(head_deltas(a, other)["probe_induction_delta"], [0.1, 0.0])
    np.testing.assert_allclose(head_deltas(a, same)["entropy_delta"], [0.5, 0.5])


def test_unpaired_interval_on_known_numbers():
    a = pd.DataFrame({"entropy": [1.0], "entropy_ci_low": [0.9], "entropy_ci_high": [1.1]})
    b = pd.DataFrame({"entropy": [1.5], "entropy_ci_low": [1.3], "entropy_ci_high": [1.7]})
    low, high, p = _normal_delta(a, b, "entropy")
    se = np.sqrt((0.2 / 3.919927969080108) ** 2 + (0.4 / 3.919927969080108) ** 2)
    assert low[0] == pytest.approx(0.5 - 1.959963984540054 * se) and high[0] == pytest.approx(
        0.5 + 1.959963984540054 * se
    )
    # se = sqrt(0.2^2 + 0.4^2) / (2 * 1.96) = 0.11409; z = 0.5 / se = 4.3826; two-sided p = 1.1726e-5
    assert p[0] == pytest.approx(1.1726e-5, rel=1e-3)


def test_benjamini_hochberg_on_known_numbers():
    adjusted = benjamini_hochberg(np.array([0.01, 0.04, 0.03, 0.2, np.nan]))
    np.testing.assert_allclose(adjusted[:4], [0.04, 0.16 / 3, 0.16 / 3, 0.2])
    assert np.isnan(adjusted[4])


def test_different_grids_compare_on_relative_depth(planted_pair, tmp_path):
    a, _, corpus = planted_pair
    model = build_planted_induction(tmp_path / "induction")  # 2 layers x 4 heads against 2 x 3
    b = tmp_path / "b"
    assert run_cli("analyze", model, "--corpus", corpus, "--out", b, "--no-charts", "--no-probes").exit_code == 0
    comparison = compare_reports(a, b)
    assert not comparison.same_grid and comparison.heads is None
    layers = comparison.layers
    assert sorted(layers["report"].unique()) == ["A", "B"] and set(layers["relative_depth"]) == {0.0, 1.0}
    shares = comparison.bands.groupby(["report", "band", "kind"])["share"].sum(min_count=1)  # NaN: an empty band
    np.testing.assert_allclose(shares.dropna(), 1.0)


def test_a_layer_subset_sits_at_its_depth_in_the_model(tmp_path, corpus_lines):
    """Reports measured with --layers 0,1 of a 4-layer model (against all four layers of a 2-layer one):
    layer 1 is a third of the way down that model, not at its end, and its heads count in the early and middle
    bands of the model's four layers."""
    from transformers import GPT2Config, GPT2Model

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:10]) + "\n")
    reports = {}
    for name, depth, layers in (("deep", 4, ["--layers", "0,1"]), ("shallow", 2, [])):
        config = GPT2Config(n_embd=16, n_layer=depth, n_head=2, n_positions=64)
        model = tiny_model_folder(tmp_path / name, config, GPT2Model, corpus_lines)
        reports[name] = tmp_path / f"report-{name}"
        options = ["--corpus", corpus, "--out", reports[name], "--no-charts", "--no-page", "--no-probes", *layers]
        assert run_cli("analyze", model, *options).exit_code == 0
    comparison = compare_reports(reports["deep"], reports["shallow"])
    assert not comparison.same_grid and comparison.record["a"]["layers"] == 4
    deep = comparison.layers[comparison.layers["report"] == "A"]
    assert deep["relative_depth"].tolist() == [0.0, 1 / 3]
    counted = comparison.bands[(comparison.bands["report"] == "A") & (comparison.bands["kind"] == "role")]
    assert counted.groupby("band")["heads"].sum().to_dict() == {"early": 2, "late": 0, "middle": 2}


@pytest.mark.parametrize(
    ("depth", "bands"),
    [
        (1, ((0,), (), ())),
        (2, ((0,), (), (1,))),
        (12, (range(0, 4), range(4, 8), range(8, 12))),
        (13, (range(0, 4), range(4, 9), range(9, 13))),
        (30, (range(0, 10), range(10, 20), range(20, 30))),
        (32, (range(0, 10), range(10, 22), range(22, 32))),
    ],
)
def test_one_band_rule_for_the_summary_the_charts_and_compare(tmp_path, depth, bands):
    """summary.depth_bands is the rule; compare's band shares and the CLI's counts take their bands from it,
    at every depth (the two rules that existed disagreed at 13 and 32 layers)."""
    from headscope.report.compare import band_shares
    from headscope.report.report import Report
    from headscope.summary import depth_bands, layer_bands

    assert [tuple(band) for band in depth_bands(depth).values()] == [tuple(band) for band in bands]
    assert list(layer_bands(depth))[-1] == "all layers" and sum(map(len, layer_bands(depth).values())) == 2 * depth
    synthetic_report(tmp_path / "r", depth, 2)
    report = Report.open(tmp_path / "r")
    shares = band_shares(report, report)
    heads = shares[(shares["report"] == "A") & (shares["kind"] == "type")].groupby("band")["heads"].sum()
    assert heads.to_dict() == {
        name: 2 * len(band) for name, band in zip(("early", "middle", "late"), bands, strict=True)
    }


@pytest.mark.slow  # over 1.5 s on two cores
def test_compare_through_the_cli(planted_pair, tmp_path):
    a, b, _ = planted_pair
    out = tmp_path / "comparison"
    result = run_cli("compare", a, b, "--out", out, "--replicates", "100")
    assert result.exit_code == 0, result.output
    assert (
        "heads whose change is significant" in result.output and "the heads whose entropy changed most" in result.output
    )
    names = {p.name for p in out.iterdir()}
    assert {"compare.parquet", "compare_layers.parquet", "compare_bands.parquet", "compare.json"} <= names
    assert {"delta_heatmap.png", "layer_gradients.png", "transitions.png", "band_shares.png"} <= names
    record = json.loads((out / "compare.json").read_text())
    assert record["fdr"]["method"] == "Benjamini-Hochberg" and record["same_grid"]
    assert_one_line_error(run_cli("compare", a, b, "--out", a, "--overwrite"), "holds report A")
    rerun = run_cli("compare", a, b, "--out", out, "--overwrite", "--no-charts")
    assert rerun.exit_code == 0, rerun.output  # a comparison folder is headscope's to replace


def test_reports_of_another_schema_or_missing_tables_are_refused(planted_pair, tmp_path):
    a, b, _ = planted_pair
    old = tmp_path / "old"
    shutil.copytree(a, old)
    run = json.loads((old / "run.json").read_text())
    run["schema_version"] = 1
    (old / "run.json").write_text(json.dumps(run))
    expected = ("report A", "schema version 1", f"reads schema version {SCHEMA_VERSION}")
    assert_one_line_error(run_cli("compare", old, b), *expected)
    (old / "run.json").write_text(json.dumps({**run, "schema_version": SCHEMA_VERSION}))
    (old / "layers.parquet").unlink()
    assert_one_line_error(run_cli("compare", old, b), "has no layers.parquet")
    shutil.copy(a / "layers.parquet", old / "layers.parquet")
    (old / "heads.parquet").unlink()
    assert_one_line_error(run_cli("compare", b, old), "heads.parquet not found")


@pytest.fixture(scope="module")
def two_columns(planted_gpt2, tmp_path_factory, corpus_lines):
    """Reports of the two text columns of one CSV, and of the corpus read with and without a bad line."""
    root = tmp_path_factory.mktemp("pairing")
    table = root / "table.csv"
    rows = [f'"{a}","{b}"' for a, b in zip(corpus_lines[:10], corpus_lines[10:20], strict=True)]
    table.write_text("first,second\n" + "\n".join(rows) + "\n")
    mixed = root / "mixed.txt"
    mixed.write_bytes(("\n".join(corpus_lines[:10]) + "\n").encode() + b"caf\xe9 au lait\n")
    reports = {}
    for name, options in {
        "first": ["--corpus", table, "--text-column", "first"],
        "second": ["--corpus", table, "--text-column", "second"],
        "replaced": ["--corpus", mixed, "--encoding-errors", "replace"],
        "skipped": ["--corpus", mixed, "--encoding-errors", "skip"],
        "window3": ["--corpus", mixed, "--encoding-errors", "skip", "--window", "3"],
    }.items():
        reports[name] = root / name
        result = run_cli("analyze", planted_gpt2, *options, "--out", reports[name], "--no-probes", "--no-charts")
        assert result.exit_code == 0, result.output
    return reports


@pytest.mark.slow  # over 1.5 s on two cores
def test_two_columns_of_one_file_are_not_paired(two_columns, tmp_path):
    result = run_cli("compare", two_columns["first"], two_columns["second"], "--out", tmp_path / "c", "--no-charts")
    assert result.exit_code == 0, result.output
    assert "unpaired (the same corpus file read into different sentences" in result.output


@pytest.mark.slow  # over 1.5 s on two cores: out of the fast loop (docs/tests.md)
def test_different_encoding_errors_fall_back_to_unpaired(two_columns, tmp_path):
    result = run_cli("compare", two_columns["replaced"], two_columns["skipped"], "--out", tmp_path / "c")
    assert result.exit_code == 0, result.output
    assert "unpaired (the same corpus file read into different sentences" in result.output


def test_settings_that_change_meaning_are_named(two_columns, tmp_path):
    out = tmp_path / "c"
    result = run_cli("compare", two_columns["skipped"], two_columns["window3"], "--out", out, "--no-charts")
    assert result.exit_code == 0, result.output
    assert "note: the reports were measured with settings that change what the numbers mean: window 2 (A) vs 3 (B)" in (
        result.output
    )
    assert json.loads((out / "compare.json").read_text())["settings_differ"] == {"window": [2, 3]}


@pytest.mark.slow  # over 1.5 s on two cores
def test_a_one_token_corpus_compared_with_itself_has_nothing_significant(planted_gpt2, tmp_path):
    corpus = tmp_path / "words.txt"
    corpus.write_text("cat\ndog\nbird\nfish\n")
    report = tmp_path / "r"
    assert run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", report, "--no-probes").exit_code == 0
    out = tmp_path / "c"
    result = run_cli("compare", report, report, "--out", out, "--replicates", "50")
    assert result.exit_code == 0, result.output
    none = ", ".join(f"{metric} 0" for metric in ("entropy", "norm_entropy", "diagonal", "sink", "logit_std"))
    assert f"significant (FDR 5%): {none}" in result.output
    heads = pd.read_parquet(out / "compare.parquet")
    assert heads["norm_entropy_p"].isna().all() and not heads["norm_entropy_significant"].any()


@pytest.mark.parametrize("damage", ["nan metric", "string metric", "run.json types"])
def test_a_damaged_side_is_a_one_line_error(damage, two_columns, tmp_path):
    import shutil

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    side = tmp_path / "side"
    shutil.copytree(two_columns["first"], side)
    if damage == "run.json types":
        run = json.loads((side / "run.json").read_text())
        run["model"], run["settings"] = ["not", "a", "dict"], "nope"
        (side / "run.json").write_text(json.dumps(run))
    else:
        table = pq.read_table(side / "heads.parquet")
        index = table.schema.get_field_index("entropy")
        values = pa.array([np.nan] * len(table)) if damage == "nan metric" else pa.array(["x"] * len(table))
        pq.write_table(table.set_column(index, "entropy", values), side / "heads.parquet")
    result = run_cli("compare", two_columns["first"], side, "--out", tmp_path / "c", "--no-charts")
    if damage == "nan metric":  # a metric without values is no error: nothing to compare, nothing significant
        assert result.exit_code == 0, result.output
        assert not pd.read_parquet(tmp_path / "c" / "compare.parquet")["entropy_significant"].any()
    else:
        assert_one_line_error(result, "side")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicates", "1000000000"], "--replicates takes 2 to 100,000 replicates"),
        (["--seed=-1"], "--seed takes a whole number from 0 to 2**64 - 1; got -1"),
        (["--seed=18446744073709551616"], "--seed takes a whole number from 0 to 2**64 - 1"),
    ],
)
def test_compare_refuses_absurd_counts_and_seeds(args, message, two_columns, tmp_path):
    result = run_cli("compare", two_columns["first"], two_columns["second"], "--out", tmp_path / "c", *args)
    assert_one_line_error(result, message, "(see headscope compare --help)", code=2)


@pytest.mark.parametrize("command", [["plot"], ["classify"], ["plot", "--out", "elsewhere"]])
def test_a_run_json_without_its_fields_is_refused(command, two_columns, tmp_path):
    import shutil

    report = tmp_path / "r"
    shutil.copytree(two_columns["first"], report)
    (report / "run.json").write_text("{}")
    before = snapshot(report)
    args = [str(tmp_path / a) if a == "elsewhere" else a for a in command[1:]]
    assert_one_line_error(run_cli(command[0], report, *args), "is not a headscope run record")
    assert snapshot(report) == before
