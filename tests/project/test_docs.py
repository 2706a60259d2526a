"""The documentation: the MkDocs site builds with --strict, offline (every link, every page in the nav, the API read
from the docstrings); its reference is the code's (every column, every option of every command); the code map names
every module; the README stays a landing page; and every option the docs mention exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from headscope.cli import app
from headscope.columns import HEADS_COLUMNS

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("site")
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return folder


@pytest.mark.slow  # over 1.5 s on two cores
def test_the_site_builds_strictly_and_holds_every_page(site):
    for page in PAGES:
        name = page.relative_to(REPO / "docs").with_suffix("")
        built = site / ("index.html" if name.as_posix() == "index" else name / "index.html")
        assert built.is_file(), f"{page} was not built"
    assert (site / "examples/reports/smollm2/entropy_heatmap.png").is_file()  # the charts the pages show


@pytest.mark.slow  # the site's build, over 1.5 s on two cores
def test_the_reference_lists_every_column_and_every_option(site):
    columns = (site / "reference/columns/index.html").read_text(encoding="utf-8")
    for column in HEADS_COLUMNS:
        assert f"<code>{column.name}</code>" in columns, column.name
    options = (site / "reference/options/index.html").read_text(encoding="utf-8")
    root = typer.main.get_command(app)
    for name, command in [("", root), *root.commands.items()]:
        assert f"headscope {name}".strip() in options, name
        for param in command.params:
            for flag in param.opts:
                if flag.startswith("--"):
                    assert flag in options, (name, flag)


def exports() -> dict[str, str]:
    """Every name `import headscope` offers lazily (every command's function, load_model, Report) -> its module."""
    import headscope

    return headscope._LAZY


def test_the_api_page_documents_every_export():
    """docs/api.md renders each lazily exported name from its own module: a new command's function cannot be left
    out of the API page (the list is the package's, not this test's)."""
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    for name, module in exports().items():
        assert f"::: {module}.{name}" in text, name


@pytest.mark.slow  # the site's build
def test_the_api_page_is_read_from_the_docstrings(site):
    api = (site / "api/index.html").read_text(encoding="utf-8")
    for name, module in exports().items():
        assert f'id="{module}.{name}"' in api, name
    assert "Parameters:" in api and "budget" in api  # prune's Args section became a table


def test_the_code_map_names_every_module():
    text = (REPO / "docs" / "code-map.md").read_text(encoding="utf-8")
    missing = [path.relative_to(REPO / "headscope").as_posix() for path in sorted((REPO / "headscope").rglob("*.py"))
               if path.name != "__init__.py" and path.name not in text]  # fmt: skip
    assert not missing, f"docs/code-map.md names no {missing}"


def test_the_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    for page in re.findall(r"\]\((docs/[^)#]+)", "\n".join(lines)):
        assert (REPO / page).is_file(), page


def test_every_option_the_docs_mention_exists():
    root = typer.main.get_command(app)
    commands = [root, *root.commands.values()]
    known = {flag for command in commands for param in command.params for flag in (*param.opts, *param.secondary_opts)}
    known |= {
        "--help",
        "--no-deps",
        "--nproc-per-node",
        "--nnodes",
        "--rdzv-",
        "--strict",
        "--dist",
    }  # pip's, torchrun's, mkdocs', pytest-xdist's
    for page in [REPO / "README.md", *PAGES]:
        mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", page.read_text(encoding="utf-8")))
        unknown = mentioned - known
        assert not unknown, f"{page.name} mentions options no command has: {sorted(unknown)}"
