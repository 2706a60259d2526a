"""inspect(): chosen heads' whole attention on chosen texts, token by token.

    the texts      --text (any text), --sentences of a corpus (tokenized as analyze does), --probe (the probe
                   battery's sequence for seed 0: repeated random tokens)
    the heads      --heads L.H,...; --role R (from a report's roles, or for the probe roles from the probes run
                   first); --layers restricts either (alone: every head of those layers); default every head
    exemplars      --exemplars L.H with a report: that head on the corpus sentences of its exemplars (the
                   report's corpus; each opens at its strongest exemplar's row), commands.exemplar_texts
    the memory     the chosen heads' (t, t) float32 matrices of one text at a time, checked against the budget
                   once the texts are tokenized, before any forward pass
    the output     attention.parquet (text_id, layer, head, query, key, weight: every visible pair, the weight the
                   model computes on analyze's path), tokens.parquet, inspect.json, inspect.html

Each text runs alone (no padding), through the same capture as analyze.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from headscope.arguments import MAX_INSPECT_TEXTS, as_heads, as_ids, as_path, as_texts, head_name
from headscope.columns import PROBE_PATTERNS
from headscope.commands import why_rows
from headscope.commands.exemplar_texts import ExemplarTexts, check_rows, exemplar_texts
from headscope.config import RoleThresholds, RunConfig, run_settings
from headscope.errors import ConfigError
from headscope.interventions.qk_senders import SenderPass
from headscope.labels import PROBE_ROLES, ROLES
from headscope.layout import ATTENTION_FILE, INSPECT_PAGE, INSPECT_RECORD, QK_FILE, TOKENS_FILE
from headscope.measures.heads import (
    HeadAttention,
    by_layer,
    check_memory,
    largest_weight,
    probe_scores,
    write_pairs,
)
from headscope.measures.probes import ProbeSpec, check_probes, probe_sequences, run_probes
from headscope.model.architecture import architecture_of, layer_attention
from headscope.model.capture import attached
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.progress import Reporter
from headscope.report.report import Report
from headscope.run.corpus import Corpus, as_corpus
from headscope.run.distributed import one_process_only
from headscope.run.feed import CorpusFeed, char_limit, token_texts, tokenize_sentences
from headscope.run.plan import Plan, check_heads, max_length_for
from headscope.run.setup import INSPECT_SETTINGS, CommandRun, record_header
from headscope.tables import ATTENTION_SCHEMA, TOKENS_SCHEMA, write_json, write_table

PROBES = PROBE_PATTERNS  # --probe: the patterns whose score each head gets on the probe text


@dataclass(frozen=True)
class Text:
    source: str  # "text" (given), "corpus" or "probe"
    label: str  # as the page and the summary name it
    ids: list[int]
    sentence_id: int | None = None  # the corpus sentence, or the probe's seed
    truncated: bool = False
    exemplars: tuple[dict, ...] = ()  # with --exemplars: the head's exemplar rows in this sentence, best first


@dataclass
class Inspection:
    """What `inspect` found: its record (inspect.json), the tokens, each head's summary per text, and the
    attention (read from the folder when first used)."""

    record: dict  # inspect.json, built from the fields below (`_record`)
    tokens: pd.DataFrame
    summary: pd.DataFrame  # one row per (text_id, layer, head)
    model: str = ""  # its name (ModelSource.name: a hub id or alias, or a local folder's or file's own name)
    texts: list[Text] = dataclasses.field(default_factory=list)
    roles: dict[str, str] = dataclasses.field(default_factory=dict)  # head (L.H) -> role, where known
    roles_from: str | None = None
    probes: tuple[str, ...] = ()
    folder: Path | None = None
    _attention: pd.DataFrame | None = None
    page: str | None = None  # inspect.html's text (with page=True): what a notebook shows
    _qk: pd.DataFrame | None = None

    def __repr__(self) -> str:
        return f"Inspection(model={self.model!r}, {len(self.texts)} texts, {len(self.summary)} head views)"

    def _repr_html_(self) -> str:
        """In a notebook: the inspected heads' summary and inspect.html's head-by-text view."""
        return self._view(share_plotly=True)

    def to_html(self) -> str:
        """The view a notebook shows (`_repr_html_`) as a string that stands alone (plotly.js inlined)."""
        return self._view(share_plotly=False)

    def _view(self, *, share_plotly: bool) -> str:
        from headscope.report.notebook import block, facts, framed, table

        columns = [c for c in ("text_id", "layer", "head", "largest_at", "mean_largest") if c in self.summary]
        rows = [[", ".join(f"{name} {share:.0%}" for name, share in v) if isinstance(v, list) else v for v in row]
                for row in self.summary[columns].head(12).itertuples(index=False)]  # fmt: skip
        view = framed(self.page, share_plotly=share_plotly) if self.page is not None else ""
        return block(f"headscope inspect: {self.model}", facts([("texts", len(self.texts))]),
                     table(columns, rows, caption="where each head looks"), view)  # fmt: skip

    @property
    def attention(self) -> pd.DataFrame:
        if self._attention is None:
            self._attention = pd.read_parquet(self.folder / ATTENTION_FILE)
        return self._attention

    @property
    def qk(self) -> pd.DataFrame:
        """qk.parquet: every (query sender, key sender) pair of every row --why explained (empty without --why)."""
        if self._qk is None:
            path = None if self.folder is None else self.folder / QK_FILE
            found = path is not None and path.is_file()
            self._qk = pd.read_parquet(path) if found else why_rows.QK_SCHEMA.empty_table().to_pandas()
        return self._qk

    def why(self, row: int, key: int | None = None, *, head: tuple[int, int] | str | None = None,
            text_id: int = 0) -> pd.DataFrame:  # fmt: skip
        """The pairs of senders behind `row` attending to `key` (None: the key --why chose for the row), strongest
        contrast first: query_sender, key_sender, term, contrast (docs/why.md). head: which explained head, where
        several were (L.H or (layer, head)); text_id: which text. One line refuses a row --why did not explain."""
        table = self.qk[(self.qk["text_id"] == text_id) & (self.qk["row"] == row)]
        if head is not None:
            ((layer, number),) = as_heads([head] if isinstance(head, tuple) else head, "head")
            table = table[(table["layer"] == layer) & (table["head"] == number)]
        if key is not None:
            table = table[table["key"] == key]
        if table.empty:
            asked = f"row {row}" + ("" if key is None else f", key {key}")
            raise ConfigError(f"this inspection did not explain {asked} of text {text_id}: run inspect with --why "
                              f"{row}{'' if key is None else f':{key}'}")  # fmt: skip
        pairs = table.astype({"query_sender": str, "key_sender": str})
        return pairs.reindex(pairs["contrast"].abs().sort_values(ascending=False).index).reset_index(drop=True)

    @property
    def why_heads(self) -> pd.DataFrame:
        """One row per head --why explained: its role (where a report or the probes gave roles), rows explained,
        their mean contrast, each side's strongest senders and pairs by mean contrast, and k_composition_prev (the
        share of the key side's push for the key that previous-token heads write; docs/why.md)."""
        return pd.DataFrame(self.record.get("why", {}).get("heads", []))

    def mean_contrast(self, by: str = "pair", *, head: tuple[int, int] | str | None = None,
                      text_id: int | None = None, rows: Sequence[int] | None = None) -> pd.DataFrame:  # fmt: skip
        """The mean contrast over the explained rows (all texts, or `text_id`'s; all rows, or `rows`) of each head
        (or `head`), per sender pair (by="pair": query_sender, key_sender), per query sender (by="query": its
        contrasts summed over the key senders) or per key sender (by="key"), largest first; `rows` counts the
        explained rows averaged over."""
        groups = {"pair": ["query_sender", "key_sender"], "query": ["query_sender"], "key": ["key_sender"]}
        if by not in groups:
            raise ConfigError(f"mean_contrast: by takes {', '.join(groups)}; got {by!r}")
        table = self.qk if text_id is None else self.qk[self.qk["text_id"] == text_id]
        if rows is not None:
            table = table[table["row"].isin(list(rows))]
        if head is not None:
            ((layer, number),) = as_heads([head] if isinstance(head, tuple) else head, "head")
            table = table[(table["layer"] == layer) & (table["head"] == number)]
        table = table.astype({"query_sender": str, "key_sender": str})
        explained = (
            table[["layer", "head", "text_id", "row", "key"]].drop_duplicates().groupby(["layer", "head"]).size()
        )
        sums = table.groupby(["layer", "head", *groups[by]], sort=False)["contrast"].sum().reset_index()
        sums["rows"] = [explained[(layer, number)] for layer, number in zip(sums["layer"], sums["head"], strict=True)]
        sums["contrast"] /= sums["rows"]
        order = sums["contrast"].abs().sort_values(ascending=False).index
        return sums.reindex(order).reset_index(drop=True)[["layer", "head", *groups[by], "rows", "contrast"]]


def inspect(
    model: str | LoadedModel,
    *,
    texts: Sequence[str] = (),
    corpus: str | Path | Corpus | None = None,
    sentences: Sequence[int] = (),
    probes: Sequence[str] = (),
    heads: Sequence[tuple[int, int]] = (),
    roles: Sequence[str] = (),
    report: str | Path | None = None,
    exemplars: tuple[int, int] | str | None = None,
    why: Sequence[str | int] | str | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    page: bool = True,
    config: RunConfig | None = None,
    role_thresholds: RoleThresholds | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Inspection:
    """Chosen heads' attention on chosen texts, written to `out` (attention.parquet, tokens.parquet,
    inspect.json, inspect.html) or, without `out`, returned in memory.

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model.
        texts: any texts.
        corpus: a corpus whose `sentences` (ids) are inspected (the shipped corpus when None).
        sentences: sentence ids of `corpus`.
        probes: names of PROBES: the probe sequence, scored on those patterns.
        heads: (layer, head) pairs.
        roles: names of labels.ROLES, read from `report`; for the probe roles without a report, from the probe battery
            run first (`probe_seeds`, `probe_length`, `role_thresholds`).
        report: a report of this model, for `roles` and each head's role.
        exemplars: a head, (layer, head) or "L.H": inspect it on the sentences of its exemplars in `report`, read
            from the report's corpus (or `corpus`, which must be the same file); no texts, sentences, heads or roles.
        why: rows whose attention to a key is split into the senders of the head's query and key (docs/why.md):
            "ROW" (its strongest key off the first token), "ROW:KEY", "all" (every row) or "exemplars" (with
            `exemplars`: each exemplar row); written to qk.parquet, read back by `Inspection.why`.
        out: the folder to write; None keeps the result in memory.
        overwrite: replace `out` if this command wrote it before.
        page: write inspect.html.
        config: the settings as a RunConfig (layers, max_length, max_memory, device, dtype, threads, probe_length...).
        role_thresholds: the role rule for the probe roles.
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        An Inspection: `attention` (every visible pair's weight), `tokens`, `summary`, and the page.
    """
    role_thresholds = role_thresholds or RoleThresholds()
    texts, probes, roles = as_texts(texts, "--text"), as_texts(probes, "--probe"), as_texts(roles, "--role")
    sentences, heads = as_ids(sentences, "--sentences"), as_heads(heads)
    report = as_path(report, "report")
    exemplars = one_head(exemplars) if exemplars is not None else None
    why = why_rows.as_why(why)
    check_request(texts, sentences, probes, heads, roles, report, exemplars)
    why_rows.check_why(why, heads=heads, roles=roles, exemplars=exemplars)
    one_process_only("inspect")
    wanted = None
    if exemplars is not None:
        given = as_corpus(corpus, run_settings(config, **options)) if corpus is not None else None
        wanted = exemplar_texts(report, exemplars, given, limit=MAX_INSPECT_TEXTS - bool(probes))
        corpus, sentences, heads = wanted.corpus, wanted.sentence_ids, (exemplars,)
    run = CommandRun.prepare(model, corpus, config=config, options=options, reporter=reporter, report=report,
                             reads_corpus=bool(sentences))  # fmt: skip
    settings, reporter, corpus = run.settings, run.reporter, run.corpus
    if corpus is not None:
        _check_sentences(sentences, corpus)
    labelled = _report_roles(report) if report is not None else None
    refuse = _refusals(settings, why, heads, texts, corpus, sentences, probes)
    session = run.session(model, loader, what="inspect", out=out, kind="inspection", overwrite=overwrite,
                          scratch="inspect", report=report, before_weights=refuse)  # fmt: skip
    with session as opened:  # in memory (no --out): written to a scratch folder, read back, then gone
        loaded, plan, folder = opened.loaded, opened.plan, opened.folder
        sequence = check_probes(loaded.tokenizer, plan).sequence if probes else None
        chosen_texts = _texts(loaded.tokenizer, plan.max_length, sequence, texts, corpus, sentences, probes)
        if wanted is not None:
            chosen_texts = _marked(chosen_texts, wanted, loaded.tokenizer)
        why_rows.check_rows(why, [len(text.ids) for text in chosen_texts])
        with attached(loaded.lm or loaded.model, block_bytes=settings.block_bytes) as capture:
            chosen, known, roles_from, every_role = _heads(
                heads, roles, labelled, report, plan, capture, loaded, role_thresholds, reporter
            )
            longest = max(len(text.ids) for text in chosen_texts)
            check_memory(chosen, longest, plan.memory_budget)
            if why:
                hidden = loaded.model.config.get_text_config().hidden_size
                why_rows.check_memory(chosen, longest, plan.memory_budget, plan.architecture, hidden,
                                      loaded.dtype.itemsize)  # fmt: skip
            reporter.stage(f"inspecting {len(chosen)} heads on {len(chosen_texts)} texts")
            summary, views, explained, totals = _write_attention(folder, capture, chosen, chosen_texts, plan, loaded,
                                                                 why)  # fmt: skip
        tokens = _tokens_frame(loaded.tokenizer, chosen_texts)
        write_table(tokens, folder / TOKENS_FILE, TOKENS_SCHEMA)
        record = _record(loaded, plan, corpus, chosen_texts, chosen, known, roles_from, probes, summary)
        if why:
            record["why"] = {"asked": [w.name for w in why], "heads": totals.heads(every_role), "rows": explained}
            why_rows.warn_missed(explained, reporter)
        write_json(record, folder / INSPECT_RECORD)
        shown = None
        if page:
            from headscope.report.inspect_page import inspect_page
            from headscope.report.page import write_view

            def build() -> str:  # kept for the notebook, even where the file cannot be written
                nonlocal shown
                shown = inspect_page(record, tokens, views)
                return shown

            missed = write_view(build, folder / INSPECT_PAGE)
            if missed is not None:
                reporter.warn(f"could not write {missed}; the tables and inspect.json are written")
        attention = pd.read_parquet(folder / ATTENTION_FILE) if opened.stage is None else None
        qk = pd.read_parquet(folder / QK_FILE) if opened.stage is None and why else None
    folder = opened.target
    run.done(opened)
    return Inspection(record, tokens, summary, loaded.source.name, chosen_texts, known, roles_from,
                      tuple(dict.fromkeys(probes)), folder=folder, _attention=attention, page=shown,
                      _qk=qk)  # fmt: skip


def check_request(texts, sentences, probes, heads, roles, report, exemplars=None) -> None:
    """Refuse what asks for nothing or contradicts itself, before anything loads (the CLI calls it to make these
    usage errors)."""
    if exemplars is not None:
        if report is None:
            raise ConfigError("--exemplars reads a report's exemplars: headscope inspect --exemplars L.H REPORT")
        given = [option for option, value in (("--text", texts), ("--sentences", sentences), ("--heads", heads),
                                              ("--role", roles)) if value]  # fmt: skip
        if given:
            raise ConfigError(f"--exemplars chooses the head and its sentences: drop {given[0]}")
        return
    if not (texts or sentences or probes):
        raise ConfigError("nothing to inspect: pass --text, --sentences (of --corpus) or --probe")
    if len(texts) + len(sentences) + bool(probes) > MAX_INSPECT_TEXTS:
        raise ConfigError(f"inspect takes at most {MAX_INSPECT_TEXTS:,} texts at once")
    for number, text in enumerate(texts):
        if not text.strip():
            raise ConfigError(f"--text number {number + 1} is empty")
    unknown = [name for name in probes if name not in PROBES]
    if unknown:
        raise ConfigError(f"--probe takes {', '.join(PROBES)}; got {unknown[0]!r}")
    if heads and roles:
        raise ConfigError("--heads and --role choose heads two ways: pass one of them")
    unknown = [role for role in roles if role not in ROLES]
    if unknown:
        raise ConfigError(f"--role takes {', '.join(ROLES)}; got {unknown[0]!r}")
    needs_report = [role for role in roles if role not in PROBE_ROLES]
    if needs_report and report is None:
        raise ConfigError(
            f"role {needs_report[0]} is measured on a corpus: pass --report DIR (a report of this model); "
            f"without one, --role takes {', '.join(PROBE_ROLES)} (from the probes, run first)"
        )


def one_head(value) -> tuple[int, int]:
    """--exemplars's head: (layer, head) or "L.H", exactly one."""
    heads = as_heads([value] if isinstance(value, tuple) else value, "--exemplars")
    if len(heads) != 1:
        raise ConfigError(f"--exemplars takes one head, like 18.6; got {len(heads)}")
    return heads[0]


def _marked(texts: list[Text], wanted: ExemplarTexts, tokenizer) -> list[Text]:
    """The exemplar sentences labelled with their kinds and ranks, each carrying its exemplar rows; every row
    checked to hold the token the report recorded."""
    by_sentence = {text.sentence_id: text for text in texts if text.source == "corpus"}
    tokens = {sentence: token_texts(tokenizer, text.ids) for sentence, text in by_sentence.items()}
    check_rows(wanted, tokens, wanted.corpus)
    return [dataclasses.replace(text, label=wanted.label(text.sentence_id),
                                exemplars=tuple(wanted.rows[text.sentence_id]))
            if text.source == "corpus" else text for text in texts]  # fmt: skip


def _check_sentences(sentences: Sequence[int], corpus: Corpus) -> None:
    count = len(corpus.sentences)
    beyond = [i for i in sentences if not 0 <= i < count]
    if beyond:
        raise ConfigError(f"--sentences names sentence {beyond[0]}, but {corpus.path} has {count} (ids 0-{count - 1})")


def _report_roles(report) -> pd.DataFrame:
    labelled = Report.open(report).heads
    return labelled[["layer", "head", "role"]]


def _refusals(settings: RunConfig, why, heads, texts, corpus, sentences, probes):
    """What inspect refuses with the tokenizer and the model's config alone, before the weights load: a head the
    model lacks and, with --why, a row past its text or a key its head's layer does not see (a sliding window or
    a chunk). The same checks run again on the loaded model's plan (its attention decides at last)."""

    def refuse(tokenizer, model_config) -> None:
        check_heads(heads, architecture_of(model_config))
        if not why:
            return
        spec = ProbeSpec(seeds=settings.probe_seeds, length=settings.probe_length)
        sequence = probe_sequences(tokenizer, spec)[0] if probes else None
        chosen = _texts(tokenizer, max_length_for(settings, model_config), sequence, texts, corpus, sentences,
                        probes)  # fmt: skip
        why_rows.check_rows(why, [len(text.ids) for text in chosen])
        why_rows.check_windows(why, heads, layer_attention(model_config))

    return refuse


def _texts(tokenizer, max_length: int | None, probe_sequence, texts, corpus, sentences, probes) -> list[Text]:
    """Every text to inspect, tokenized as analyze tokenizes (special tokens, cut to max_length);
    probe_sequence(seed): the probe battery's token ids (with --probe)."""
    chosen = []
    limit = char_limit(tokenizer, max_length)
    for number, text in enumerate(texts):
        [ids], [cut] = tokenize_sentences(tokenizer, [text], max_length, max_chars=limit)
        if not ids:
            raise ConfigError(f"--text number {number + 1} has no tokens")
        chosen.append(Text("text", f"text {number}", ids, truncated=cut))  # a text cut to `limit` is cut anyway
    if sentences:
        feed = CorpusFeed(corpus, tokenizer, max_length=max_length, chunk_sentences=1, keep=False)
        for sentence_id in sentences:
            ids, cut = feed.token_ids(sentence_id, None)
            if not ids:
                raise ConfigError(f"sentence {sentence_id} of {corpus.path} has no tokens")
            chosen.append(Text("corpus", f"sentence {sentence_id}", ids, sentence_id, truncated=cut))
    if probes:
        chosen.append(Text("probe", "probe seed 0", probe_sequence(0), 0))
    return chosen


def _heads(heads, roles, labelled, report, plan: Plan, capture, loaded, role_thresholds, reporter):
    """The chosen (layer, head) pairs, ascending; the roles known for them (name -> role); where those came from;
    every head's role ((layer, head) -> role; None where no report or probe gave roles)."""
    count = plan.heads
    plan.check_heads(heads)
    known, roles_from = {}, None
    if labelled is not None:
        known = {(int(r.layer), int(r.head)): str(r.role) for r in labelled.itertuples()}
        roles_from = f"report {report}"
    elif roles:
        known = _probe_roles(capture, loaded, plan, role_thresholds, reporter)
        roles_from = f"probes ({plan.settings.probe_seeds} seeds, role_probe_min {role_thresholds.probe_min})"
    layers = set(plan.layers)
    if heads:
        chosen = [pair for pair in heads if pair[0] in layers]
    elif roles:
        chosen = [pair for pair, role in known.items() if role in roles and pair[0] in layers]
        if not chosen:
            raise ConfigError(f"no head has role {' or '.join(roles)} ({roles_from}{_within(plan)})")
    else:
        chosen = [(layer, head) for layer in plan.layers for head in range(count)]
    if not chosen:
        raise ConfigError(f"none of the --heads lies in --layers {','.join(map(str, plan.layers))}")
    return (
        sorted(set(chosen)),
        {head_name(*pair): known[pair] for pair in sorted(set(chosen)) if pair in known},
        roles_from,
        known if roles_from is not None else None,
    )


def _within(plan: Plan) -> str:
    return "" if plan.settings.layers is None else f", within --layers {','.join(map(str, plan.layers))}"


def _probe_roles(capture, loaded, plan: Plan, thresholds: RoleThresholds, reporter) -> dict[tuple[int, int], str]:
    """Probe roles from the battery, in the role rule's order (labels.ROLE_RULES): induction, then duplicate-token,
    then previous-token; heads none of them names are left out (their role needs a corpus)."""
    result = run_probes(capture, check_probes(loaded.tokenizer, plan), loaded.device, plan, reporter)
    known = {}
    for index, layer in enumerate(plan.layers):
        for head in range(plan.heads):
            for role, pattern in PROBE_ROLES.items():
                if result.scores[pattern][index, head] >= thresholds.probe_min:
                    known[(layer, head)] = role
                    break
    return known


def _write_attention(folder: Path, capture, chosen, texts: list[Text], plan: Plan, loaded, why=()):
    """Run each text alone, keep the chosen heads' attention, stream it to attention.parquet (and with `why`, the
    asked rows' split logits to qk.parquet, from the same pass); return each (text, head)'s summary, the views the
    page may carry, the explained rows' summaries and each explained head's totals."""
    from headscope.report.inspect_page import PageViews

    keeper = HeadAttention(by_layer(chosen))
    views = PageViews()
    rows, explained, totals = [], [], why_rows.ContrastTotals()
    splitter = SenderPass(capture, loaded, plan) if why else None
    with contextlib.ExitStack() as stack:  # in the work folder: published whole, or not at all
        writer = stack.enter_context(pq.ParquetWriter(folder / ATTENTION_FILE, ATTENTION_SCHEMA))
        qk_writer = None
        if why:
            qk_writer = stack.enter_context(why_rows.qk_writer(folder / QK_FILE))
        for text_id, text in enumerate(texts):
            batch = plan.collate([text_id], [text.ids], loaded.device)
            if splitter is None:
                capture.run(batch, measures=[keeper])
            else:
                passed, rotation = splitter.run(batch, [keeper])
            kept, visible = keeper.finish()
            scores = probe_scores(kept, len(text.ids), plan.settings.probe_length) if text.source == "probe" else {}
            for (layer, head), matrix in kept.items():
                write_pairs(writer, text_id, layer, head, matrix, visible[layer])
                places, weight, counted = largest_weight(matrix, visible[layer])
                rows.append(
                    {"text_id": text_id, "layer": layer, "head": head, "largest_at": places, "mean_largest": weight,
                     "rows": counted, **scores.get((layer, head), {})}
                )  # fmt: skip
                views.add(text_id, (layer, head), matrix, visible[layer])
                if splitter is not None:
                    senders = splitter.senders(passed, rotation, layer, head)
                    asked = why_rows.rows_of(why, len(text.ids), text.exemplars)
                    for block in why_rows.explain(senders, matrix, visible[layer], asked):
                        qk_writer.write_table(pa.concat_tables(why_rows.table(text_id, senders, t) for t in block))
                        for terms in block:
                            explained.append(why_rows.summary(text_id, senders, terms))
                            totals.add(senders, terms)
                            views.add_why(text_id, (layer, head), senders.names, terms.row, terms.key,
                                          terms.contrast)  # fmt: skip
                    del senders
            del kept, visible
    summary = pd.DataFrame(rows)
    for pattern in PROBES:
        summary[f"probe_{pattern}"] = summary.get(f"probe_{pattern}", np.nan)
    return summary, views, explained, totals


def _tokens_frame(tokenizer, texts: list[Text]) -> pd.DataFrame:
    frames = [
        pd.DataFrame(
            {
                "text_id": text_id,
                "position": np.arange(len(text.ids)),
                "token_id": text.ids,
                "token": token_texts(tokenizer, text.ids),
            }
        )
        for text_id, text in enumerate(texts)
    ]
    return pd.concat(frames, ignore_index=True)


def _record(loaded, plan: Plan, corpus, texts: list[Text], chosen, known, roles_from, probes, summary) -> dict:
    """inspect.json: what was inspected, how, and each head's summary per text (heads written L.H)."""
    settings = plan.settings
    return {
        **record_header(loaded, settings, INSPECT_SETTINGS, corpus),
        "texts": [
            {
                "text_id": i,
                "source": t.source,
                "label": t.label,
                "sentence_id": t.sentence_id,
                "tokens": len(t.ids),
                "truncated": t.truncated,
                **({"exemplars": list(t.exemplars)} if t.exemplars else {}),
            }
            for i, t in enumerate(texts)
        ],
        "heads": [head_name(*pair) for pair in chosen],
        "roles": known,
        "roles_from": roles_from,
        "probes": list(dict.fromkeys(probes)),
        "probe_length": settings.probe_length if probes else None,
        "summary": [_summary_entry(row, probes) for row in summary.itertuples()],
    }


def _summary_entry(row, probes) -> dict:
    entry = {
        "text_id": int(row.text_id),
        "head": head_name(row.layer, row.head),
        "largest_at": [[name, _rounded(share)] for name, share in row.largest_at],
        "mean_largest": _rounded(row.mean_largest),
        "rows": int(row.rows),
    }
    for pattern in dict.fromkeys(probes):
        value = getattr(row, f"probe_{pattern}")
        if value == value:
            entry[f"probe_{pattern}"] = _rounded(value)
    return entry


def _rounded(value: float) -> float | None:
    return None if value != value else round(float(value), 6)
