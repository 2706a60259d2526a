"""The command line: help everywhere, one-line errors, no tracebacks, existing reports left alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from headscope.cli import app

from helpers import assert_one_line_error, refuse_to_load, run_cli, tiny_model_folder

runner = CliRunner()


COMMANDS = typer.main.get_command(app).commands


def words(text: str) -> str:
    """Whitespace collapsed, and a word the help wrapped at its hyphen joined again."""
    return re.sub(r"(?<=\w)- (?=\w)", "-", " ".join(text.split()))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_and_option_has_its_own_help(name):
    """`COMMAND --help` shows the command's own summary and, for every option and argument, its own help."""
    command = COMMANDS[name]
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    shown = words(result.output)
    assert command.help and words(command.help.strip().splitlines()[0]) in shown
    for param in command.params:
        assert param.help, f"{name}: {param.name} has no help text"
        assert words(param.help) in shown, f"{name} --help does not show {param.name}'s help"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_is_readable_at_80_columns(name):
    """Every option's names whole (never cut with an ellipsis), no line past 80 columns."""
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    assert "\u2026" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    for param in COMMANDS[name].params:
        for option in (*param.opts, *param.secondary_opts):
            if option.startswith("-"):
                assert re.search(rf"(^|[\s/,]){re.escape(option)}(\s|$|,)", result.output, re.M), (name, option)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_groups_the_options_in_panels(name):
    """A command's own options first, then the shared ones under their panels (cli/options.PANELS), in that order:
    each option shown under the panel options.py puts it in."""
    from headscope.cli.options import PANELS

    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "300"})
    titles = [line[:-1] for line in result.output.splitlines() if line.endswith(":") and not line.startswith(" ")]
    sections = [title for title in titles if title in ("Arguments", "Options", *PANELS)]
    order = ["Arguments", "Options", *PANELS]
    assert sections == sorted(sections, key=order.index) and len(set(sections)) == len(sections), sections
    for param in COMMANDS[name].params:
        panel = getattr(param, "rich_help_panel", None)
        if panel is None or param.param_type_name != "option":
            continue
        section = result.output.split(f"\n{panel}:\n", 1)[1].split("\n\n", 1)[0]
        assert param.opts[0] in section, (name, param.opts[0], panel)
    names = {param.name for param in COMMANDS[name].params}
    if "device" in names:  # a command that loads a model; the Corpus panel only where it runs text (not copying)
        assert "Model" in sections and ("Corpus" in sections) == ("max_length" in names), sections


def test_top_level_help_lists_every_command_with_its_summary():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0
    for name, command in COMMANDS.items():
        assert re.search(rf"{name}\s+{re.escape(command.help.split()[0])}", result.output), name


def test_missing_corpus_is_a_one_line_error(planted_gpt2, tmp_path):
    missing = tmp_path / "nope.txt"
    result = runner.invoke(app, ["analyze", str(planted_gpt2), "--corpus", str(missing), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: corpus file not found: {missing}"
    assert "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_unknown_hub_model_says_what_to_do(tmp_path):
    result = runner.invoke(app, ["analyze", "no-such-org/no-such-model", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    message = assert_one_line_error(result)
    assert message.startswith("Error: cannot load 'no-such-org/no-such-model' from the Hugging Face hub")
    assert "local folder" in message


def test_missing_model_folder(tmp_path):
    result = runner.invoke(app, ["analyze", str(tmp_path / "absent"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: model folder not found: {tmp_path / 'absent'}"


@pytest.mark.slow  # analyze through the CLI, three times
def test_existing_report_is_not_overwritten_without_flag(planted_gpt2, tmp_path, corpus_lines):
    out = tmp_path / "report"
    assert runner.invoke(app, ["analyze", str(planted_gpt2), "--out", str(out), "--no-charts"]).exit_code == 0
    before = (out / "heads.parquet").read_bytes()
    corpus = tmp_path / "other.txt"
    corpus.write_text("\n".join(corpus_lines[:5]) + "\n")
    result = runner.invoke(app, ["analyze", str(planted_gpt2), "--corpus", str(corpus), "--out", str(out)])
    assert result.exit_code == 1
    assert "--overwrite" in result.stderr
    assert (out / "heads.parquet").read_bytes() == before

    result = runner.invoke(
        app, ["analyze", str(planted_gpt2), "--corpus", str(corpus), "--out", str(out), "--overwrite", "--no-charts"]
    )
    assert result.exit_code == 0, result.output
    assert (out / "heads.parquet").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", "report"]  # no staging or old folders left


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--window", "-1", "--window must be 0 or more; got -1"), ("--max-length", "0", "--max-length must be 1 or more")],
)
def test_bad_option_value_is_rejected_before_loading(planted_gpt2, tmp_path, option, value, message):
    result = run_cli("analyze", planted_gpt2, option, value, "--out", tmp_path / "o", loader=refuse_to_load)
    assert result.exit_code == 2  # a usage error, like Typer's own
    assert result.stderr.strip().startswith(f"Error: {message}") and "\n" not in result.stderr.strip()
    assert result.stderr.strip().endswith("(see headscope analyze --help)")


def test_python_dash_m_runs():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "headscope", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    assert "analyze" in result.stdout


@pytest.fixture(scope="module")
def small_report(planted_gpt2, tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "report"
    assert runner.invoke(app, ["analyze", str(planted_gpt2), "--out", str(out), "--no-charts"]).exit_code == 0
    return out


def imported_modules(*args: str) -> set[str]:
    """Top-level packages a fresh `python ARGS` imports, read from -X importtime."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert lines, "no -X importtime output"
    return {line.rpartition("|")[2].strip().split(".")[0] for line in lines}


@pytest.mark.parametrize(
    "args", [["-c", "import headscope"], ["-m", "headscope", "--help"], ["-m", "headscope", "analyze", "--help"]]
)
def test_help_and_import_never_load_torch(args):
    heavy = imported_modules(*args) & {"torch", "transformers", "matplotlib"}
    assert not heavy, f"{' '.join(args)} imported {sorted(heavy)}"


@pytest.mark.slow  # a child process
@pytest.mark.parametrize("command", [["classify"], ["plot", "--format", "svg"]])
def test_commands_on_a_finished_report_never_load_torch(small_report, tmp_path, command):
    import shutil

    report = tmp_path / "report"
    shutil.copytree(small_report, report)
    heavy = imported_modules("-m", "headscope", command[0], str(report), *command[1:]) & {"torch", "transformers"}
    assert not heavy, f"headscope {command[0]} imported {sorted(heavy)}"


def test_the_summary_names_the_models_bands_whatever_layers_were_measured(tmp_path, corpus_lines):
    """--layers 1,2 of a 6-layer model: the counts are per band of the model's six layers (0-1, 2-3, 4-5), not of
    the three layers up to the highest one measured."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_embd=16, n_layer=6, n_head=2, n_positions=64)
    model = tiny_model_folder(tmp_path / "six", config, GPT2Model, corpus_lines)
    options = ["--out", tmp_path / "report", "--layers", "1,2", "--no-charts", "--no-page", "--no-probes"]
    result = run_cli("analyze", model, *options)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "all layers" in line)
    assert re.findall(r"layers? [\d-]+", header) == ["layers 0-1", "layers 2-3", "layers 4-5"]


def test_an_unknown_option_of_analyze_is_named(planted_gpt2, corpus_lines):
    import headscope

    with pytest.raises(headscope.HeadscopeError, match="unknown option 'typo'"):
        headscope.analyze(str(planted_gpt2), corpus_lines[:2], typo=1, loader=refuse_to_load)


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args",
    [
        ["analyze", "gpt2", "--window", "two"],
        ["analyze", "gpt2", "--no-such-option"],
        ["analyze"],
        ["no-such-command"],
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(args):
    assert_one_line_error(run_cli(*args), "--help", code=2)


@pytest.mark.slow
def test_tokens_that_split_a_character_are_labelled_with_their_bytes(smollm2):
    import headscope

    result = headscope.analyze(smollm2, ["I love 🍕 and 日本語 a lot."], sentence_heads=False, charts=None)
    labels = result.examples.drop_duplicates("query").sort_values("query")["query_token"].tolist()
    assert "\ufffd" not in "".join(labels)
    assert labels[2:5] == ["\\xf0\\x9f", "\\x8d", "\\x95"]  # 🍕 is F0 9F 8D 95, split over three tokens
    assert "本" in labels


def test_the_version_is_the_installed_one():
    import headscope

    result = run_cli("--version")
    assert result.exit_code == 0 and result.output.strip() == f"headscope {headscope.__version__}"
    assert headscope.__version__ != "0+unknown"  # the suite runs on an installed headscope (README's commands)
