"""ablate(): does the model need these heads together? The corpus loss with groups of heads removed together.

    the groups     --heads L.H,... (repeat for more groups); --role R or --each-role, from a report's roles
    the removal    zero, each head's clean corpus mean, or its attention windowed to the first --sink keys and the
                   last --window ones (interventions/removal.py defines all three)
    the tokens     every predicted token, or the repeated ones an induction head can predict (--loss-on)
    or a task      --pairs FILE: the pairs' metric on each clean prompt instead of the loss
                   (interventions/pair_removal.py), its change and its share of the clean-corrupt gap
    the output     ablation.json: per group its heads, tokens, clean and ablated loss, the delta and its 95%
                   paired bootstrap interval over sentences (with --pairs: over pairs, the metric's)

Every group shares each batch's clean pass (interventions.group_losses.group_losses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from headscope.arguments import as_head_groups, as_path, as_texts, head_name
from headscope.config import DEFAULT_REMOVAL, REMOVAL_MODES, RunConfig
from headscope.errors import ConfigError
from headscope.estimates import ONE_SENTENCE_NOTE
from headscope.interventions.group_losses import SCORINGS, PassPlan, group_effect
from headscope.interventions.loss_model import loss_model
from headscope.interventions.pair_removal import pair_group_effect, removed_metrics
from headscope.interventions.pairs import as_pairs, tokenize_pairs
from headscope.interventions.patching import METRICS
from headscope.interventions.removal import Head, Window, window_of
from headscope.labels import ROLES
from headscope.layout import ABLATION_RECORD
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.progress import Reporter
from headscope.report.report import Report
from headscope.run.corpus import Corpus
from headscope.run.setup import INTERVENTION_SETTINGS, CommandRun, record_header
from headscope.tables import write_json


@dataclass(frozen=True)
class Group:
    name: str  # as the output names it: the heads ("18.6,17.4") or the role
    heads: tuple[Head, ...]
    source: str = "--heads"  # where the heads came from, as messages name it


@dataclass(frozen=True)
class GroupEffect:
    """One group's effect on the loss (nats per scored token; None where no token was scored, and the interval
    where it could not be resampled): an entry of ablation.json's `groups`."""

    name: str  # the heads ("18.6,17.4"), or the role
    heads: tuple[str, ...]  # as L.H
    mode: str
    loss_on: str
    tokens: int
    clean_loss: float | None
    ablated_loss: float | None
    delta: float | None
    delta_ci_low: float | None
    delta_ci_high: float | None


PAIR_COLUMNS = ["group", "heads", "pairs", "clean m", "ablated m", "change", "95% low", "95% high", "share of the gap"]


@dataclass(frozen=True)
class PairGroupEffect:
    """One group's effect on a task (ablate --pairs): m = logit[answer] - logit[distractor] at the last position of
    each clean prompt, means over pairs (interventions.pair_removal.pair_group_effect)."""

    name: str
    heads: tuple[str, ...]
    mode: str
    pairs: int
    clean_metric: float
    ablated_metric: float
    change: float
    change_ci_low: float | None
    change_ci_high: float | None
    gap_share: float | None


@dataclass
class Ablation:
    """What `ablate` measured, one effect per group; `record` is ablation.json, built from these fields alone."""

    model: str  # its name (ModelSource.name: a hub id or alias, or a local folder's or file's own name)
    mode: str
    loss_on: str | None  # None: a task's pairs (`pairs`) instead of the loss
    effects: list[GroupEffect] | list[PairGroupEffect]
    header: dict  # run.setup.record_header: model, corpus, device, dtype, settings, versions
    bootstrap: dict  # replicates, seed, level
    folder: Path | None = None
    planned: PassPlan | None = None  # the passes it ran, counted before it ran them
    pairs: dict | None = None  # --pairs: the file's path, sha256 and count, and the metric
    window: Window | None = None  # window mode: the keys a windowed head keeps

    @property
    def record(self) -> dict:
        groups = [dataclasses.asdict(effect) | {"heads": list(effect.heads)} for effect in self.effects]
        planned = None if self.planned is None else dataclasses.asdict(self.planned)
        task = {} if self.pairs is None else {"pairs": self.pairs}
        window = {} if self.window is None else {"window": dataclasses.asdict(self.window)}
        return {**self.header, "mode": self.mode, **window, "loss_on": self.loss_on, **task,
                "bootstrap": self.bootstrap, "planned": planned, "groups": groups}  # fmt: skip

    @property
    def groups(self) -> pd.DataFrame:
        return pd.DataFrame(self.record["groups"])

    def __repr__(self) -> str:
        return (
            f"Ablation(model={self.model!r}, mode={self.mode!r}, loss_on={self.loss_on!r}, {len(self.effects)} groups)"
        )

    def _repr_html_(self) -> str:
        """In a notebook: each group's loss against the clean loss, with its 95% interval (the printout's table)."""
        from headscope.report.notebook import block, facts, table

        if self.pairs is not None:
            rows = [(e.name, len(e.heads), e.pairs, e.clean_metric, e.ablated_metric, e.change, e.change_ci_low,
                     e.change_ci_high, e.gap_share) for e in self.effects]  # fmt: skip
            return block(
                f"headscope ablation: {self.model}",
                facts([*self._mode, ("metric", self.pairs["metric"]), ("pairs", self.pairs["count"])]),
                table(PAIR_COLUMNS, rows),
            )
        rows = [(e.name, len(e.heads), e.tokens, e.clean_loss, e.ablated_loss, e.delta, e.delta_ci_low,
                 e.delta_ci_high) for e in self.effects]  # fmt: skip
        return block(
            f"headscope ablation: {self.model}",
            facts([*self._mode, ("loss on", self.loss_on)]),
            table(["group", "heads", "tokens", "clean loss", "ablated loss", "delta", "95% low", "95% high"], rows),
        )

    def to_html(self) -> str:
        return self._repr_html_()

    @property
    def _mode(self) -> list[tuple[str, str]]:
        """The notebook view's facts on how heads were removed (and, windowed, which keys they kept)."""
        if self.window is None:
            return [("mode", self.mode)]
        return [("mode", self.mode), ("keys kept", self.window.kept)]


def ablate(
    model: str | LoadedModel,
    corpus: str | Path | Corpus | list[str] | None = None,
    *,
    heads: Sequence[Sequence[Head]] = (),
    roles: Sequence[str] = (),
    each_role: bool = False,
    report: str | Path | None = None,
    mode: str = DEFAULT_REMOVAL,
    window: int | None = None,
    sink: int | None = None,
    loss_on: str = "all",
    pairs: str | Path | Sequence[dict] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    config: RunConfig | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Ablation:
    """The corpus loss with each group of heads removed together, against the clean loss (written to
    `out`/ablation.json when `out` is given).

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model (with its LM head).
        corpus: file path, list of sentences, or None for the shipped corpus.
        heads: groups of (layer, head) pairs, each removed together.
        roles: a group of each named role's heads in `report`.
        each_role: a group for every role with heads in `report`, but "other".
        report: a report of this model, for `roles` and `each_role`.
        mode: "zero", "mean" or "window" (a head's output replaced by 0, or by its mean over the corpus; or its
            attention cut to the keys a streaming KV cache keeps, each row renormalised over them).
        window: window mode: the recent keys a windowed head keeps, its own included (default 64).
        sink: window mode: the sentence's first keys it keeps too (default 4).
        loss_on: "all" predicted tokens, or "repeats" (the second token of a bigram seen before).
        pairs: prompt pairs (a .jsonl/.csv/.tsv file or a list of dicts, as patch takes them): measure the task's
            metric on each clean prompt instead of the loss (the corpus gives mean removal its means).
        out: the folder to write ablation.json into; None keeps the result in memory.
        overwrite: replace `out` if this command wrote it before.
        config: the settings as a RunConfig (max_length, max_memory, device, dtype, threads, bootstrap,
            bootstrap_seed, text_column...).
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        An Ablation: each group's clean and ablated loss and its delta with a paired bootstrap interval.
    """
    heads = as_head_groups(heads) if heads is not None else []
    roles, report = as_texts(roles, "--role"), as_path(report, "report")
    check_request(heads, roles, each_role, report, mode, loss_on)
    kept = window_of(mode, window, sink)
    if pairs is not None and loss_on != "all":
        raise ConfigError("--loss-on scores the corpus loss; with --pairs the task's metric is measured instead")
    pairs = None if pairs is None else as_pairs(pairs)
    groups = [Group(",".join(head_name(*h) for h in group), group) for group in heads]
    if report is not None:
        groups += role_groups(report, roles, each_role)
    run = CommandRun.prepare(model, corpus, config=config, options=options, reporter=reporter, report=report)
    run.request = {"groups": [(group.name, group.heads) for group in groups], "mode": mode, "window": kept,
                   "loss_on": loss_on, "pairs (sha256)": None if pairs is None else pairs.sha256}  # fmt: skip
    ranks = run.data_parallel(model, "ablate")
    if pairs is not None and ranks.parallel:
        raise ConfigError("ablate --pairs runs in one process (a task's pairs are few): run it without torchrun")
    settings, reporter, corpus = run.settings, run.reporter, run.corpus
    if pairs is not None and pairs.path.is_file():
        run.protected["the pairs file"] = pairs.path

    def pairs_fit(tokenizer, model_config) -> None:  # what the tokenizer alone refuses, before the weights load
        if pairs is not None:
            tokenize_pairs(pairs, tokenizer, settings.max_length)

    session = run.session(model, loader, what="ablate", out=out, kind="ablation", overwrite=overwrite, lm_head=True,
                          report=report, before_weights=pairs_fit)  # fmt: skip
    with session as opened, loss_model(opened.loaded, opened.plan, corpus, reporter, opened.ranks, "ablate") as lm:
        for group in groups:
            lm.plan.check_heads(group.heads, group.source)
        if pairs is not None:
            found = _on_pairs(lm, pairs, groups, mode, kept, settings, corpus)
        else:
            found = _on_corpus(lm, groups, mode, kept, loss_on, settings, corpus)
        if opened.folder is not None:  # rank 0 writes
            write_json(found.record, opened.folder / ABLATION_RECORD)
    found.folder = opened.target
    run.done(opened)
    return found


def check_request(heads, roles, each_role: bool, report, mode: str, loss_on: str) -> None:
    """Refuse what asks for nothing or contradicts itself, before anything loads."""
    if not isinstance(each_role, bool):
        raise ConfigError(f"each_role takes True or False; got {each_role!r}")
    if mode not in REMOVAL_MODES:
        raise ConfigError(f"--mode takes {', '.join(REMOVAL_MODES)}; got {mode!r}")
    if loss_on not in SCORINGS:
        raise ConfigError(f"--loss-on takes {', '.join(SCORINGS)}; got {loss_on!r}")
    if not (heads or roles or each_role):
        raise ConfigError("nothing to ablate: pass --heads L.H,..., --role R or --each-role (with --report)")
    if any(not group for group in heads):
        raise ConfigError("--heads names no head")
    unknown = [role for role in roles if role not in ROLES]
    if unknown:
        raise ConfigError(f"--role takes {', '.join(ROLES)}; got {unknown[0]!r}")
    if (roles or each_role) and report is None:
        raise ConfigError("--role and --each-role read the heads' roles from a report: pass --report DIR")


def role_groups(report, roles: Sequence[str], each_role: bool) -> list[Group]:
    """One group per asked role (each_role: every role some head has, but "other"), its heads from `report`."""
    labelled = Report.open(report).heads
    wanted = [role for role in ROLES if role != "other"] if each_role else list(dict.fromkeys(roles))
    groups = []
    for role in wanted:
        members = labelled[labelled["role"] == role]
        if len(members):
            heads = tuple((int(r.layer), int(r.head)) for r in members.itertuples())
            groups.append(Group(role, heads, f"role {role} of {report}"))
        elif not each_role:
            raise ConfigError(f"no head of the report in {report} has role {role}")
    if not groups:
        raise ConfigError(f"no head of the report in {report} has a role (every head is other)")
    return groups


def _on_corpus(lm, groups: list[Group], mode: str, window: Window | None, loss_on: str, settings: RunConfig,
               corpus: Corpus) -> Ablation:  # fmt: skip
    """The corpus loss with each group removed together (every group shares each batch's clean pass)."""
    reporter = lm.reporter
    planned = lm.planned([g.heads for g in groups], mode)
    reporter.note(f"planned: {planned.describe(lm.plan.depth)}")
    removal = lm.removal(mode, window)
    plural = "s" * (len(groups) != 1)
    reporter.stage(f"ablating {len(groups)} group{plural} ({mode}) on {len(corpus.sentences)} sentences")
    reporter.start(len(corpus.sentences), what="ablation")
    losses = lm.losses([g.heads for g in groups], removal, scorings=(loss_on,), progress=True)
    reporter.finish()
    effects = [
        GroupEffect(group.name, tuple(head_name(*h) for h in group.heads), mode, loss_on,
                    **group_effect(losses, index, loss_on, replicates=settings.bootstrap, seed=settings.bootstrap_seed))
        for index, group in enumerate(groups)
    ]  # fmt: skip
    if settings.bootstrap and any(e.delta is not None and e.delta_ci_low is None for e in effects):
        reporter.note(f"{ONE_SENTENCE_NOTE} (sentences with a scored token)")
    return Ablation(lm.loaded.source.name, mode, loss_on, effects, *_record_parts(lm, settings, corpus),
                    planned=planned, window=removal.window)  # fmt: skip


def _record_parts(lm, settings: RunConfig, corpus: Corpus) -> tuple[dict, dict]:
    """ablation.json's header (model, corpus, device, settings...) and its bootstrap entry."""
    bootstrap = {"replicates": settings.bootstrap, "seed": settings.bootstrap_seed, "level": 0.95}
    return record_header(lm.loaded, settings, INTERVENTION_SETTINGS, corpus), bootstrap


def _on_pairs(lm, pairs, groups: list[Group], mode: str, window: Window | None, settings: RunConfig,
              corpus: Corpus) -> Ablation:  # fmt: skip
    """--pairs: each group removed on every pair's clean prompt, the metric's change (interventions.pair_removal)."""
    reporter = lm.reporter
    tokenized = tokenize_pairs(pairs, lm.loaded.tokenizer, lm.plan.max_length)
    removal = lm.removal(mode, window)
    plural = "s" * (len(groups) != 1)
    reporter.stage(f"ablating {len(groups)} group{plural} ({mode}) on {len(tokenized)} pairs' clean prompts")
    reporter.start(len(tokenized), what="ablation on pairs", unit="pairs")
    found = removed_metrics(lm.capture, lm.plan, lm.loaded.device, tokenized, [g.heads for g in groups], removal,
                            on_batch=reporter.advance)  # fmt: skip
    reporter.finish()
    effects = [
        PairGroupEffect(group.name, tuple(head_name(*h) for h in group.heads), mode,
                        **pair_group_effect(found, index, replicates=settings.bootstrap, seed=settings.bootstrap_seed))
        for index, group in enumerate(groups)
    ]  # fmt: skip
    metric = METRICS["logit_diff"]
    task = {"path": str(pairs.path), "sha256": pairs.sha256, "count": len(tokenized), "metric": metric.name,
            "definition": metric.definition}  # fmt: skip
    return Ablation(lm.loaded.source.name, mode, None, effects, *_record_parts(lm, settings, corpus), pairs=task,
                    window=removal.window)  # fmt: skip
