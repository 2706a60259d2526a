"""Helpers for driving the CLI in tests and checking what it left behind."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from headscope.cli import app

runner = CliRunner()


def run_cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments: str, code: int = 1) -> str:
    """The command failed with exit `code`, one line `Error: ...` holding every fragment, and no traceback."""
    assert result.exit_code == code, result.output
    message = result.stderr.strip()
    assert message.startswith("Error: ") and "\n" not in message, message
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in message, message
    return message


def hidden_leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


def previous_report(folder: Path) -> Path:
    """A stand-in for an earlier report: files headscope writes and a run.json that says headscope wrote it."""
    folder.mkdir()
    (folder / "run.json").write_text('{"schema_version": 1}')
    (folder / "heads.parquet").write_bytes(b"the previous run")
    return folder


def snapshot(folder: Path, *, skip: tuple[Path, ...] = ()) -> dict[str, tuple[int, int, bytes]]:
    """Every file under `folder` (outside `skip`) with its size, modification time and first bytes."""
    state = {}
    for path in sorted(folder.rglob("*")):
        if any(path == s or s in path.parents for s in skip) or not path.is_file():
            continue
        stat = path.stat()
        state[str(path.relative_to(folder))] = (stat.st_size, stat.st_mtime_ns, path.read_bytes()[:64])
    return state
