"""The examples of the README and of every docs page, run as written, in order, page by page (each page a test, so
that the suite's workers share them): every `headscope ...` command of their bash blocks (the segments of a line that
start with `headscope`: the install commands around them are .ci/run's) and every Python block, in one namespace per
page that starts with `import headscope` and `import pandas as pd`, as a reader pasting them one after another would.
The README's first command, the main job, runs once for every page: each page starts in a fresh folder holding its
report (reports/smollm2) and the shipped corpora, and the rest of the README is a page like the others. A block
preceded by `<!-- not run by tests/project/test_doc_examples.py: WHY -->` needs what a test cannot have (the hub, a
GPU, reports of yours). Each example must succeed: an example that collides with an earlier one's output, or names a
file that is not there, fails here with its page and line."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import run_cli

REPO = Path(__file__).resolve().parents[2]
NOT_RUN = re.compile(r"<!-- not run by tests/project/test_doc_examples\.py: .+ -->")


@dataclass(frozen=True)
class Example:
    page: str  # README.md, or docs/...
    line: int  # where it starts in the page
    language: str  # "bash" or "python"
    code: str  # a command line (bash: one headscope command) or a whole block (python)


def in_reading_order() -> list[Path]:
    """The README, then every docs page in the site's order (mkdocs.yml's nav)."""
    import yaml

    def pages(entries) -> list[str]:
        found = []
        for entry in entries:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                found += pages(value) if isinstance(value, list) else [value]
        return found

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    return [REPO / "README.md", *(REPO / "docs" / page for page in pages(nav))]


def every_example() -> list[Example]:
    return [example for path in in_reading_order() for example in page_examples(path)]


def page_examples(path: Path) -> list[Example]:
    """Every example of a page that runs, in order."""
    page = path.relative_to(REPO).as_posix()
    text = path.read_text(encoding="utf-8")
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
                examples.append(Example(page, index + 2, "python", "\n".join(body)))
            else:
                examples += _commands(page, body, index + 2)
        index = end + 1
    return examples


def _commands(page: str, body: list[str], first_line: int) -> list[Example]:
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
                commands.append(Example(page, start, "bash", shlex.join(words)))
        pending = ""
    return commands


def test_the_examples_are_found():
    examples = every_example()
    commands = [e.code for e in examples if e.language == "bash"]
    assert commands[0] == "headscope analyze smollm2 --overwrite"  # the main job, from the first line
    assert any(c.startswith("headscope patch") for c in commands) and not any("\\" in c for c in commands)
    assert not any("gpt2" in c or "torchrun" in c for c in commands)  # the marked blocks are left out
    assert sum(e.language == "python" for e in examples) >= 4


class OnceLoader:
    """The commands' loader seam: each model's weights read once (with its LM head, which any command may want) and
    handed to every command after, as a reader's machine would page them in. Commands restore what they change."""

    def __init__(self) -> None:
        self.loaded = {}

    def __call__(self, source, settings, model_config, lm_head):
        from headscope.model.loading import load_for_run

        key = (source.location, source.gguf_file, settings.device, settings.dtype)
        if key not in self.loaded:
            self.loaded[key] = load_for_run(source, settings, model_config, True)
        return self.loaded[key]


# The pages with examples to run (the README's first, the main job, runs once for them all: `main_job`).
PAGES = list(dict.fromkeys(example.page for example in every_example()[1:]))


@pytest.fixture(scope="session")
def loader() -> OnceLoader:
    """One load of SmolLM2 for every page's commands (in each of the suite's workers)."""
    return OnceLoader()


@pytest.fixture(scope="session")
def main_job(tmp_path_factory, loader) -> Path:
    """The README's first command (the main job) run once, in a folder of its own: the report every page starts
    with."""
    first = every_example()[0]
    folder = tmp_path_factory.mktemp("main-job")
    (folder / "corpora").symlink_to(REPO / "corpora")
    here = Path.cwd()
    os.chdir(folder)
    try:
        result = run_cli(*shlex.split(first.code)[1:], loader=loader)
    finally:
        os.chdir(here)
    assert result.exit_code == 0, f"{first.page}:{first.line}: {first.code}\n{result.output[-3000:]}"
    return folder / "reports" / "smollm2"


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_example_of_the_page_runs_in_order(page, main_job, loader, tmp_path, monkeypatch):
    """Every example of the page succeeds, in order, in a fresh folder holding the main job's report; the commands
    share one load of SmolLM2 (`OnceLoader`), the Python blocks load their own."""
    (tmp_path / "corpora").symlink_to(REPO / "corpora")
    shutil.copytree(main_job, tmp_path / "reports" / "smollm2")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec("import headscope\nimport pandas as pd", namespace)
    examples = [example for example in every_example()[1:] if example.page == page]
    for example in examples:
        where = f"{example.page}:{example.line}: {example.code[:200]}"
        if example.language == "bash":
            result = run_cli(*shlex.split(example.code)[1:], loader=loader)
            assert result.exit_code == 0, f"{where}\n{result.output[-3000:]}"
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    exec(compile(example.code, f"{example.page}:{example.line}", "exec"), namespace)
                except Exception as err:
                    raise AssertionError(f"{where}\n{type(err).__name__}: {err}") from err
