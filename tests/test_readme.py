"""The README's examples, run as written, in order, in a fresh folder: every `headscope ...` command of its bash
blocks (the segments of a line that start with `headscope`: the install commands around them are .ci/run's) and
every Python block, in one namespace, as a reader pasting them one after another would. A block preceded by
`<!-- not run by tests/test_readme.py: WHY -->` needs what a test cannot have (the hub, a GPU, reports of yours).
Each example must succeed: an example that collides with an earlier one's output, or names a file that is not
there, fails here with its README line."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import run_cli

REPO = Path(__file__).resolve().parent.parent
NOT_RUN = re.compile(r"<!-- not run by tests/test_readme\.py: .+ -->")


@dataclass(frozen=True)
class Example:
    line: int  # where it starts in README.md
    language: str  # "bash" or "python"
    code: str  # a command line (bash: one headscope command) or a whole block (python)


def readme_examples(text: str) -> list[Example]:
    """Every example of the README that runs, in order."""
    lines = text.splitlines()
    examples, index = [], 0
    while index < len(lines):
        opening = re.fullmatch(r"```(\w*)", lines[index].strip())
        if not opening:
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        if opening.group(1) in ("bash", "python") and not NOT_RUN.fullmatch(before.strip()):
            body = lines[index + 1 : end]
            if opening.group(1) == "python":
                examples.append(Example(index + 2, "python", "\n".join(body)))
            else:
                examples += _commands(body, index + 2)
        index = end + 1
    return examples


def _commands(body: list[str], first_line: int) -> list[Example]:
    """The headscope commands of a bash block (a trailing backslash continues a line; `#` starts a comment)."""
    commands, pending, start = [], "", first_line
    for offset, line in enumerate(body):
        if not pending:
            start = first_line + offset
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        for segment in pending.split("&&"):
            words = shlex.split(segment, comments=True)
            if words[:1] == ["headscope"]:
                commands.append(Example(start, "bash", shlex.join(words)))
        pending = ""
    return commands


def test_the_examples_are_found():
    examples = readme_examples((REPO / "README.md").read_text(encoding="utf-8"))
    commands = [e.code for e in examples if e.language == "bash"]
    assert commands[0] == "headscope analyze smollm2 --overwrite"  # the main job, from the first line
    assert any(c.startswith("headscope patch") for c in commands) and not any("\\" in c for c in commands)
    assert not any("gpt2" in c or "torchrun" in c for c in commands)  # the marked blocks are left out
    assert sum(e.language == "python" for e in examples) >= 4


@pytest.mark.slow
def test_every_readme_example_runs_in_order(tmp_path, monkeypatch):
    """About five minutes on two cores: SmolLM2 is loaded by each command, as a reader's shell would."""
    (tmp_path / "corpora").symlink_to(REPO / "corpora")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for example in readme_examples((REPO / "README.md").read_text(encoding="utf-8")):
        where = f"README.md:{example.line}: {example.code[:200]}"
        if example.language == "bash":
            result = run_cli(*shlex.split(example.code)[1:])
            assert result.exit_code == 0, f"{where}\n{result.output[-3000:]}"
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    exec(compile(example.code, f"README.md:{example.line}", "exec"), namespace)
                except Exception as err:
                    raise AssertionError(f"{where}\n{type(err).__name__}: {err}") from err
