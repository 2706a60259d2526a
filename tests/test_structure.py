"""The package's shape: no import cycle (lazy imports count), no page markup in Python, small modules, and
imports in their lanes (what reads reports never imports torch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "headscope"
MODULES = {
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted(PACKAGE.rglob("*.py"))
}
# Modules that read finished reports or do numpy maths: a command on a report folder must not pay for torch.
TORCH_FREE = ("headscope.report", "headscope.estimates", "headscope.labels", "headscope.tables", "headscope.columns")
TORCH_FREE += (
    "headscope.summary",
    "headscope.cli.printing",
    "headscope.layout",
    "headscope.run.output",
    "headscope.config",
)
TORCH_FREE += ("headscope.arguments", "headscope.run.files")


def imports_of(name: str) -> set[str]:
    """Every module of ours that `name` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from package import module`
    return {module for module in found if module in MODULES and module != name}


def all_imports(name: str) -> set[str]:
    """Every third-party top-level package `name` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_no_module_imports_itself_back():
    graph = {name: imports_of(name) - {"headscope"} for name in MODULES}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                cycles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small_and_hold_no_page_markup(name):
    text = MODULES[name].read_text()
    limit = 300 if name == "headscope.run.analyze" else 400
    assert len(text.splitlines()) <= limit, f"{name} has grown past {limit} lines: does it still have one job?"
    for markup in ("<script", "<html", "<section", "<div", "<style"):
        assert markup not in text, f"{name} holds page markup ({markup}); it belongs in headscope/report/assets/"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(TORCH_FREE)))
def test_what_reads_reports_never_imports_torch(name):
    assert not all_imports(name) & {"torch", "transformers", "typer"}, name
