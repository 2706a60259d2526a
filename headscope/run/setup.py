"""The set-up every model command shares, written once: analyze, inspect, ablate, prune and patch (and the next
command) differ only in what they do with the model.

    CommandRun.prepare   the settings (checked), the reporter, the corpus, the model's source and the inputs an
                         output may never replace; all of it before anything heavy loads
    .data_parallel       under torchrun, this process's rank (its device, one reporter), or a refusal in one line
    .session             a context: the output folder staged (the output rule checked now), the offload folder
                         checked, the process group joined, the model loaded (with its LM head when the command
                         scores the loss) and its plan, the report's model checked; on a clean exit the output is
                         published (Session.target), on an error it is not
    record_header        what every command's record (inspect.json, ablation.json, prune.json) opens with

A command is then: prepare, its own checks, `with run.session(...) as session:` its work, `run.done(session)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from headscope.arguments import as_path
from headscope.config import RunConfig, run_settings
from headscope.errors import ConfigError
from headscope.layout import SCHEMA_VERSION
from headscope.model.identity import check_report_model, weights_fingerprint
from headscope.model.loading import (
    LoadedModel,
    Loader,
    ModelSource,
    pick_device,
    protected_inputs,
    resolve_source,
)
from headscope.model.placement import check_offload_folder, dtype_name
from headscope.output import StagedDirectory
from headscope.progress import NullReporter, Reporter
from headscope.report.report import read_run
from headscope.run.corpus import Corpus, as_corpus
from headscope.run.distributed import (
    ONE_PROCESS,
    Ranks,
    agree,
    broadcast,
    check_parallel_model,
    join,
    leave,
    rank_device,
    ranks_from_env,
    together,
)
from headscope.run.opening import open_model
from headscope.run.plan import Plan, plan_for_model, resized
from headscope.run.progress import default_reporter
from headscope.run.record import Timings, versions

# The settings a command reads, as its record lists them (the rest of RunConfig is analyze's alone): what loads the
# model and reads the corpus, and each command's own.
MODEL_AND_CORPUS = (
    "device", "dtype", "max_length", "max_memory", "threads", "revision", "trust_remote_code", "device_map",
    "offload_folder", "text_column", "encoding_errors", "block_bytes", "padding_side",
)  # fmt: skip
INTERVENTION_SETTINGS = (*MODEL_AND_CORPUS, "bootstrap", "bootstrap_seed", "batch_size")  # ablate, prune
INSPECT_SETTINGS = (*MODEL_AND_CORPUS, "layers", "probe_seeds", "probe_length")


@dataclass
class Session:
    """What `CommandRun.session` yields: the model opened, and where this process writes."""

    stack: contextlib.ExitStack  # closed when the session ends: the model, the folders, the process group
    loaded: LoadedModel
    plan: Plan
    folder: Path | None  # where this rank writes: the staged output, a scratch folder, rank 0's (shared), or None
    stage: StagedDirectory | None  # the staged output (every rank knows where it is; rank 0 alone publishes it)
    ranks: Ranks
    target: Path | None = None  # where the output was published, once the session ended (rank 0; None without)


@dataclass
class CommandRun:
    """What a model command knows before its model loads."""

    settings: RunConfig
    reporter: Reporter
    source: ModelSource
    corpus: Corpus | None
    protected: dict[str, Path]  # description -> path: what its outputs may never replace
    ranks: Ranks = ONE_PROCESS  # set by `data_parallel`
    # what the command was asked beyond its settings (heads, mode, budget, ...): every rank must be asked the same
    request: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def prepare(
        cls,
        model,
        corpus=None,
        *,
        config: RunConfig | None = None,
        options: dict | None = None,
        reporter: Reporter | None = None,
        report=None,
        reads_corpus: bool = True,
    ) -> CommandRun:
        """model: a name, path or LoadedModel; corpus: as run.corpus.as_corpus takes it (read only when the command
        reads one); report: a report folder the command reads (protected like the model and the corpus)."""
        settings = run_settings(config, **(options or {}))
        corpus = as_corpus(corpus, settings) if reads_corpus else None
        source = model.source if isinstance(model, LoadedModel) else resolve_source(model)
        report = as_path(report, "report")
        protected = protected_inputs(source, corpus, Path(report) if report is not None else None)
        return cls(settings, reporter or default_reporter(), source, corpus, protected)

    def stage(
        self, out, kind: str, *, overwrite: bool, resumable: bool = False, continuing: bool | None = None
    ) -> StagedDirectory | None:
        """The staged output folder of `kind` (registry.kinds()), every rule checked now; None without `out`. resumable:
        its work folder keeps a checkpoint when the run fails; continuing: this run may take one an interrupted run
        kept (default: `resumable`)."""
        out = as_path(out, "out")
        if out is None:
            return None
        return StagedDirectory(Path(out), kind=kind, overwrite=overwrite, resumable=resumable, continuing=continuing,
                               protected=self.protected, notify=lambda text: self.reporter.note(text))  # fmt: skip

    def check_offload_folder(self, model, outputs: dict[str, str | Path | None]) -> None:
        """--offload-folder may not be an output (`outputs`: option -> folder, e.g. {"--out": out}) or inside one,
        nor the model's folder or the corpus's folder (checked before loading)."""
        if isinstance(model, LoadedModel):
            return
        within = {option: Path(folder) for option, folder in outputs.items() if folder is not None}
        if self.source.kind != "hub":
            within["the model's folder"] = Path(self.source.location)
        equal = {"the corpus's folder": self.corpus.path.parent} if self.corpus is not None else {}
        check_offload_folder(self.settings.offload_folder, within=within, equal=equal)

    @contextlib.contextmanager
    def session(
        self,
        model,
        loader: Loader,
        *,
        what: str,
        out=None,
        kind: str = "",
        overwrite: bool = False,
        resumable: bool = False,
        continuing: bool | None = None,
        scratch: str | None = None,
        shared: bool = False,
        lm_head: bool | str = False,
        report: Path | None = None,
        before_weights: Callable | None = None,
        also: dict[str, Path | None] | None = None,
        timings: Timings | None = None,
    ) -> Iterator[Session]:
        """Everything a model command does around its work, in this order: `out` staged as `kind` (registry.kinds();
        resumable and continuing as `stage` takes them) and the offload folder checked against it and `also` (more
        outputs, by option), before anything loads; rank 0 enters the staged folder (or, without `out`, a scratch
        folder named after `scratch`, if given); under torchrun every rank joins the process group, and with
        `shared` writes into rank 0's folder; the model opens (`what` names the command in messages; lm_head and
        before_weights as `open_model` takes them; its time in `timings`' load phase) and `report`'s model is
        checked against it. Leaving the block closes all of it: the output is published on a clean exit
        (Session.target) and dropped on an error (kept for --resume where resumable)."""
        ranks = self.ranks
        stage = self.stage(out, kind, overwrite=overwrite, resumable=resumable, continuing=continuing)
        self.check_offload_folder(model, {"--out": out, **(also or {})})
        with contextlib.ExitStack() as stack:
            folder = None
            if stage is not None and ranks.main:
                folder = stack.enter_context(stage).path  # leftovers of killed runs it removes are noted
            elif stage is None and scratch is not None and ranks.main:
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"headscope-{scratch}-")))
            if ranks.parallel:
                join(ranks, pick_device(self.settings.device))
                stack.callback(leave, ranks)
                agree(ranks, self.facts(what))  # before any rank loads or reads anything
                if shared:  # every rank writes its parts into rank 0's folder
                    folder = Path(broadcast(ranks, str(folder) if ranks.main else None))
            with timings.phase("load") if timings is not None else contextlib.nullcontext():
                loaded, plan = self._open(stack, model, loader, lm_head=lm_head, what=what,
                                          before_weights=before_weights)  # fmt: skip
            if report is not None:
                check_report_model(read_run(Path(report)), loaded, report)
            session = Session(stack, loaded, plan, folder, stage, ranks)
            yield session
        session.target = stage.target if stage is not None and ranks.main else None

    def done(self, session: Session) -> None:
        """The command's last stage line: where its output went (the notebook's display ends there)."""
        target = session.target
        self.reporter.stage("done" if target is None else f"done: wrote {target}")

    def _open(
        self, stack: contextlib.ExitStack, model, loader: Loader, *, lm_head: bool | str, what: str, before_weights
    ) -> tuple[LoadedModel, Plan]:
        """The model loaded (its clean-up on `stack`) and the run's plan; under torchrun every rank loads at once and
        batches as rank 0 does (batches decide the order of float sums)."""
        ranks = self.ranks
        loaded = open_model(stack, model, self.source, self.settings, loader, self.reporter, lm_head=lm_head,
                            what=what, together=functools.partial(together, ranks),
                            before_weights=before_weights)  # fmt: skip
        if ranks.parallel:  # the same source can hold other weights on another machine
            agree(ranks, {"the model's weights (sha256)": weights_fingerprint(loaded.model)})
        plan = plan_for_model(self.settings, loaded)
        if ranks.parallel:
            plan = resized(plan, broadcast(ranks, plan.sizing), loaded.model.config, dtype=loaded.dtype,
                           device_type=loaded.device.type)  # fmt: skip
        return loaded, plan

    def facts(self, what: str) -> dict:
        """What every rank of a data-parallel run must share: the command, its settings (but the device, each
        rank's own) and request, and what identifies its model and corpus."""
        settings = {key: value for key, value in self.settings.to_dict().items() if key != "device"}
        corpus = None if self.corpus is None else (self.corpus.sha256, len(self.corpus.sentences))
        model = (self.source.kind, self.source.location, self.source.gguf_file)
        return {"command": what, "model": model, "corpus (sha256, sentences)": corpus, "settings": settings,
                **{key: _comparable(value) for key, value in self.request.items()}}  # fmt: skip

    def data_parallel(self, model, what: str, *, missing_out: bool = False) -> Ranks:
        """Under torchrun, this process's rank (one process otherwise; kept as `ranks`): each rank on its own
        device, one reporter (rank 0's); refused in one line where it cannot be: a model already loaded, a device
        map, or no --out for a command whose ranks share it (missing_out). Call it before reading `settings` and
        `reporter`."""
        ranks = ranks_from_env()
        if ranks.parallel:
            if missing_out:
                raise ConfigError(
                    "a data-parallel run (torchrun) needs --out: every rank writes its part of the tables there"
                )
            check_parallel_model(self.settings, isinstance(model, LoadedModel), what)
            self.settings = dataclasses.replace(self.settings, device=rank_device(ranks, self.settings.device))
            self.reporter = self.reporter if ranks.main else NullReporter()
        self.ranks = ranks
        return ranks


def record_header(loaded: LoadedModel, settings: RunConfig, used: tuple[str, ...], corpus: Corpus | None) -> dict:
    """What a command's record opens with: schema, time, model, corpus, device, dtype, the settings it read (`used`:
    RunConfig field names) and the package versions."""
    header = {
        "schema_version": SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"input": loaded.source.display, "name": loaded.source.name, "architecture": loaded.architecture},
    }
    if corpus is not None:
        header["corpus"] = {"path": str(corpus.path), "sentences": len(corpus.sentences)}
    return header | {
        "device": str(loaded.device),
        "dtype": dtype_name(loaded.dtype),
        "settings": {key: value for key, value in settings.to_dict().items() if key in used},
        "versions": versions(),
    }


def _comparable(value):
    """A request's value as every rank can compare it: paths as text, sequences as lists, dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _comparable(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(key): _comparable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_comparable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value
