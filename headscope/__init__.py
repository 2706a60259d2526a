"""headscope: measure, classify and chart every attention head of a Hugging Face causal LM.

import headscope
report = headscope.analyze("gpt2", "sentences.txt", out="reports/gpt2")
report.heads            # one row per (layer, head)
report.layer_entropy()  # mean entropy per layer, in nats
headscope.Report.open("reports/gpt2")  # the same report, read back from its folder
seen = headscope.inspect("gpt2", texts=["When Mary and John went..."], heads=[(5, 1)])
seen.attention          # text_id, layer, head, query, key, weight: every visible pair
headscope.ablate("gpt2", heads=[[(5, 1), (5, 5)]], loss_on="repeats").groups  # heads removed together
headscope.prune("gpt2", budget=0.05).record["heads"]  # as many heads as 0.05 nats of loss allows
headscope.patch("gpt2", "pairs.jsonl").top(10)  # the heads whose clean output restores the behaviour
headscope.circuit("gpt2", "pairs.jsonl").top(10)  # the edges between components that carry it
headscope.copying("gpt2").heads  # what each head's weights copy (the OV copying score), with no data

`import headscope` is cheap: torch and transformers are imported when `analyze` or `load_model` is first used.

Modules:
    arguments       What a user names on the command line or from Python (layers, heads, ids, sizes, texts)
    columns         Every column of the heads table, declared once
    config          Run settings and head-type thresholds
    detector_specs  Detectors as the user defines them
    errors          Exceptions a user can act on
    estimates       Numbers from per-head sums, in numpy (and scipy for quantiles)
    files           Files written so that no reader ever sees half of them, and the work folders they are staged in
    labels          Head labels from the per-head table: pure functions, no model, no I/O
    layout          What each kind of folder headscope writes holds, and how to tell one from anything else
    output          Output folders: all files appear together or not at all
    progress        Progress reporting, the contract
    registry        Every command once: its CLI function, library function, output kind and default folder
    summary         Small pure summaries of the heads table shared by the CLI and the charts
    tables          Column schemas of every output table, in one place, and atomic Parquet I/O
    cli/            The `headscope` command: one module per command (options -> settings -> library call -> printout)
    commands/       The library's commands: one module per command (analyze, inspect, ablate, prune, patch, ...)
    interventions/  Heads changed on purpose: how a head is removed, the loss with heads removed, importance, ablate
    measures/       Measurements that ride on a forward pass, peers behind `headscope.model.capture.Measure`
    model/          Everything that touches the model
    report/         Everything that reads a finished report folder
    run/            What every command run shares: the plan, the corpus and its feed, the corpus pass, checkpoints
"""

import importlib
from importlib import metadata

from headscope.config import RunConfig, Thresholds
from headscope.errors import HeadscopeError
from headscope.registry import exports

try:
    __version__ = metadata.version("headscope")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

# every command with a library function (registry.py), and the two entry points that are not commands
_LAZY = {**exports(), "Report": "headscope.report.report", "load_model": "headscope.model.loading"}

__all__ = ["HeadscopeError", "Report", "RunConfig", "Thresholds", "__version__", "load_model", *exports()]


def __getattr__(name: str):
    where = _LAZY.get(name) or exports().get(name)  # exports(): a command registered since, too
    if where is not None:
        return getattr(importlib.import_module(where), name)
    raise AttributeError(f"module 'headscope' has no attribute {name!r}")
