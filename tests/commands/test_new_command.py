"""A new command touches four modules: its library entry (commands/), its CLI module (cli/: its own options and its
printout), its page (report/) and one entry in registry.py. Here a toy command is written as a new contributor
would write it, in those four pieces and nothing else: three module files and a registry entry. The real app is
built from the registry (`build_app`), and the toy gets from the shared code what every command has: the model,
corpus and output options, its default folder, the output rule, staging and publishing, one-line errors, and
`headscope.toy` from Python."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from headscope.cli import build_app
from headscope.layout import Kind
from headscope.registry import Command, registered

TOY_LIBRARY = '''
"""The library entry (commands/toy.py): prepare, the session, its work, done."""
from headscope.model.loading import load_for_run
from headscope.run.setup import MODEL_AND_CORPUS, CommandRun, record_header
from headscope.tables import write_json
from toy_page import write_toy_page


def toy(model, corpus=None, *, scale=1, out=None, overwrite=False, config=None, reporter=None, loader=load_for_run,
        **options):
    """How many tokens each sentence of `corpus` is for `model`'s tokenizer (times `scale`)."""
    run = CommandRun.prepare(model, corpus, config=config, options=options, reporter=reporter)
    run.data_parallel(model, "toy")
    with run.session(model, loader, what="toy", out=out, kind="toy", overwrite=overwrite) as opened:
        lengths = [len(opened.loaded.tokenizer(s.text)["input_ids"]) for s in run.corpus.sentences]
        cut = [scale * min(length, opened.plan.max_length or length) for length in lengths]
        record = record_header(opened.loaded, run.settings, MODEL_AND_CORPUS, run.corpus) | {"tokens": cut}
        if opened.folder is not None:
            write_json(record, opened.folder / "toy.json")
            write_toy_page(record, opened.folder / "toy.html")
    run.done(opened)
    return record
'''

TOY_CLI = '''
"""The CLI module (cli/toy.py): the shared bundles, its own option, the seams, one-line errors, its printout."""
from typing import Annotated

import typer

import headscope.cli.options as o
from headscope.cli.common import seams, user_errors, written

Scale = Annotated[int, typer.Option(help="Multiply each count by this.")]


@o.takes(o.MODEL_OPTIONS, o.TEXT_OPTIONS, o.CORPUS_OPTIONS, o.output("toy"))
def toy(ctx: typer.Context, model: o.ModelArgument, corpus: o.Corpus = None, scale: Scale = 1, **options) -> None:
    """Count each sentence's tokens."""
    from headscope.config import settings_from_command_line
    from toy_library import toy as count

    reporter, loader = seams(ctx)
    with user_errors(ctx):
        found = count(model, corpus, scale=scale, config=settings_from_command_line(ctx.params), reporter=reporter,
                      **written(ctx, model=model), **loader)
    typer.echo(f"{sum(found['tokens'])} tokens in {len(found['tokens'])} sentences")
'''

TOY_PAGE = '''
"""Its page (report/toy_page.py): one self-contained file, written atomically."""
import html

from headscope.report.page import write_page


def write_toy_page(record, path):
    rows = "".join(f"<li>{count}</li>" for count in record["tokens"])
    return write_page(f"<!doctype html><title>{html.escape(record['model']['name'])}</title><ol>{rows}</ol>", path)
'''

TOY = Command(
    "toy",
    cli="toy_cli",
    library="toy_library",
    kind="toy",
    folder="toy-{model}",
    writes={"toy": Kind("a headscope toy count", "toy.json", ("toy.html",))},
)


@pytest.fixture
def toy_command(tmp_path, monkeypatch):
    """The toy's three modules on the import path, and its registry entry, for this test only."""
    code = tmp_path / "code"
    code.mkdir()
    for name, text in (("toy_library", TOY_LIBRARY), ("toy_cli", TOY_CLI), ("toy_page", TOY_PAGE)):
        (code / f"{name}.py").write_text(textwrap.dedent(text), encoding="utf-8")
    monkeypatch.syspath_prepend(str(code))
    with registered(TOY):
        yield build_app()


def test_a_toy_command_in_four_modules_is_a_command_of_the_real_app(planted_gpt2, tmp_path, monkeypatch, toy_command):
    import headscope

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three four\nfive six\n", encoding="utf-8")
    runner = CliRunner()
    common = ["toy", str(planted_gpt2), "--corpus", str(corpus), "--device", "cpu"]
    monkeypatch.chdir(tmp_path)  # the default folder is under ./reports
    done = runner.invoke(toy_command, [*common, "--max-length", "3", "--scale", "2"])
    assert done.exit_code == 0, done.output
    assert "10 tokens in 2 sentences" in done.output  # the printout
    (out,) = (tmp_path / "reports").iterdir()
    assert out.name == f"toy-{planted_gpt2.name}"  # the registry's default folder, named after the model
    record = json.loads((out / "toy.json").read_text())
    assert record["tokens"] == [6, 4]  # --max-length reached the plan (the first sentence cut to 3), --scale the work
    assert record["settings"]["max_length"] == 3 and record["corpus"]["sentences"] == 2
    assert "<li>6</li>" in (out / "toy.html").read_text()  # its page
    again = runner.invoke(toy_command, [*common, "--out", str(out)])
    assert again.exit_code == 1 and "holds a headscope toy count; pass --overwrite" in again.output  # its kind
    assert "Traceback" not in again.output
    replaced = runner.invoke(toy_command, [*common, "--out", str(out), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output  # --overwrite replaces its own kind: toy.json and toy.html
    assert json.loads((out / "toy.json").read_text())["tokens"] == [4, 2]
    bad = runner.invoke(toy_command, [*common, "--out", str(out), "--overwrite", "--encoding-errors", "sideways"])
    assert bad.exit_code == 2 and "--encoding-errors" in bad.output  # the corpus bundle's option, checked
    help_text = runner.invoke(toy_command, ["toy", "--help"]).output
    assert "--scale" in help_text and "Default: reports/toy-<model>." in help_text  # its option, its default folder
    assert headscope.toy(str(planted_gpt2), corpus, device="cpu")["tokens"] == [4, 2]  # and from Python


def test_a_command_is_registered_once_and_leaves_with_its_entry():
    """A name or a kind already taken is refused; after the block the app built has the registry's commands alone."""
    import typer

    from headscope.registry import commands

    with registered(TOY):
        assert "toy" in typer.main.get_command(build_app()).commands
        with pytest.raises(ValueError, match="registered"), registered(TOY):
            pass
    clash = Command("other", cli="toy_cli", writes={"report": TOY.writes["toy"]})
    with pytest.raises(ValueError, match="registered"), registered(clash):
        pass
    built = typer.main.get_command(build_app()).commands
    assert list(built) == [entry.name for entry in commands()] and "toy" not in built
