"""Every command, once: its name, its CLI function, its library function, the kind of folder its --out names, where
that folder goes by default, and the kinds of folder it introduces.

The CLI (`cli.build_app`), the library's exports (`headscope.__getattr__`), the output rule (`output.check_output`,
`output.why_not_replaceable`), the --out options' help (cli/options.py) and the docs' option reference all read this
table, so a new command is one entry here beside its library module, its CLI module and its page
(tests/commands/test_new_command.py builds the real app with a toy command that way). `register` adds an entry at
run time, for a command that lives outside the package. No third-party imports: `import headscope` reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from headscope.layout import (
    ABLATION_RECORD,
    ATTENTION_FILE,
    CHART_NAMES,
    CHECKPOINT_FILES,
    CIRCUIT_CHARTS,
    CIRCUIT_PAGE,
    CIRCUIT_RECORD,
    CIRCUIT_WHY_FILE,
    COMPARE_CHARTS,
    COMPARE_PAGE,
    COMPARE_RECORD,
    COMPARE_TABLES,
    EDGES_BY_ROLE_FILE,
    EDGES_FILE,
    HEAD_MASK_FILE,
    INSPECT_PAGE,
    INSPECT_RECORD,
    KV_POLICY_RECORD,
    NODES_FILE,
    PAGE_FILE,
    PATCH_CHARTS,
    PATCH_RECORD,
    PATCHING_FILE,
    PATCHING_PAIRS_FILE,
    PLOT_RECORD,
    PRUNE_CHARTS,
    PRUNE_PAGE,
    PRUNE_RECORD,
    PRUNED_MODEL_RECORD,
    QK_FILE,
    RUN_FILE,
    TABLE_FILES,
    TOKENS_FILE,
    Kind,
)

REPORTS = Path("reports")  # where a command's folder goes when --out is not given


@dataclass(frozen=True)
class Command:
    name: str  # `headscope NAME`, and `headscope.NAME` where `library` is set
    cli: str  # the module whose function NAME is the CLI command (Typer reads its signature)
    library: str | None = None  # the module whose NAME is `headscope.NAME` (None: the command is the CLI's alone)
    kind: str | None = None  # the kind of folder its --out names (a key of `kinds()`)
    folder: str | None = None  # its --out under reports/ when not given: "prune-{model}" ({model}: the model's slug)
    writes: Mapping[str, Kind] = field(default_factory=dict)  # the kinds of folder it introduces
    resumable: bool = False  # --resume continues its checkpoint (output.py: only this command's own)

    def default_out(self, **names: str) -> Path:
        """The folder --out names when not given: `folder` under reports/, filled with `names` (model, a, b)."""
        assert self.folder is not None, f"{self.name} has no default output folder"
        return REPORTS / self.folder.format(**names)

    def shown_out(self) -> str:
        """The default folder as --out's help shows it: reports/prune-<model>."""
        return str(REPORTS / self.folder.format(model="<model>", a="<A>", b="<B>")) if self.folder else ""


_REPORT = Kind("a headscope report", RUN_FILE, (*TABLE_FILES, PAGE_FILE), CHART_NAMES)
_CIRCUIT_FILES = (EDGES_FILE, NODES_FILE, EDGES_BY_ROLE_FILE, CIRCUIT_WHY_FILE, CIRCUIT_PAGE)

_COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add `command` (its name and the kinds it introduces new): the CLI built after this has it."""
    taken = {kind for entry in _COMMANDS.values() for kind in entry.writes}
    if command.name in _COMMANDS or taken & set(command.writes):
        raise ValueError(f"command {command.name!r} or one of its kinds {sorted(command.writes)} is registered")
    _COMMANDS[command.name] = command
    return command


@contextmanager
def registered(command: Command) -> Iterator[Command]:
    """`command` registered while the block runs (a command a test or a notebook adds for a while)."""
    register(command)
    try:
        yield command
    finally:
        del _COMMANDS[command.name]


def commands() -> tuple[Command, ...]:
    """Every command, in the order `headscope --help` lists them."""
    return tuple(_COMMANDS.values())


def command(name: str) -> Command:
    return _COMMANDS[name]


def kinds() -> dict[str, Kind]:
    """Every kind of folder headscope writes, by name: what --overwrite may replace, and how each is recognised."""
    return {name: kind for entry in _COMMANDS.values() for name, kind in entry.writes.items()}


def resumable_kinds() -> dict[str, str]:
    """The kinds a run checkpoints, each with the command whose --resume continues it."""
    return {entry.kind: entry.name for entry in _COMMANDS.values() if entry.resumable and entry.kind}


def exports() -> dict[str, str]:
    """`headscope.NAME` -> the module that defines it, for every command with a library function."""
    return {entry.name: entry.library for entry in _COMMANDS.values() if entry.library}


for _entry in (
    Command("analyze", "headscope.cli.analyze", "headscope.commands.analyze", "report", "{model}", {"report": _REPORT},
            resumable=True),
    Command("classify", "headscope.cli.classify", kind="report"),
    Command("plot", "headscope.cli.plot", kind="charts",
            writes={"charts": Kind("a headscope chart folder", PLOT_RECORD, (PAGE_FILE,), CHART_NAMES)}),
    Command("compare", "headscope.cli.compare", kind="comparison", folder="compare-{a}-vs-{b}", writes={
        "comparison": Kind("a headscope comparison", COMPARE_RECORD, (*COMPARE_TABLES, COMPARE_PAGE), COMPARE_CHARTS)
    }),
    Command("inspect", "headscope.cli.inspect", "headscope.commands.inspect", "inspection", "inspect-{model}", {
        "inspection": Kind("a headscope inspection", INSPECT_RECORD, (ATTENTION_FILE, TOKENS_FILE, INSPECT_PAGE,
                                                                       QK_FILE))
    }),
    Command("ablate", "headscope.cli.ablate", "headscope.commands.ablate", "ablation", "ablate-{model}",
            {"ablation": Kind("a headscope ablation", ABLATION_RECORD, ())}),
    Command("patch", "headscope.cli.patch", "headscope.commands.patch", "patching", "patch-{model}", {
        "patching": Kind("a headscope patching", PATCH_RECORD, (PATCHING_FILE, PATCHING_PAIRS_FILE), PATCH_CHARTS)
    }),
    Command("prune", "headscope.cli.prune", "headscope.commands.prune", "pruning", "prune-{model}", {
        "pruning": Kind("a headscope pruning", PRUNE_RECORD, (HEAD_MASK_FILE, KV_POLICY_RECORD, PRUNE_PAGE),
                        PRUNE_CHARTS),
        "model": Kind("a headscope pruned model", PRUNED_MODEL_RECORD, CHECKPOINT_FILES, option="--save-model"),
    }, resumable=True),
    Command("circuit", "headscope.cli.circuit", "headscope.commands.circuit", "circuit", "circuit-{model}",
            {"circuit": Kind("a headscope circuit", CIRCUIT_RECORD, _CIRCUIT_FILES, CIRCUIT_CHARTS)}, resumable=True),
    Command("copying", "headscope.cli.copying", "headscope.commands.copying"),
):  # fmt: skip
    register(_entry)
