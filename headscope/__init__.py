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
"""

import importlib
from importlib import metadata

from headscope.config import RunConfig, Thresholds
from headscope.errors import HeadscopeError

try:
    __version__ = metadata.version("headscope")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"

_LAZY = {
    "analyze": "headscope.commands.analyze",
    "inspect": "headscope.commands.inspect",
    "ablate": "headscope.commands.ablate",
    "prune": "headscope.commands.prune",
    "patch": "headscope.commands.patch",
    "circuit": "headscope.commands.circuit",
    "copying": "headscope.commands.copying",
    "Report": "headscope.report.report",
    "load_model": "headscope.model.loading",
}

__all__ = [
    "HeadscopeError",
    "Report",
    "RunConfig",
    "Thresholds",
    "__version__",
    "ablate",
    "analyze",
    "circuit",
    "copying",
    "inspect",
    "load_model",
    "patch",
    "prune",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'headscope' has no attribute {name!r}")
