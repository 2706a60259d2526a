"""prune(): as many heads removed together as a loss budget allows, every step verified by a forward pass.

the search     interventions/search.py: rounds that rank the heads by a second-order estimate from a gradient pass
               and verify the longest prefix it fits in the allowance (heads verified alone only where it took
               none), the first step the one-shot answer, every accepted step verified; with resume, every
               answer it got is journalled (interventions/journal.py) and an interrupted search replays them
the removal    zero, or each head's clean corpus mean (interventions/removal.py)
the output     prune.json (heads in removal order, clean and verified pruned loss, the curve), head_mask.parquet
               ((layers, heads) 0/1, usable as `head_mask`), prune.html (the heads on the grid, coloured by what
               the search did to each, and its curve), prune_curve.png; with save_model, a transformers
               checkpoint with the heads removed from its weights (surgery.py), reloaded and its loss checked
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from headscope.arguments import as_number, as_path, head_name
from headscope.config import CHART_FORMATS, DEFAULT_REMOVAL, PRUNE_PATIENCE, REMOVAL_MODES, RunConfig
from headscope.errors import ConfigError, HeadscopeError, OutputError, one_line
from headscope.files import atomic_path
from headscope.interventions.group_losses import PassPlan
from headscope.interventions.journal import SearchJournal
from headscope.interventions.kv_policy import policy_record
from headscope.interventions.loss_model import LossModel, loss_model, plain_loss
from headscope.interventions.prune_passes import FIRST_SHORTLIST, LONGEST, SHORTLIST, TRIES, search_on_model
from headscope.interventions.removal import Removal, Window, window_of
from headscope.interventions.search import PruneResult
from headscope.interventions.surgery import check_savable
from headscope.layout import (
    HEAD_MASK_FILE,
    KV_POLICY_RECORD,
    PRUNE_JOURNAL,
    PRUNE_PAGE,
    PRUNE_RECORD,
    PRUNED_MODEL_RECORD,
    SCHEMA_VERSION,
)
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.output import resolved
from headscope.progress import Reporter
from headscope.report.page import write_view
from headscope.report.prune_page import prune_page
from headscope.run.corpus import Corpus
from headscope.run.distributed import ONE_PROCESS
from headscope.run.record import fingerprint, versions
from headscope.run.setup import INTERVENTION_SETTINGS, CommandRun, record_header
from headscope.tables import write_json

SAVED_TOLERANCE = 1e-4  # nats: the saved checkpoint's loss must equal the verified pruned loss this closely
ESTIMATE = "first order + curvature"  # what ranks the heads; a journal of another estimate's search is refused
JOURNAL_FORMAT = 3  # 3: a step verified by its gradient pass (2 asked other questions); another format is refused
PRUNE_SETTINGS = (*INTERVENTION_SETTINGS, "layers")


@dataclass
class SavedModel:
    """The pruned checkpoint: where, its own loss (checked against the search's), or why it was not saved."""

    path: str | None
    loss: float | None = None
    mode: str | None = None
    heads_removed: list[str] | None = None
    error: str | None = None


@dataclass
class Pruning:
    """What `prune` found; `record` is prune.json, built from these fields alone."""

    model: str  # its name (ModelSource.name: a hub id or alias, or a local folder's or file's own name)
    mode: str
    result: PruneResult  # the search's: heads in removal order, clean and verified loss, the curve
    total_heads: int
    head_mask: pd.DataFrame  # (layers, heads), 1 kept, 0 removed
    header: dict  # run.setup.record_header
    seconds: float
    candidates: int  # heads the search could remove (all, or those of --layers)
    patience: int
    max_rounds: int | None
    passes: PassPlan  # the verifying forward passes the search ran (gradient passes are counted apart)
    depth: int
    resumed_calls: int = 0  # answers replayed from an interrupted search's journal
    saved_model: SavedModel | None = None
    window: Window | None = None  # window mode: the keys a windowed head keeps
    kv_policy: dict | None = None  # window mode: kv-policy.json (interventions/kv_policy.py)
    folder: Path | None = None

    @property
    def heads(self) -> list[str]:
        return [head_name(*h) for h in self.result.heads]

    def __repr__(self) -> str:
        result = self.result
        return (f"Pruning(model={self.model!r}, {len(result.heads)} of {self.total_heads} heads removed, "
                f"{result.loss - result.clean_loss:+.4f} nats of {result.budget:g})")  # fmt: skip

    def _repr_html_(self) -> str:
        """In a notebook: what was removed within which budget, and the verified curve."""
        from headscope.report.notebook import block, facts, table

        result = self.result
        curve = [(n, loss, loss - result.clean_loss) for n, loss in result.curve]
        return block(
            f"headscope prune: {self.model}",
            facts(
                [
                    ("removed", f"{len(result.heads)} of {self.total_heads} heads"),
                    ("mode", self.mode),
                    *self._window_facts,
                    ("budget", f"{result.budget:g} nats"),
                    ("clean loss", result.clean_loss),
                    ("pruned loss", result.loss),
                    ("stopped", result.stopped),
                ]
            ),
            table(["heads removed", "verified loss", "delta"], curve, caption="the verified curve"),
            facts([("heads, in removal order", ", ".join(self.heads))]),
        )

    def to_html(self) -> str:
        return self._repr_html_()

    @property
    def _window_facts(self) -> list[tuple[str, str]]:
        """Window mode's facts for the notebook view: the keys kept, and what the policy frees."""
        if self.window is None or self.kv_policy is None:
            return []
        kv, memory = self.kv_policy["kv_heads"], self.kv_policy["memory"]["longest_text"]
        return [
            ("keys kept", self.window.kept),
            ("KV heads whose cache can shrink", f"{kv['windowed']} of {kv['total']}"),
            ("KV cache freed at the longest text", f"{memory['freed_share']:.1%} of {memory['tokens']:,} tokens'"),
        ]

    @property
    def record(self) -> dict:
        result = self.result
        return {
            **self.header,
            "mode": self.mode,
            **({} if self.window is None else {"window": dataclasses.asdict(self.window)}),
            "budget": result.budget,
            "clean_loss": result.clean_loss,
            "pruned_loss": result.loss,
            "delta": result.loss - result.clean_loss,
            "heads": self.heads,
            "total_heads": self.total_heads,
            "curve": [{"heads_removed": n, "loss": loss} for n, loss in result.curve],
            "set_aside": [head_name(*h) for h in result.set_aside],
            "search": {
                "rank": "rounds: a gradient pass ranks the remaining heads by a second-order estimate on the model "
                "pruned so far; half of the longest prefix whose estimates fit the budget left is removed in the "
                "next gradient pass, whose forward's loss verifies it; where it overshoots, nested smaller sizes "
                "are verified by a replicated pass; where none fits, a shortlist is verified alone and packed "
                "cheapest first; the first step is the one-shot answer",
                "estimate": ESTIMATE,
                "shortlist": SHORTLIST,
                "first_shortlist": FIRST_SHORTLIST,
                "longest": LONGEST,
                "one_shot": result.one_shot,
                "nested_steps": TRIES,
                "patience": self.patience,
                "max_rounds": self.max_rounds,
                "candidates": self.candidates,
                "rounds": result.rounds,
                "stopped": result.stopped,
                "verified_sets": result.verified_sets,
                "verify_calls": result.verify_calls,
                "gradient_passes": result.estimates,
                "forward_passes": self.passes.forwards,
                "token_forwards": round(self.passes.token_layers / max(self.depth, 1)),
                "resumed_calls": self.resumed_calls,
            },
            "seconds": round(self.seconds, 1),
            "saved_model": None if self.saved_model is None else dataclasses.asdict(self.saved_model),
        }


def prune(
    model: str | LoadedModel,
    corpus: str | Path | Corpus | list[str] | None = None,
    *,
    budget: float,
    mode: str = DEFAULT_REMOVAL,
    window: int | None = None,
    sink: int | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    save_model: str | Path | None = None,
    charts: str | None = CHART_FORMATS[0],
    page: bool = True,
    resume: bool = False,
    max_rounds: int | None = None,
    patience: int = PRUNE_PATIENCE,
    config: RunConfig | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Pruning:
    """Remove as many heads as `budget` (nats of corpus loss above the clean model's) allows, every step
    verified by a forward pass with every removed head removed together (see headscope.interventions.search).

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model (with its LM head).
        corpus: file path, list of sentences, or None for the shipped corpus.
        budget: the loss the removed heads may cost together, in nats per predicted token.
        mode: "zero", "mean" or "window" (as ablate's: the heads it removes are windowed, not removed; their
            policy is kv-policy.json's).
        window: window mode: the recent keys a windowed head keeps, its own included (default 64).
        sink: window mode: the sentence's first keys it keeps too (default 4).
        out: the folder to write prune.json and head_mask.parquet into; None keeps the result in memory.
        overwrite: replace `out` if this command wrote it before.
        save_model: a new (or empty, or earlier pruned-model) folder for the pruned checkpoint.
        charts: the curve's format, or None.
        page: write prune.html (the heads on the grid, the curve, the taken heads).
        resume: continue an interrupted search from the journal beside `out`.
        max_rounds: stop after this many rounds.
        patience: when a search that no longer gains stops (interventions/search.py).
        config: the settings as a RunConfig (as `ablate`'s, and `layers`: the only layers whose heads it may
            remove).
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        A Pruning: the removed heads, the verified loss, and the search's curve and counts.
    """
    budget, max_rounds, patience = check_request(budget, mode, charts, max_rounds=max_rounds, patience=patience,
                                                 saving=save_model is not None)  # fmt: skip
    kept = window_of(mode, window, sink)
    out, save_model = as_path(out, "out"), as_path(save_model, "save_model")
    if resume and out is None:
        raise ConfigError("--resume needs an output folder (--out): the search's journal is kept beside it")
    _check_folders(out, save_model)
    run = CommandRun.prepare(model, corpus, config=config, options=options, reporter=reporter)
    run.request = {"budget": budget, "mode": mode, "window": kept, "max_rounds": max_rounds, "patience": patience,
                   "resume": resume, "save_model": save_model is not None}  # fmt: skip
    ranks = run.data_parallel(model, "prune")
    settings, reporter, corpus = run.settings, run.reporter, run.corpus
    # Every check that can be made before the search is made before it (the folders now, the model once loaded).
    model_stage = run.stage(save_model, "model", overwrite=overwrite)
    started = time.perf_counter()
    session = run.session(model, loader, what="prune", out=out, kind="pruning", overwrite=overwrite, resumable=True,
                          continuing=resume, lm_head=True, also={"--save-model": save_model})  # fmt: skip
    with session as opened:
        with loss_model(opened.loaded, opened.plan, corpus, reporter, opened.ranks, "prune") as lm:
            if save_model is not None:
                check_savable(lm.loaded.lm, model_stage.target, mean=mode == "mean", head_count=lm.plan.heads,
                              head_dim=lm.plan.architecture["head_dim"])  # fmt: skip
            candidates = [head for head in lm.all_heads if head[0] in lm.plan.layers]
            journal = None
            if out is not None:  # every search keeps its journal: an interrupted one can be resumed
                key = fingerprint(lm.loaded, corpus, settings, ONE_PROCESS) | {"budget": budget, "mode": mode,
                      "max_rounds": max_rounds, "patience": patience, "estimate": ESTIMATE,
                      "journal": JOURNAL_FORMAT}  # fmt: skip
                if kept is not None:  # (zero and mean keep the key their journals were written with)
                    key["window"] = dataclasses.asdict(kept)
                journal = SearchJournal(opened.stage.path / PRUNE_JOURNAL, key, resume=resume, writes=ranks.main,
                                        candidates=candidates)  # fmt: skip
                if journal.calls:
                    reporter.note(f"resuming the interrupted search: {len(journal.calls)} answers saved in "
                                  f"{journal.path} are replayed, then it goes on")  # fmt: skip
            search = search_on_model(lm, candidates, budget, mode, reporter, journal, max_rounds=max_rounds,
                                     patience=patience, window=kept)  # fmt: skip
        result, removal = search.result, search.removal
        found = Pruning(
            lm.loaded.source.name, mode, result, len(lm.all_heads), head_mask(result.heads, lm.plan.depth,
            lm.plan.heads), record_header(lm.loaded, settings, PRUNE_SETTINGS, corpus),
            time.perf_counter() - started, len(candidates), patience, max_rounds, search.passes, lm.plan.depth,
            journal.replayed if journal is not None else 0, window=kept,
        )  # fmt: skip
        failure = None
        if save_model is not None and ranks.main:
            try:  # published (or removed) when this block ends, before the pruning's own folder
                with model_stage as saving:
                    saved = _save(lm, result, removal, saving.path, reporter)
                found.saved_model = dataclasses.replace(saved, path=str(model_stage.target))
            # Whatever goes wrong in saving (a full disk, an architecture transformers cannot write), the verified
            # search is still worth keeping: prune.json says what failed.
            except Exception as err:
                failure = str(err) if isinstance(err, HeadscopeError) else one_line(err)
                found.saved_model = SavedModel(path=None, error=failure)
        if kept is not None:
            found.kv_policy = policy_record(lm, result, kept)
        if opened.folder is not None:  # rank 0 writes
            _write(opened.folder, found, charts, page, reporter)
            # only now: a run interrupted while writing keeps the journal, which --resume replays to the end
            (opened.folder / PRUNE_JOURNAL).unlink(missing_ok=True)
    if failure is not None:
        kept = f"; prune.json and head_mask.parquet were written to {opened.target}" if out is not None else ""
        raise OutputError(f"the pruned model was not saved: {failure}{kept}")
    found.folder = opened.target
    run.done(opened)
    return found


def _check_folders(out, save_model) -> None:
    """--out and --save-model each need a folder of their own, neither inside the other."""
    if out is None or save_model is None:
        return
    a, b = resolved(out), resolved(save_model)
    if a == b:
        raise ConfigError("--out and --save-model name the same folder; the pruned model needs a folder of its own")
    if a in b.parents or b in a.parents:
        inner, outer = ("--save-model", "--out") if a in b.parents else ("--out", "--save-model")
        raise ConfigError(f"{inner} is inside {outer}; each needs a folder of its own, side by side")


def check_request(
    budget, mode: str, charts: str | None, *, max_rounds: int | None = None, patience: int = PRUNE_PATIENCE,
    saving: bool = False,
) -> tuple[float, int | None, int]:  # fmt: skip
    """Refuse a budget, mode, chart format or stopping rule that cannot be, before anything loads; return the
    budget, max_rounds and patience as plain numbers (whatever number type they were given as). saving: a pruned
    model is to be saved (--save-model)."""
    budget = as_number(budget, "--budget")
    if not (math.isfinite(budget) and budget > 0):
        raise ConfigError(f"--budget must be a positive number of nats; got {budget}")
    max_rounds = None if max_rounds is None else as_number(max_rounds, "--max-rounds", whole=True)
    if max_rounds is not None and max_rounds < 0:
        raise ConfigError(f"--max-rounds must be a whole number, 0 or more; got {max_rounds}")
    patience = as_number(patience, "--patience", whole=True)
    if patience < 0:
        raise ConfigError(f"--patience must be a whole number, 0 or more (0: never stop early); got {patience}")
    if mode not in REMOVAL_MODES:
        raise ConfigError(f"--mode takes {', '.join(REMOVAL_MODES)}; got {mode!r}")
    if charts is not None and charts not in CHART_FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(CHART_FORMATS)}; got {charts!r}")
    if saving and mode == "window":
        raise ConfigError("--save-model writes removed heads into the weights; windowed heads are a KV-cache policy "
                          "(kv-policy.json), not weights: drop --save-model or use --mode zero or mean")  # fmt: skip
    return budget, max_rounds, patience


def head_mask(heads, depth: int, count: int) -> pd.DataFrame:
    """(layers, heads) 0/1 float32, 0 where a head is removed: rows indexed by layer, one column per head."""
    mask = np.ones((depth, count), dtype=np.float32)
    for layer, head in heads:
        mask[layer, head] = 0.0
    return pd.DataFrame(mask, index=pd.RangeIndex(depth, name="layer"), columns=[str(h) for h in range(count)])


def _write(folder: Path, found: Pruning, charts: str | None, page: bool, reporter: Reporter) -> None:
    """head_mask.parquet, kv-policy.json (window mode), prune.json, prune.html and the charts, into the staged
    `folder`."""
    with atomic_path(folder / HEAD_MASK_FILE) as tmp:
        found.head_mask.to_parquet(tmp)
    if found.kv_policy is not None:
        write_json(found.kv_policy, folder / KV_POLICY_RECORD)
    record = found.record
    write_json(record, folder / PRUNE_RECORD)
    missed = write_view(lambda: prune_page(record, found.kv_policy), folder / PRUNE_PAGE) if page else None
    if missed is not None:
        reporter.warn(f"could not write {missed}; prune.json and head_mask.parquet are written")
    if charts:
        from headscope.report.prune_chart import draw_prune_chart

        for failed in draw_prune_chart(record, folder, charts, found.kv_policy)[1]:
            reporter.warn(f"could not draw {failed}; prune.json and head_mask.parquet are written")


def _save(lm: LossModel, result: PruneResult, removal: Removal, folder: Path, reporter: Reporter) -> SavedModel:
    """Write the pruned checkpoint into `folder`, load it back with transformers and check its loss."""
    from headscope.interventions.surgery import pruned_weights
    from headscope.model.gguf_cache import plain_checkpoint

    loaded, plan = lm.loaded, lm.plan
    reporter.stage(f"saving the pruned model ({len(result.heads)} heads removed from its weights)")
    with pruned_weights(loaded.lm, result.heads, removal, head_count=plan.heads,
                        head_dim=plan.architecture["head_dim"]), plain_checkpoint(loaded.lm):  # fmt: skip
        loaded.lm.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    reporter.stage("loading the saved model back to check its loss")
    loss = plain_loss(folder, lm)
    if not abs(loss - result.loss) <= SAVED_TOLERANCE:
        raise OutputError(
            f"the saved model's loss is {loss:.6f} nats where the pruned model's was {result.loss:.6f}: this "
            f"architecture computes something besides its output projection from the heads' outputs; nothing was saved"
        )
    saved = SavedModel(
        path=str(folder), loss=loss, mode=removal.mode, heads_removed=[head_name(*h) for h in result.heads]
    )
    record = {"loss": saved.loss, "mode": saved.mode, "heads_removed": saved.heads_removed}
    write_json({"schema_version": SCHEMA_VERSION, **record, "versions": versions()}, folder / PRUNED_MODEL_RECORD)
    return saved
