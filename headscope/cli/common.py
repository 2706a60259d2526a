"""What every command shares: one-line errors, exit codes and signals, and the seams tests hand in."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

import click
import typer
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import TyperException

from headscope.errors import ConfigError, HeadscopeError

SPEAKER_GRACE = 5.0  # seconds a silent torchrun rank waits before exiting with an error, for rank 0 to say it


class OneLineErrors(TyperGroup):
    """Typer's own usage errors (a bad option value, an unknown option) as one line, like every other error.

    Exit codes: 0 done, 1 an error (`Error: ...`), 2 a usage error (`Error: ...`, naming the option),
    130 interrupted, 143 terminated.
    """

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                code = super().main(*args, standalone_mode=False, **kwargs)
        except TyperException as err:
            context = getattr(err, "ctx", None)
            # `headscope` alone raises this to show the help; Typer does not export its class.
            if type(err).__name__ == "NoArgsIsHelpError":
                err.show()
            else:
                where = f" (see {context.command_path} --help)" if context is not None else ""
                typer.echo(f"Error: {' '.join(err.format_message().split())}{where}", err=True)
            code = err.exit_code
        except typer.Abort:
            typer.echo("Aborted.", err=True)
            code = 1

        if code in (1, 2) and os.environ.get("RANK", "0") != "0":
            # Under torchrun only rank 0 speaks (`say`), and torchrun stops every rank as soon as one exits failed:
            # a silent rank that refused first would stop rank 0 before its one line. The silent ones leave later.
            time.sleep(SPEAKER_GRACE)
        if not standalone_mode:
            return code
        sys.exit(code or 0)


class PanelledCommand(TyperCommand):
    """A command whose plain help groups its options in panels (each option's rich_help_panel, set in
    cli/options.py): its own options first, then the shared ones by what they are about. Rich's help, which reads the
    same panels, cut long option names at 80 columns."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from headscope.cli.options import PANELS

        arguments, panels = [], {"Options": [], **{panel: [] for panel in PANELS}}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
            else:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for title, records in (("Arguments", arguments), *panels.items()):
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


INTERRUPTED = {130: "Interrupted; existing outputs were left as they were",
               143: "Terminated; existing outputs were left as they were"}  # fmt: skip


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so that every cleanup (staging folders, temp files) runs."""


_SHOW_WARNING = warnings.showwarning
ONE_LINE_WARNINGS = ("ChartFontWarning",)  # headscope's own warnings, said in one line as the reporter's are


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if category.__name__ in ONE_LINE_WARNINGS:  # by name: the class lives with matplotlib's code, loaded late
        say(f"warning: {message}", err=True)
    else:
        _SHOW_WARNING(message, category, filename, lineno, file, line)


def raise_terminated(signum, frame) -> None:
    from headscope.files import note_signal

    note_signal(Terminated)  # in case a finalizer running now swallows the exception (files.note_signal)
    raise Terminated


def quiet_signals_in_finalizers(unraisable) -> None:
    """sys.unraisablehook: a signal that lands while a finalizer (__del__) runs cannot leave it, and Python's default
    hook prints a traceback ("Exception ignored in ..."). The signal was noted (files.note_signal) and is raised
    again at the next safe point, so the command still ends with its one line and exit code: nothing to print."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt | Terminated):
        return
    sys.__unraisablehook__(unraisable)


def raise_interrupted(signum, frame) -> None:
    from headscope.files import note_signal

    note_signal(KeyboardInterrupt)
    raise KeyboardInterrupt


def say(message: str, *, err: bool = False) -> None:
    """Print a line (control characters escaped); under torchrun only rank 0 speaks: every rank's failure
    reaches it (headscope.run.distributed.meet)."""
    from headscope.progress import printable

    if os.environ.get("RANK", "0") == "0":
        typer.echo(printable(message), err=err)


@contextlib.contextmanager
def usage_errors(ctx: typer.Context):
    """Option values the settings refuse (out of range, inconsistent) are usage errors: one line naming the
    option and where its help is, exit code 2, like Typer's own."""
    try:
        yield
    except ConfigError as err:
        _usage_error(ctx, err)


def _usage_error(ctx: typer.Context, err: ConfigError):
    say(f"Error: {err} (see headscope {ctx.info_name} --help)", err=True)
    raise typer.Exit(2) from None


@contextlib.contextmanager
def user_errors(ctx: typer.Context):
    """Turn the library's own errors into a one-line message and exit code 1 (2 for an option's value the
    library refuses once it knows the model or the corpus: a usage error too); signals into 130 / 143."""
    from headscope.files import forget_signals
    from headscope.output import kept_checkpoints

    kept_before = len(kept_checkpoints())

    def hint() -> str:  # only a run that kept a checkpoint can be continued: the others say nothing of --resume
        kept = kept_checkpoints()[kept_before:]
        return f" (what it did is kept in {kept[-1]}: the same command with --resume continues it)" if kept else ""

    try:
        yield
    except ConfigError as err:
        _usage_error(ctx, err)
    except HeadscopeError as err:
        say(f"Error: {err}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        forget_signals()
        say(f"{INTERRUPTED[130]}{hint()}.", err=True)
        raise typer.Exit(130) from None
    except Terminated:
        forget_signals()
        say(f"{INTERRUPTED[143]}{hint()}.", err=True)
        raise typer.Exit(143) from None
    except Exception as err:  # a full disk reported by a library outside any staged folder: still one line
        from headscope.files import disk_refusal

        refused = disk_refusal(err)
        if refused is None:
            raise  # a bug: its traceback is the report
        say(f"Error: cannot write the output: {refused}", err=True)
        raise typer.Exit(1) from None


def chart_format(params: dict) -> str | None:
    """The charts' format the output bundle's --format and --charts ask for: None with --no-charts."""
    return params["chart_format"].value if params.get("charts", True) else None


def written(ctx: typer.Context, *, model: str | None = None, **names: str) -> dict:
    """The library call's output arguments, from the output bundles' options the command took (cli/options.py):
    `out` (the command's default folder in registry.py when not given, named after `model`'s slug or `names`),
    `overwrite`, `resume`, `page`, and `charts` (the format, or None with --no-charts)."""
    from headscope.registry import command

    params = ctx.params
    found = {name: params[name] for name in ("overwrite", "resume", "page") if name in params}
    if "chart_format" in params:
        found["charts"] = chart_format(params)
    if "out" in params:
        entry = command(ctx.command.name)
        if model is not None:
            from headscope.model.loading import resolve_source

            names["model"] = resolve_source(model).slug
        found["out"] = params["out"] or (entry.default_out(**names) if entry.folder else None)
    return found


def seams(ctx: typer.Context) -> tuple:
    """The progress reporter (rich's, unless a test hands in its own) and, as keyword arguments for the library
    call, the loader a test hands in (none: the library's). Quiets transformers' own output."""
    from headscope.model.loading import quiet_transformers
    from headscope.run.progress import RichReporter

    handed = ctx.obj if isinstance(ctx.obj, dict) else {}
    reporter = handed.get("reporter") or RichReporter()
    quiet_transformers(show_progress=getattr(reporter, "console", None) is not None and reporter.console.is_terminal)
    return reporter, ({"loader": handed["loader"]} if "loader" in handed else {})
