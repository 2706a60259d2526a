"""The package's shape: floors (no import runs back up, lazy imports count), no import cycle, no page markup in
Python, and imports in their lanes (what reads reports never imports torch). Size is not a rule: a module is split by
job, in review, never to fit a line count."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "headscope"
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
    "headscope.output",
    "headscope.config",
)
TORCH_FREE += ("headscope.arguments", "headscope.files", "headscope.progress", "headscope.registry")


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
def test_modules_hold_no_page_markup(name):
    text = MODULES[name].read_text()
    for markup in ("<script", "<html", "<section", "<div", "<style"):
        assert markup not in text, f"{name} holds page markup ({markup}); it belongs in headscope/report/assets/"


# Bottom to top (docs/code-map.md): a module imports its own floor and the floors below it, never one above, so each
# floor can be read, tested and changed knowing only what lies beneath it.
FLOORS = (
    ("base", ("headscope.errors", "headscope.detector_specs", "headscope.config", "headscope.arguments",
              "headscope.columns", "headscope.labels",
              "headscope.estimates", "headscope.tables", "headscope.layout", "headscope.summary", "headscope.files",
              "headscope.output", "headscope.progress", "headscope.registry")),
    ("model", ("headscope.model",)),  # loading, capture, the attention kernels, batches
    ("measures", ("headscope.measures",)),  # what is read off attention and head outputs, per batch
    ("report", ("headscope.report",)),  # tables read back, charts, pages, notebook views
    ("run", ("headscope.run",)),  # corpus, plan, passes over it, checkpoints, torchrun, progress displays
    ("interventions", ("headscope.interventions",)),  # heads removed or patched: the mechanisms
    ("commands", ("headscope.commands",)),  # one module per command: its entry and its result
    ("surface", ("headscope.cli", "headscope.__main__", "headscope")),  # the CLI and the package's API
)  # fmt: skip


def floor_of(module: str) -> int:
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]  # fmt: skip
    assert matches, f"{module} is on no floor: add it to FLOORS"
    return max(matches)[1]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import in `graph` (module -> what it imports) that runs to a higher floor."""
    return [
        f"{name} ({FLOORS[floor_of(name)][0]}) imports {target} ({FLOORS[floor_of(target)][0]})"
        for name in sorted(graph)
        for target in sorted(graph[name])
        if floor_of(target) > floor_of(name)
    ]


def test_no_import_runs_back_up():
    found = upward({name: imports_of(name) - {"headscope"} for name in MODULES})
    assert not found, "imports that run back up:\n" + "\n".join(found)


def test_the_floor_rule_sees_an_upward_import():
    """What the rule was written for (issue 50): model/capture.py importing run/plan.py, measures/ importing run/,
    report/ importing run/'s file helpers, run/ importing interventions/."""
    before = {
        "headscope.model.capture": {"headscope.run.plan"},
        "headscope.measures.probes": {"headscope.run.feed"},
        "headscope.report.write": {"headscope.run.output"},
        "headscope.run.assemble": {"headscope.interventions.dormant"},
        "headscope.cli.analyze": {"headscope.commands.analyze", "headscope.run.setup"},  # downward: fine
    }
    assert len(upward(before)) == 4 and not any(line.startswith("headscope.cli") for line in upward(before))


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(TORCH_FREE)))
def test_what_reads_reports_never_imports_torch(name):
    assert not all_imports(name) & {"torch", "transformers", "typer"}, name


# ---------------------------------------------------------------- the layout, and what imports what

TOP_LEVEL = {
    "__init__",
    "__main__",
    "config",
    "detector_specs",
    "errors",
    "arguments",
    "columns",
    "labels",
    "summary",
    "tables",
}
TOP_LEVEL |= {"layout", "estimates"}  # torch-free: what a report is made of, read by every part
TOP_LEVEL |= {"files", "output", "progress"}  # torch-free: atomic files, the output rule, the Reporter contract
TOP_LEVEL |= {"registry"}  # torch-free: every command once (names of modules, never their imports)
SUBPACKAGES = {"cli", "model", "run", "measures", "interventions", "commands", "report"}
# Third-party packages each may import only in these parts of the package.
LANES = {
    "typer": ("headscope.cli",),
    "torch": (
        "headscope.model",
        "headscope.run",
        "headscope.measures",
        "headscope.interventions",
        "headscope.commands",
    ),
    "transformers": (
        "headscope.model",
        "headscope.run",
        "headscope.measures",
        "headscope.interventions",
        "headscope.commands",
    ),
    "matplotlib": ("headscope.report",),
    "plotly": ("headscope.report",),
}


def test_the_package_is_its_subpackages_and_a_few_shared_modules():
    """A new module goes where its job is (docs/code-map.md): no module joins the top level unnoticed."""
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top == TOP_LEVEL, f"modules at the top level: {sorted(top - TOP_LEVEL)} (move them into a subpackage)"
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert packages == SUBPACKAGES


@pytest.mark.parametrize("package", sorted(LANES))
@pytest.mark.first_case_fast
def test_imports_stay_in_their_lanes(package):
    """typer only in cli/; torch and transformers only where models run; matplotlib and plotly only in report/."""
    strays = [name for name in MODULES if package in all_imports(name) and not name.startswith(LANES[package])]
    assert not strays, f"{package} imported outside {LANES[package]}: {strays}"


def declared_options(module) -> dict[str, object]:
    """Each option (the OptionInfo behind an Annotated type) a module's commands take, by the module-level name that
    declares it."""
    from typing import get_args

    kinds = ("OptionInfo", "ArgumentInfo")
    return {name: get_args(value)[1] for name, value in vars(module).items()
            if len(get_args(value)) == 2 and type(get_args(value)[1]).__name__ in kinds}  # fmt: skip


def test_every_option_is_declared_once():
    """An option two commands take is declared in cli/options.py, once; an option only its own command takes may be
    declared in its CLI module (a new command is four modules, tests/commands/test_new_command.py), but never one a
    bundle or another command has: no command grows its own --out with a help text of its own."""
    import importlib
    import typing

    from headscope.registry import commands

    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            is_call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if is_call and node.func.attr in ("Option", "Argument") and getattr(node.func.value, "id", "") == "typer":
                assert name.startswith("headscope.cli."), f"{name} declares a typer.{node.func.attr}"
    taken: dict[int, set[str]] = {}  # id(OptionInfo) -> the commands that take it
    for entry in commands():
        function = getattr(importlib.import_module(entry.cli), entry.name)
        for hint in typing.get_type_hints(function, include_extras=True).values():
            for info in getattr(hint, "__metadata__", ()):
                taken.setdefault(id(info), set()).add(entry.name)
    for entry in commands():
        module = importlib.import_module(entry.cli)
        for declared, info in declared_options(module).items():
            assert taken.get(id(info)) == {entry.name}, f"{entry.cli}.{declared} is taken by {taken.get(id(info))}"
            assert "--out" not in (info.param_decls or ()), f"{entry.cli}.{declared} is an --out of its own"
    tree = ast.parse(MODULES["headscope.cli.options"].read_text())
    counted: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    counted[target.id] = counted.get(target.id, 0) + 1
    assert all(count == 1 for count in counted.values()), {k: v for k, v in counted.items() if v > 1}


def test_every_setting_option_takes_its_help_from_the_setting():
    """An option named like a RunConfig field shows that field's documentation as its help, in every command."""
    import typer

    from headscope.cli import app
    from headscope.config import SETTINGS, setting_help

    for command in typer.main.get_command(app).commands.values():
        for param in command.params:
            if param.name in SETTINGS:
                assert param.help == setting_help(param.name), (command.name, param.name)


def test_the_bundled_options_are_spelled_only_in_their_bundle():
    """The model-loading, corpus-reading, output, bootstrap and label-rule options are declared once (cli/options.py's
    bundles) and reach every command through `takes`: no command's own signature names one, every command that loads
    a model has all the model's, and every command that writes a folder has --out and --overwrite."""
    import typer

    import headscope.cli.options as o
    from headscope.cli import app
    from headscope.cli.options import CORPUS_OPTIONS, MODEL_OPTIONS, TEXT_OPTIONS
    from headscope.registry import commands as registered

    bundles = (MODEL_OPTIONS, TEXT_OPTIONS, CORPUS_OPTIONS, o.REWRITE_OUTPUT, o.RESUME_OPTIONS, o.CHART_OPTIONS,
               o.PAGE_OPTIONS, o.BOOTSTRAP_OPTIONS, o.LABEL_RULES, o.output("analyze"))  # fmt: skip
    bundled = {name for bundle in bundles for name, _, _ in bundle}
    for name, path in MODULES.items():
        if not name.startswith("headscope.cli.") or name == "headscope.cli.options":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                spelled = {arg.arg for arg in node.args.args + node.args.kwonlyargs} & bundled
                assert not spelled, f"{name}.{node.name} spells bundled options {sorted(spelled)}"
    commands = typer.main.get_command(app).commands
    takes = {name: {p.name for p in command.params} for name, command in commands.items()}
    loading = [name for name, params in takes.items() if "model" in params]  # the app's own list: it cannot go stale
    assert {"analyze", "copying"} <= set(loading) and "classify" not in loading
    for command in loading:
        assert {name for name, _, _ in MODEL_OPTIONS} <= takes[command], command
        runs_text = command != "copying"  # copying reads the weights alone: no text, nothing to truncate
        assert ("max_length" in takes[command]) == runs_text, command
    for command in [name for name, params in takes.items() if "corpus" in params]:
        assert {name for name, _, _ in CORPUS_OPTIONS} <= takes[command], command
    for entry in registered():  # every command that writes a folder takes --out and --overwrite
        assert ({"out", "overwrite"} <= takes[entry.name]) == (entry.kind is not None), entry.name


def test_no_test_module_imports_another():
    """What tests share lives in support modules (helpers, planted models, references, attention_cases, browser) or
    in conftest.py's fixtures; a test module importing another runs its module-level code and couples the two."""
    tests = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.name} imports {name}" for name in names if name.split(".")[0].startswith("test_")]
    assert not found, found


def package_map(init: Path) -> list[str]:
    """The names a package's docstring lists under `Modules:` (one a line, a subpackage with its slash)."""
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    _, found, listed = doc.partition("\nModules:\n")
    assert found, f"{init.relative_to(PACKAGE.parent)} has no 'Modules:' map"
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "init", sorted(PACKAGE.rglob("__init__.py")), ids=lambda p: str(p.parent.relative_to(PACKAGE.parent))
)
def test_every_package_map_names_its_modules_and_nothing_else(init):
    """A package's docstring is the first thing a newcomer reads: its map names each of its modules and subpackages,
    in order, and no module that is not there (five maps once named moved or missing modules)."""
    folder = init.parent
    modules = sorted(path.stem for path in folder.glob("*.py") if path.stem not in ("__init__", "__main__"))
    subpackages = sorted(f"{path.parent.name}/" for path in folder.glob("*/__init__.py"))
    assert package_map(init) == modules + subpackages


def test_a_stale_map_fails_the_map_check(tmp_path):
    """The check reads what the docstring lists: a map naming a module that is gone is seen."""
    (tmp_path / "__init__.py").write_text('"""A package.\n\nModules:\n    example  gone\n    kept     here\n"""\n')
    (tmp_path / "kept.py").write_text('"""Here."""\n')
    assert package_map(tmp_path / "__init__.py") == ["example", "kept"]
    with pytest.raises(AssertionError):
        test_every_package_map_names_its_modules_and_nothing_else(tmp_path / "__init__.py")


def test_ruff_knows_every_support_module_as_local():
    """Tests import tests/support's modules by name (pytest's `pythonpath`); ruff sorts them as local only if
    pyproject's known-local-folder lists them, so the list is the folder's modules, none missing and none gone."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))
    listed = pyproject["tool"]["ruff"]["lint"]["isort"]["known-local-folder"]
    support = sorted(path.stem for path in (PACKAGE.parent / "tests" / "support").glob("*.py"))
    assert sorted(listed) == support


def test_one_function_tells_a_conv1d_from_a_linear():
    """GPT-2's Conv1D holds its weight (in, out), a Linear (out, in): only model/projection.py's `linear_weight` (and
    its input-feature check) tells them apart, and no module transposes a projection's `.weight` itself. In code: a
    string "Conv1D" or a `.weight.T` anywhere else fails here (comments and docstrings may name it)."""
    offenders = []
    for name, path in MODULES.items():
        if name == "headscope.model.projection":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = isinstance(node, ast.Constant) and node.value == "Conv1D"
            transposed = (isinstance(node, ast.Attribute) and node.attr in ("T", "mT")
                          and isinstance(node.value, ast.Attribute) and node.value.attr == "weight")  # fmt: skip
            if named or transposed:
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders, offenders


def test_one_module_finds_a_layers_pieces():
    """model/layers.py is the one description of a decoder layer (its attention, projections, MLP, norms, post-norms,
    residual scale): no other module looks a layer's pieces up by name. In code: a string naming a projection or the
    attention or MLP module ("q_proj", "c_attn", "self_attn", "post_attention_layernorm") anywhere else fails here."""
    pieces = {"q_proj", "k_proj", "v_proj", "c_attn", "self_attn", "post_attention_layernorm", "input_layernorm"}
    offenders = []
    for name, path in MODULES.items():
        if name == "headscope.model.layers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in pieces:
                offenders.append(f"{name}: {node.value!r}")
            is_getattr = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr"
            if is_getattr and len(node.args) > 1 and getattr(node.args[1], "value", None) == "mlp":
                offenders.append(f"{name}: getattr(..., 'mlp')")
    assert not offenders, offenders
