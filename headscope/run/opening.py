"""Opening the model for a run: the settings checked against its config and the tokenizer checked before any
weight is read, the weights loaded by the command's loader, --offload-folder's scratch removed and --threads set for
the run's length."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from headscope.config import RunConfig
from headscope.errors import ConfigError
from headscope.model.loading import LoadedModel, Loader, ModelSource, load_config, load_tokenizer
from headscope.model.once import one_load
from headscope.run.plan import check_settings


def load_checked(
    model, source: ModelSource, settings: RunConfig, loader: Loader, reporter, *, lm_head: bool | str, what: str,
    before_weights: Callable[[object, object], None] | None = None,
) -> LoadedModel:  # fmt: skip
    """The model a run uses: the caller's (its config checked against the settings), or read (config first, the
    settings checked against it, then the tokenizer and `before_weights(tokenizer, model_config)`, so that a bad
    option or input costs no weights) and loaded by `loader`. lm_head: the command scores the model's loss
    (run.plan.needs_lm_head); what: the command or option that does, as messages name it."""
    if isinstance(model, LoadedModel):
        check_settings(settings, model.model.config)
        if before_weights is not None:
            before_weights(model.tokenizer, model.model.config)
        loaded = model
    else:
        reporter.stage(f"loading {source.display}")
        with one_load():  # the GGUF file parsed once for the config, the tokenizer and the weights
            options = {"revision": settings.revision, "trust_remote_code": settings.trust_remote_code}
            model_config = load_config(source, **options)
            check_settings(settings, model_config)
            if before_weights is not None:
                before_weights(load_tokenizer(source, **options), model_config)
            loaded = loader(source, settings, model_config, lm_head)
    if lm_head is True and loaded.lm is None:
        raise ConfigError(f"{what} needs the model's LM head; load it with headscope.load_model(..., lm_head=True)")
    return loaded


def open_model(
    stack: contextlib.ExitStack,
    model,
    source: ModelSource,
    settings: RunConfig,
    loader: Loader,
    reporter,
    *,
    lm_head: bool | str = False,
    what: str = "this command",
    together=None,
    before_weights: Callable[[object, object], None] | None = None,
) -> LoadedModel:
    """`load_checked`, for a run whose clean-up `stack` holds: what loading writes into --offload-folder is removed
    when the stack closes, and torch uses --threads threads until then. together(step): how `step` runs (every
    rank of a data-parallel run at once); default: just run it. before_weights(tokenizer, model_config): what the
    command checks with the tokenizer and the config alone, before the weights load."""
    from headscope.model.placement import OffloadScratch

    scratch = OffloadScratch(settings.offload_folder if not isinstance(model, LoadedModel) else None)
    stack.callback(scratch.remove)

    def checked() -> LoadedModel:
        return load_checked(model, source, settings, loader, reporter, lm_head=lm_head, what=what,
                            before_weights=before_weights)  # fmt: skip

    loaded = (together or (lambda step: step()))(checked)
    scratch.loaded()
    if settings.threads is not None:
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(settings.threads)
    return loaded
