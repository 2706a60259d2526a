"""Hostile inputs, round 3 (issue 19) and inputs that exhaust memory or the terminal (issue 23), through the CLI:
text that would be read as markup by a renderer, a run never lost to its presentation, device maps, importance
preconditions, compare's pairing, counts that would allocate without bound, torchrun, and regressions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest

from headscope.model.loading import load_for_run
from headscope.run.progress import NullReporter

from helpers import assert_one_line_error, hidden_leftovers, refuse_to_load, run_cli, snapshot, tiny_model_folder

QUICK = ("--no-probes", "--bootstrap", "0")


def gpt2_folder(path: Path, lines: list[str], **config) -> Path:
    from transformers import GPT2Config, GPT2Model

    options = {"n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 64, **config}
    return tiny_model_folder(path, GPT2Config(**options), GPT2Model, lines)


# ---------------------------------------------------------------- text that renderers would interpret


def test_latex_in_the_corpus_and_its_name_is_drawn_as_text(tmp_path):
    """matplotlib's mathtext: "$$ a + b $$" tokens on the example chart and a corpus named "cost $a_$ list.txt" in
    every title used to end in a ParseException after the whole run, with nothing written."""
    lines = ["$$ a + b $$ is the sum of $ and $", "the cost $ a _ $ is low $$", "we pay $ 5 and $ 6 for it"]
    model = gpt2_folder(tmp_path / "model", lines)  # a word-level vocabulary of these: "$" and "$$" are tokens
    corpus = tmp_path / "cost $a_$ list.txt"
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "report"
    result = run_cli("analyze", model, "--corpus", corpus, "--out", out, *QUICK)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    assert (out / "examples.png").stat().st_size > 10_000 and (out / "layer_gradient.png").is_file()
    tokens = pd.read_parquet(out / "examples.parquet")["query_token"]
    assert tokens.str.contains("$", regex=False).any()


@pytest.mark.parametrize("name", ["[/x]", "[bold]m[/bold]", "[link=file:x]m"])
def test_rich_markup_in_paths_is_printed_as_text(name, planted_gpt2, tmp_path, corpus_lines):
    """Paths of the model, the corpus and the report holding "[/x]" used to raise MarkupError after the report
    was written, in analyze, classify and compare."""
    model = tmp_path / f"model{name}"  # "/" in a name is a folder: model[/x] is the folder x] in model[
    model.parent.mkdir(parents=True, exist_ok=True)
    model.symlink_to(planted_gpt2, target_is_directory=True)
    corpus = tmp_path / f"corpus{name}.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("\n".join(corpus_lines[:6]) + "\n")
    out = tmp_path / f"report{name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run_cli("analyze", model, "--corpus", corpus, "--out", out, *QUICK, "--no-charts", "--no-page")
    assert result.exit_code == 0, result.output
    assert f"model{name}: mean attention entropy" in result.output
    result = run_cli("classify", out)
    assert result.exit_code == 0 and f"report{name}: heads per role" in result.output, result.output
    (tmp_path / f"cmp{name}").parent.mkdir(parents=True, exist_ok=True)
    result = run_cli("compare", out, out, "--out", tmp_path / f"cmp{name}", "--no-charts", "--no-page")
    assert result.exit_code == 0 and f"model{name} on {tmp_path}/corpus{name}.txt" in result.output, result.output


def test_a_model_named_like_a_placeholder_stays_a_name(tmp_path, planted_gpt2, corpus_lines):
    """The page's template is filled in one pass: a model folder named m__PLOTLY__ or m__DATA__ is a title, not
    the place where plotly.js or the data JSON goes."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(corpus_lines[:5]) + "\n")
    sizes = {}
    for name in ("plain", "m__PLOTLY__", "m__DATA__"):
        model = tmp_path / name
        model.symlink_to(planted_gpt2, target_is_directory=True)
        out = tmp_path / f"report-{name}"
        assert run_cli("analyze", model, "--corpus", corpus, "--out", out, *QUICK, "--no-charts").exit_code == 0
        page = (out / "report.html").read_text()
        assert f"<title>headscope: {tmp_path / name} on c.txt (5 sentences)</title>" in page
        sizes[name] = len(page)
    assert max(sizes.values()) - min(sizes.values()) < 1000  # no second copy of plotly.js or of the data


def test_control_characters_never_reach_the_terminal(tmp_path, corpus_lines):
    """A config.json holding terminal escape sequences: the error line shows them escaped, not raw."""
    model = gpt2_folder(tmp_path / "model", corpus_lines)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "gpt2\x1b[2J\x1b]0;pwned\x07"
    (model / "config.json").write_text(json.dumps(config))
    result = run_cli("analyze", model, "--out", tmp_path / "out")
    message = assert_one_line_error(result)
    assert "\x1b" not in result.output and "\x07" not in result.output and "\\x1b" in message


# ---------------------------------------------------------------- a run is never lost to its presentation


def test_a_chart_that_fails_leaves_the_report_and_says_what_was_not_drawn(planted_gpt2, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    real = Figure.savefig

    def failing(self, path, *args, **kwargs):  # the example chart cannot be drawn, as a renderer bug would
        if "examples" in str(path):
            raise RuntimeError("renderer exploded")
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", failing)
    out = tmp_path / "report"
    result = run_cli("analyze", planted_gpt2, "--out", out, *QUICK)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: could not draw")]
    assert len(warnings) == 1 and "examples.png (RuntimeError: renderer exploded)" in warnings[0]
    assert {"heads.parquet", "run.json", "report.html", "entropy_heatmap.png"} <= {p.name for p in out.iterdir()}
    assert not (out / "examples.png").exists() and hidden_leftovers(tmp_path) == []
    monkeypatch.undo()
    assert run_cli("plot", out).exit_code == 0 and (out / "examples.png").is_file()  # plot draws it again


# ---------------------------------------------------------------- device maps and offload folders


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gpu7", "'gpu7': not a device"),
        (3, "GPU 3, but this machine has"),
        ("meta", "the meta device, which holds no weights"),
        (None, "None: not a device"),
        ([1], "[1]: not a device"),
        (0.5, "0.5: not a device"),
    ],
)
def test_a_device_map_value_that_is_no_device_is_refused(value, message, planted_gpt2, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"": value}))
    started = time.perf_counter()
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", "--device-map", path, *QUICK)
    assert_one_line_error(result, "--device-map sends 'the model' to", message, code=2)
    assert time.perf_counter() - started < 20 and not (tmp_path / "o").exists()


def test_a_device_map_naming_modules_the_model_lacks_is_refused(planted_gpt2, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"wte": "cpu", "transformer.h.0": "cpu", "h": "cpu"}))
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", "--device-map", path, *QUICK)
    assert_one_line_error(
        result, "names modules", "does not have: 'transformer.h.0'", "top-level modules: drop, h", code=2
    )


def test_run_json_records_the_device_map_applied(planted_gpt2, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"": "cpu"}))
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--out", out, "--device-map", path, *QUICK, "--no-charts")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["model"]["device_map"] == {"": "cpu"}


@pytest.mark.parametrize("where", ["out", "inside out", "corpus folder", "model folder"])
def test_the_offload_folder_may_not_be_an_input_or_the_output(where, planted_gpt2, tmp_path, corpus_lines):
    data = tmp_path / "data"
    data.mkdir()
    corpus = data / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:5]) + "\n")
    out = tmp_path / "report"
    offload = {"out": out, "inside out": out / "x", "corpus folder": data, "model folder": planted_gpt2}[where]
    before = snapshot(planted_gpt2)
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--device-map", "auto",
        "--offload-folder", offload, *QUICK, loader=refuse_to_load,
    )  # fmt: skip
    assert_one_line_error(result, "--offload-folder", "choose a folder of its own", code=2)
    assert snapshot(planted_gpt2) == before


def test_what_loading_offloads_is_removed_when_the_run_ends(planted_gpt2, tmp_path):
    """A checkpoint accelerate must convert (GGUF, .bin) leaves copies of the offloaded weights in the offload
    folder: they go when the run ends; what was there before stays."""
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "mine.txt").write_text("mine")

    def loader(source, settings, model_config, lm_head):  # writes what accelerate writes for a converted checkpoint
        Path(settings.offload_folder).mkdir(exist_ok=True)
        (Path(settings.offload_folder) / "h.1.attn.c_attn.weight.dat").write_bytes(b"\0" * 1024)
        (Path(settings.offload_folder) / "index.json").write_text("{}")
        return load_for_run(source, settings, model_config, lm_head)

    out = tmp_path / "o"
    options = ("--device-map", "auto", "--offload-folder", offload, *QUICK, "--no-charts")
    assert run_cli("analyze", planted_gpt2, "--out", out, *options, loader=loader).exit_code == 0
    assert sorted(p.name for p in offload.iterdir()) == ["mine.txt"]
    fresh = tmp_path / "fresh-offload"
    assert run_cli("analyze", planted_gpt2, "--out", tmp_path / "o2", *options[:2], "--offload-folder", fresh,
                   *QUICK, loader=loader).exit_code == 0  # fmt: skip
    assert not fresh.exists()  # made by loading: removed whole


# ---------------------------------------------------------------- importance preconditions


def test_importance_refuses_a_checkpoint_without_lm_head_weights(tmp_path, corpus_lines):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, max_position_embeddings=64,
    )  # fmt: skip
    model = tiny_model_folder(tmp_path / "base-llama", config, LlamaModel, corpus_lines)
    result = run_cli("analyze", model, "--out", tmp_path / "o", "--importance", "fast", *QUICK)
    assert_one_line_error(result, "holds no weights for its LM head (lm_head.weight", "drop --importance")
    assert run_cli("analyze", model, "--out", tmp_path / "o", *QUICK, "--no-charts").exit_code == 0  # fine without


def test_importance_of_one_token_sentences_is_not_measured(planted_gpt2, tmp_path):
    corpus = tmp_path / "words.txt"
    corpus.write_text("cat\ndog\nbird\n")
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--importance", "fast", *QUICK)
    assert result.exit_code == 0, result.output
    assert "no sentence has a token to predict" in result.output
    assert "clean loss" not in result.output and "the heads the loss needs most" not in result.output
    run = json.loads((out / "run.json").read_text())
    assert run["importance"]["clean_loss"] is None and run["importance"]["predicted_tokens"] == 0
    assert pd.read_parquet(out / "heads.parquet")["attribution_mean"].isna().all()


def test_importance_refuses_a_sentence_beyond_its_memory_budget_before_measuring(planted_gpt2, tmp_path, corpus_lines):
    """A sentence is never split: one too long for a gradient pass within --max-memory is refused up front (it
    used to run past the budget: 3.1 GB for 2 GiB on SmolLM2), not after hours of measuring."""
    corpus = tmp_path / "long.txt"
    corpus.write_text(" ".join(" ".join(corpus_lines).split()[:40]) + "\n" + corpus_lines[0] + "\n")
    out = tmp_path / "o"
    options = ("--importance", "fast", "--max-memory", "1MiB", *QUICK)
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, *options)
    assert_one_line_error(
        result, "tokens in one gradient pass with 1.0 MiB", "the longest sentence has 44", "--max-length"
    )
    assert not out.exists() and hidden_leftovers(tmp_path) == []


# ---------------------------------------------------------------- compare's pairing and placing


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


def test_two_columns_of_one_file_are_not_paired(two_columns, tmp_path):
    result = run_cli("compare", two_columns["first"], two_columns["second"], "--out", tmp_path / "c", "--no-charts")
    assert result.exit_code == 0, result.output
    assert "unpaired (the same corpus file read into different sentences" in result.output


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


def test_a_one_token_corpus_compared_with_itself_has_nothing_significant(planted_gpt2, tmp_path):
    corpus = tmp_path / "words.txt"
    corpus.write_text("cat\ndog\nbird\nfish\n")
    report = tmp_path / "r"
    assert run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", report, "--no-probes").exit_code == 0
    out = tmp_path / "c"
    result = run_cli("compare", report, report, "--out", out, "--replicates", "50")
    assert result.exit_code == 0, result.output
    assert "significant (FDR 5%): entropy 0, norm_entropy 0, diagonal 0, sink 0 of 6" in result.output
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


# ---------------------------------------------------------------- counts that allocate


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bootstrap", "1000000000"], "--bootstrap takes 0 (no intervals) or 2 to 100,000 replicates"),
        (["--probe-seeds", "1000000000"], "--probe-seeds takes at most 10,000 sequences"),
        (["--bootstrap-seed", "-1"], "--bootstrap-seed takes a whole number from 0 to 2**64 - 1"),
    ],
)
def test_absurd_counts_are_refused_before_loading(args, message, planted_gpt2, tmp_path):
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", *args, loader=refuse_to_load)
    assert_one_line_error(result, message, "(see headscope analyze --help)", code=2)


def test_replicate_sums_beyond_the_memory_budget_are_refused_before_loading(planted_gpt2, tmp_path):
    result = run_cli(
        "analyze", planted_gpt2, "--out", tmp_path / "o", "--bootstrap", "100000", "--max-memory", "1MiB",
        loader=refuse_to_load,
    )  # fmt: skip
    assert_one_line_error(result, "--bootstrap 100,000 needs", "MiB for its replicate sums (2 layers x 3 heads)",
                          "replicates fit")  # fmt: skip


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


def test_a_one_line_corpus_of_many_megabytes_is_cut_before_it_is_tokenized(planted_gpt2, tmp_path, corpus_lines):
    """A 5 MB line used to be tokenized whole before truncation (a 100 MB line took more than 8 GB): the text is
    cut first, to what can still give the model's 64 tokens, and the run says so."""
    words = " ".join(corpus_lines).split()
    line = " ".join(words * (5_000_000 // len(" ".join(words)) + 1))
    corpus = tmp_path / "huge.txt"
    corpus.write_text(line[:5_000_000] + "\nThe cat sat on the mat.\n")
    out = tmp_path / "o"
    started = time.perf_counter()
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, *QUICK, "--no-charts", "--no-page")
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - started < 20
    assert "(1 truncated, 1 so long they were cut before tokenizing)" in result.output
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert sentences["n_tokens"].tolist() == [64, 7] and sentences["truncated"].tolist() == [True, False]
    run = json.loads((out / "run.json").read_text())
    assert run["corpus"]["cut_before_tokenizing"] == 1


# ---------------------------------------------------------------- regressions


@pytest.mark.parametrize(("mode", "outcome"), [("strict", "error"), ("replace", "\ufffd"), ("skip", "skipped")])
def test_a_lone_surrogate_in_jsonl_is_invalid_text(mode, outcome, planted_gpt2, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "The cat sat."}\n{"text": "bad \\ud800 here"}\n')
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--encoding-errors", mode, *QUICK)
    if outcome == "error":
        assert_one_line_error(result, "c.jsonl:2: a lone surrogate ('\\ud800') at column 5")
        return
    assert result.exit_code == 0, result.output
    texts = pd.read_parquet(out / "sentences.parquet")["text"].tolist()
    assert texts == (["The cat sat.", "bad \ufffd here"] if mode == "replace" else ["The cat sat."])


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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--threads", "100000000"], "--threads takes 1 to"),  # torch crashed (a segmentation fault)
        (["--offload-folder", "off"], "--offload-folder keeps what a --device-map sends to disk"),  # was ignored
    ],
)
def test_options_that_would_crash_or_do_nothing_are_refused(args, message, planted_gpt2, tmp_path):
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", *args, loader=refuse_to_load)
    assert_one_line_error(result, message, code=2)


class MeasuringFails(NullReporter):
    def start(self, total_sentences: int, what: str = "measuring") -> None:
        raise AssertionError("the corpus was measured before the bad option was refused")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--probe-length", "100000"], "needs that many distinct ordinary tokens; the tokenizer has 576"),
        (["--probe-length", "40"], "makes probe sequences of 80 tokens, more than the model's limit of 64"),
    ],
)
def test_a_probe_battery_that_cannot_run_is_refused_before_measuring(args, message, planted_gpt2, tmp_path):
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", *args, reporter=MeasuringFails())
    assert_one_line_error(result, message, code=2)
