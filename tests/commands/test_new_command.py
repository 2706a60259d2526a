"""A new command touches four modules: its library entry (commands/), its CLI module (cli/), one registry line
(cli/__init__.py's command list) and its output's kind (layout.KINDS). Here a toy command is written as a new
contributor would write it, in those four pieces and nothing else, and it gets from the shared code what every
command has: the model and corpus options, the output rule, staging and publishing, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import headscope.cli.options as o
from headscope.cli.common import OneLineErrors, seams, user_errors
from headscope.config import settings_from_command_line
from headscope.layout import KINDS, Kind
from headscope.model.loading import load_for_run
from headscope.run.setup import MODEL_AND_CORPUS, CommandRun, record_header
from headscope.tables import write_json

TOY_RECORD = "toy.json"


# 1. The library entry (commands/toy.py): prepare, the session, its work, done.
def count_tokens(model, corpus=None, *, out=None, overwrite=False, config=None, reporter=None, loader=load_for_run,
                 **options) -> dict:  # fmt: skip
    """How many tokens each sentence of `corpus` is, for `model`'s tokenizer, and how many layers read them."""
    run = CommandRun.prepare(model, corpus, config=config, options=options, reporter=reporter)
    run.data_parallel(model, "toy")
    with run.session(model, loader, what="toy", out=out, kind="toy", overwrite=overwrite) as opened:
        lengths = [len(opened.loaded.tokenizer(s.text)["input_ids"]) for s in run.corpus.sentences]
        cut = [min(length, opened.plan.max_length or length) for length in lengths]
        record = record_header(opened.loaded, run.settings, MODEL_AND_CORPUS, run.corpus) | {"tokens": cut}
        if opened.folder is not None:
            write_json(record, opened.folder / TOY_RECORD)
    run.done(opened)
    return record


# 2. The CLI module (cli/toy.py): the shared option bundles, the seams, one-line errors.
@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.CORPUS_OPTIONS)
def toy(ctx: typer.Context, model: o.ModelArgument, corpus: o.Corpus = None, out: o.OutAblate = None,
        overwrite: o.Overwrite = False, **options) -> None:  # fmt: skip
    """Count each sentence's tokens."""
    reporter, loader = seams(ctx)
    with user_errors(ctx):
        found = count_tokens(model, corpus, out=out, overwrite=overwrite, config=settings_from_command_line(ctx.params),
                             reporter=reporter, **loader)  # fmt: skip
    typer.echo(f"{sum(found['tokens'])} tokens")


# 3. The registry line (cli/__init__.py), on an app of its own so that the real one stays as it is.
def toy_app() -> typer.Typer:
    app = typer.Typer(cls=OneLineErrors, pretty_exceptions_enable=False)
    app.command()(toy)

    @app.callback()
    def _commands() -> None:
        """The toy's app."""

    return app


# 4. Its output's kind (layout.KINDS): what the output rule lets --overwrite replace.
@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setitem(KINDS, "toy", Kind("a headscope toy count", TOY_RECORD, ()))


def test_a_toy_command_gets_the_options_the_output_rule_and_publishing(planted_gpt2, tmp_path, toy_kind):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three four\nfive six\n", encoding="utf-8")
    out = tmp_path / "toy"
    runner = CliRunner()
    common = ["toy", str(planted_gpt2), "--corpus", str(corpus), "--out", str(out), "--device", "cpu"]
    done = runner.invoke(toy_app(), [*common, "--max-length", "3"])
    assert done.exit_code == 0, done.output
    record = json.loads((out / TOY_RECORD).read_text())
    assert record["tokens"] == [3, 2]  # --max-length reached the plan: the first sentence is cut to 3
    assert record["settings"]["max_length"] == 3 and record["corpus"]["sentences"] == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # staged, then published
    again = runner.invoke(toy_app(), [*common, "--max-length", "3"])
    assert again.exit_code == 1 and "pass --overwrite to replace it" in again.output  # the output rule
    assert "Traceback" not in again.output
    bad = runner.invoke(toy_app(), [*common, "--overwrite", "--encoding-errors", "sideways"])
    assert bad.exit_code == 2 and "--encoding-errors" in bad.output  # the corpus bundle's option, checked
    assert Path(out / TOY_RECORD).is_file()  # nothing already written is touched by a refused run
