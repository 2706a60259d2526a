"""MkDocs hooks: the reference written from the code, so it cannot drift from it.

- `<!-- generated: columns -->` becomes the table of every heads.parquet column (headscope.columns: name, type,
  what it is, interval, per sentence), and `<!-- generated: options -->` one table per command of its options (the
  CLI's own: name, metavar, default, help).
- The example reports' charts (examples/reports/**.png) join the site under the same paths, so pages show the
  charts the shipped reports hold.
"""

from __future__ import annotations

import html
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
MARKERS = {"<!-- generated: columns -->": "columns", "<!-- generated: options -->": "options"}


def on_files(files, config):
    for chart in sorted((REPO / "examples" / "reports").rglob("*.png")):
        uri = chart.relative_to(REPO).as_posix()
        files.append(File(uri, str(REPO), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    for marker, kind in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, columns_table() if kind == "columns" else options_tables())
    return markdown


def _cell(text) -> str:
    """Text for a table cell: markup escaped, and its pipes, which would end the cell."""
    return html.escape(str(text)).replace("|", "&#124;").replace("\n", " ")


def columns_table() -> str:
    from headscope.columns import HEADS_COLUMNS

    rows = ["| column | type | what it is | interval | per sentence |", "|---|---|---|---|---|"]
    for column in HEADS_COLUMNS:
        interval, per_sentence = ("yes" if flag else "" for flag in (column.interval, column.per_sentence))
        rows.append(
            f"| <code>{column.name}</code> | {column.dtype} | {_cell(column.about)} | {interval} | {per_sentence} |"
        )
    return "\n".join(rows)


def options_tables() -> str:
    import click
    import typer

    from headscope.cli import app

    root = typer.main.get_command(app)
    parts = []
    with click.Context(root) as context:
        parts += ["## `headscope`", "", "The program's own options, before any command.", ""]
        parts += _option_rows(root, context)
        for name, command in root.commands.items():
            parts += [f"## `headscope {name}`", "", _cell(command.help or ""), ""]
            parts += _option_rows(command, click.Context(command, parent=context))
            parts.append("")
    return "\n".join(parts)


def _option_rows(command, context) -> list[str]:
    rows = ["| option | what it does |", "|---|---|"]
    for param in command.params:
        record = param.get_help_record(context)  # what --help shows: the flags with the metavar, the help
        if record is not None and param.name != "help":
            flags, about = record
            rows.append(f"| <code>{_cell(flags)}</code> | {_cell(about)} |")
    return [*rows, ""]
