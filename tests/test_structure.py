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


# ---------------------------------------------------------------- the layout, and what imports what

TOP_LEVEL = {"__init__", "__main__", "config", "errors", "arguments", "columns", "labels", "summary", "tables"}
TOP_LEVEL |= {"layout", "estimates"}  # torch-free: what a report is made of, read by every part
SUBPACKAGES = {"cli", "model", "run", "measures", "interventions", "report"}
# Third-party packages each may import only in these parts of the package.
LANES = {
    "typer": ("headscope.cli",),
    "torch": ("headscope.model", "headscope.run", "headscope.measures", "headscope.interventions"),
    "transformers": ("headscope.model", "headscope.run", "headscope.measures", "headscope.interventions"),
    "matplotlib": ("headscope.report",),
    "plotly": ("headscope.report",),
}


def test_the_package_is_its_subpackages_and_a_few_shared_modules():
    """A new module goes where its job is (README: Code map): no module joins the top level unnoticed."""
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL, f"modules at the top level: {sorted(top - TOP_LEVEL)} (move them into a subpackage)"
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages == SUBPACKAGES


@pytest.mark.parametrize("package", sorted(LANES))
def test_imports_stay_in_their_lanes(package):
    """typer only in cli/; torch and transformers only where models run; matplotlib and plotly only in report/."""
    strays = [name for name in MODULES if package in all_imports(name) and not name.startswith(LANES[package])]
    assert not strays, f"{package} imported outside {LANES[package]}: {strays}"


def test_every_option_is_declared_once():
    """Every typer.Option and typer.Argument is declared in cli/options.py, so a command cannot grow its own
    --out with a help text of its own; and no name is declared twice there."""
    declared: dict[str, int] = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if is_call and node.func.attr in ("Option", "Argument") and getattr(node.func.value, "id", "") == "typer":
                assert name == "headscope.cli.options", f"{name} declares a typer.{node.func.attr} of its own"
    tree = ast.parse(MODULES["headscope.cli.options"].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    declared[target.id] = declared.get(target.id, 0) + 1
    assert all(count == 1 for count in declared.values()), {k: v for k, v in declared.items() if v > 1}


def test_every_setting_option_takes_its_help_from_the_setting():
    """An option named like a RunConfig field shows that field's documentation as its help, in every command."""
    import typer

    from headscope.cli import app
    from headscope.config import SETTINGS, setting_help

    for command in typer.main.get_command(app).commands.values():
        for param in command.params:
            if param.name in SETTINGS:
                assert param.help == setting_help(param.name), (command.name, param.name)
