"""The `headscope` command: `build_app` makes it from registry.py's commands, one module per command (options ->
settings -> library call -> printout), every shared option declared once (cli/options.py), errors and signals
handled once (cli/common.py).

Library errors (HeadscopeError) become one line `Error: ...` on stderr and exit code 1 (2 for a usage error).

Modules:
    ablate    `headscope ablate`: groups of heads removed together, and the loss they cost (over headscope.ablate)
    analyze   `headscope analyze`: measure every head on a corpus, classify the heads, write tables and charts
    circuit   `headscope circuit`: which components feed which
    classify  `headscope classify`: re-label a report's heads with other thresholds (no model needed)
    common    What every command shares: one-line errors, exit codes and signals, and the seams tests hand in
    compare   `headscope compare`: two reports head by head (B - A), with intervals and a false-discovery-rate flag
    copying   `headscope copying`: what each head's weights copy, the OV copying score
    inspect   `headscope inspect`: chosen heads' attention on chosen texts, token by token
    options   Every option and argument of every command
    patch     `headscope patch`: which heads carry a behaviour
    plot      `headscope plot`: draw a report's charts and page again from its tables (no model needed)
    printing  What the commands print: rich tables of a report and of a comparison
    prune     `headscope prune`: as many heads removed as a loss budget allows
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

import typer

import headscope.cli.options as o
from headscope.cli.common import (
    INTERRUPTED,
    OneLineErrors,
    PanelledCommand,
    Terminated,
    quiet_signals_in_finalizers,
    raise_interrupted,
    raise_terminated,
    say,
)
from headscope.registry import commands

ABOUT = "Measure, classify and chart every attention head of a Hugging Face causal language model."


def build_app() -> typer.Typer:
    """The `headscope` program: every command registry.py lists, in its order, each from its CLI module."""
    built = typer.Typer(
        cls=OneLineErrors,
        help=ABOUT,
        no_args_is_help=True,
        add_completion=True,  # --install-completion and --show-completion for bash, zsh, fish and PowerShell
        pretty_exceptions_enable=False,
        rich_markup_mode=None,  # click's plain help: whole option names at 80 columns (rich's table cut them)
    )

    @built.callback(help=ABOUT)
    def _commands(version: o.Version = False) -> None:
        pass

    for entry in commands():
        built.command(entry.name, cls=PanelledCommand)(getattr(importlib.import_module(entry.cli), entry.name))
    return built


app = build_app()


def main() -> None:
    if not sys.stderr.isatty():
        # No progress bars in a log: tqdm (transformers' GGUF de-quantizer uses it bare) reads this variable once,
        # when it is first imported, so it is set before anything imports it.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        # Inside the try: a SIGTERM the moment the handler is in place is still caught below (it once arrived
        # during the line above, then outside the try, and printed a traceback).
        signal.signal(signal.SIGTERM, raise_terminated)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell ignores Ctrl-C
            signal.signal(signal.SIGINT, raise_interrupted)
        sys.unraisablehook = quiet_signals_in_finalizers
        app()
    # A signal before a command's own handler is in place (while Typer builds the commands, or a command imports
    # torch): still one line and the signal's exit code.
    except KeyboardInterrupt:
        say(f"{INTERRUPTED[130]}.", err=True)
        sys.exit(130)
    except Terminated:
        say(f"{INTERRUPTED[143]}.", err=True)
        sys.exit(143)
