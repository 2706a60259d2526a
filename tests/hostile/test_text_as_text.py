"""Text is drawn and printed as text: LaTeX, rich markup, the page's placeholders and terminal escapes in a corpus, a
file or a model name are never interpreted."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from helpers import QUICK, assert_one_line_error, gpt2_folder, run_cli


@pytest.mark.slow  # draws the charts
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
    assert f"{model.name}: mean attention entropy" in result.output  # its own name: "x]" for model[/x]
    result = run_cli("classify", out)
    assert result.exit_code == 0 and f"report{name}: heads per role" in result.output, result.output
    (tmp_path / f"cmp{name}").parent.mkdir(parents=True, exist_ok=True)
    result = run_cli("compare", out, out, "--out", tmp_path / f"cmp{name}", "--no-charts", "--no-page")
    assert result.exit_code == 0 and f"{model.name} on {tmp_path}/corpus{name}.txt" in result.output, result.output


@pytest.mark.slow  # over 1.5 s on two cores
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
        assert f"<title>headscope: {name} on c.txt (5 sentences)</title>" in page
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
