"""The command line: help everywhere, one-line errors, no tracebacks, existing reports left alone."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from headscope.cli import app

runner = CliRunner()


def command_names() -> list[str]:
    return [command.name or command.callback.__name__ for command in app.registered_commands]


@pytest.mark.parametrize("name", command_names())
def test_every_command_has_help(name):
    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    command = next(c for c in app.registered_commands if (c.name or c.callback.__name__) == name)
    assert command.callback.__doc__, f"{name} has no help text"
    summary = command.callback.__doc__.strip().splitlines()[0]
    assert " ".join(summary.split()) in " ".join(result.output.split())


def test_top_level_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in command_names():
        assert name in result.output


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
    message = result.stderr.strip()
    assert message.startswith("Error: cannot load 'no-such-org/no-such-model' from the Hugging Face hub")
    assert "local folder" in message and "\n" not in message


def test_missing_model_folder(tmp_path):
    result = runner.invoke(app, ["analyze", str(tmp_path / "absent"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: model folder not found: {tmp_path / 'absent'}"


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
        app, ["analyze", str(planted_gpt2), "--corpus", str(corpus), "--out", str(out), "--overwrite"]
    )
    assert result.exit_code == 0, result.output
    assert (out / "heads.parquet").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.txt", "report"]  # no staging or old folders left


def test_bad_option_value_is_rejected(planted_gpt2):
    result = runner.invoke(app, ["analyze", str(planted_gpt2), "--window", "-1"])
    assert result.exit_code != 0
    assert "--window" in result.output


def test_python_dash_m_runs():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "headscope", "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    assert "analyze" in result.stdout
