"""What `inspect --exemplars L.H REPORT` opens: the corpus sentences holding a head's exemplars (exemplars.parquet),
read from the corpus the report measured, and checked to be the text the report saw.

The report's run.json names its corpus (path, sha256, text column, encoding rule); the sentences are read back
from there, and a corpus changed since is refused: its sentence ids would name other text. The token at each
exemplar's row is checked again once inspect tokenizes the sentences (`check_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from headscope.arguments import head_name
from headscope.errors import ConfigError
from headscope.layout import RUN_FILE
from headscope.report.report import Report
from headscope.run.corpus import Corpus, read_corpus


@dataclass(frozen=True)
class ExemplarTexts:
    """A head's exemplar sentences, strongest first (the sentence of its best rank, kinds in the report's order),
    and each sentence's exemplar rows (kind, rank, row, key, weight, score, query_token), best first."""

    head: tuple[int, int]
    corpus: Corpus
    sentence_ids: tuple[int, ...]
    rows: dict[int, list[dict]]

    def label(self, sentence_id: int) -> str:
        """'sentence 63: induction 1, 2; sharp 4' (the kinds and ranks of the sentence's rows)."""
        ranks: dict[str, list[str]] = {}
        for row in self.rows[sentence_id]:
            ranks.setdefault(row["kind"], []).append(str(row["rank"]))
        return f"sentence {sentence_id}: " + "; ".join(f"{kind} {', '.join(r)}" for kind, r in ranks.items())


def exemplar_texts(
    report: Path, head: tuple[int, int], corpus: Corpus | str | Path | None = None, *, limit: int | None = None
) -> ExemplarTexts:
    """Head `head`'s exemplar sentences of `report`, from `corpus` (default: the corpus run.json names); the
    `limit` strongest when there are more."""
    opened = Report.open(report)
    table = opened.exemplars
    if table is None:
        raise ConfigError(f"{report} holds no exemplars.parquet: analyze kept none (--exemplars 0)")
    mine = table[(table["layer"] == head[0]) & (table["head"] == head[1])]
    if mine.empty:
        layers = sorted(set(table["layer"]))
        raise ConfigError(f"head {head_name(*head)} has no exemplars in {report} (its layers: {_ranges(layers)})")
    recorded = opened.run.get("corpus") if isinstance(opened.run.get("corpus"), dict) else {}
    corpus = _corpus(corpus, recorded, opened.run.get("settings") or {}, report)
    kinds = list(dict.fromkeys(mine["kind"].astype(str)))
    ordered = mine.assign(kind=mine["kind"].astype(str), order=mine["kind"].astype(str).map(kinds.index))
    ordered = ordered.sort_values(["rank", "order"], kind="stable")
    rows: dict[int, list[dict]] = {}
    for entry in ordered.itertuples():
        rows.setdefault(int(entry.sentence), []).append(
            {"kind": entry.kind, "rank": int(entry.rank), "row": int(entry.row), "key": int(entry.key),
             "weight": _number(entry.weight), "score": _number(entry.score), "query_token": entry.query_token}
        )  # fmt: skip
    count = len(corpus.sentences)
    beyond = [sentence for sentence in rows if sentence >= count]
    if beyond:
        raise ConfigError(f"{report} names sentence {beyond[0]}, but {corpus.path} has {count}")
    kept = tuple(rows)[:limit]
    return ExemplarTexts(head, corpus, kept, {sentence: rows[sentence] for sentence in kept})


def report_as_model(model: str, report: Path | None) -> tuple[str, Path]:
    """The CLI's `inspect --exemplars L.H REPORT`: the positional names the report, and the model is the one the
    report measured (run.json's model as given to analyze). With --report the positional is the model, as in every
    other inspect."""
    if report is not None:
        return model, Path(report)
    folder = Path(model)
    if not (folder / RUN_FILE).is_file():
        raise ConfigError(f"--exemplars reads a report, and {model} is not one (no {RUN_FILE}): headscope inspect "
                          "--exemplars L.H REPORT, or MODEL --report REPORT")  # fmt: skip
    recorded = Report.open(folder).run.get("model")
    given = recorded.get("input") if isinstance(recorded, dict) else None
    if not isinstance(given, str) or not given:
        raise ConfigError(f"{folder / RUN_FILE} names no model: pass MODEL and --report {folder}")
    return given, folder


def check_rows(texts: ExemplarTexts, tokens: dict[int, list[str]], corpus: Corpus) -> None:
    """Each exemplar's row holds the token the report recorded there (tokens: sentence id -> its tokens as inspect
    made them); otherwise the model's tokenizer or --max-length differs from the report's run."""
    for sentence_id, rows in texts.rows.items():
        made = tokens[sentence_id]
        for row in rows:
            found = made[row["row"]] if row["row"] < len(made) else None
            if found != row["query_token"]:
                raise ConfigError(
                    f"sentence {sentence_id} of {corpus.path} does not tokenize as in the report: row {row['row']} "
                    f"is {found!r} here and {row['query_token']!r} there (another tokenizer or --max-length?)"
                )


def _corpus(corpus, recorded: dict, settings: dict, report: Path) -> Corpus:
    if isinstance(corpus, Corpus):
        read = corpus
    else:
        path = corpus if corpus is not None else recorded.get("path")
        if path is None:
            raise ConfigError(f"{report}'s run.json names no corpus: pass --corpus (the one analyze read)")
        if not Path(path).is_file():
            raise ConfigError(f"the corpus {report} was measured on, {path}, is not there: pass --corpus")
        read = read_corpus(path, text_column=settings.get("text_column"),
                           encoding_errors=settings.get("encoding_errors") or "strict")  # fmt: skip
    if recorded.get("sha256") not in (None, read.sha256):
        raise ConfigError(f"{read.path} is not the corpus {report} measured (its sha256 differs): its sentence ids "
                          "name other text")  # fmt: skip
    return read


def _number(value) -> float | None:
    return None if pd.isna(value) else float(value)


def _ranges(values: list[int]) -> str:
    whole = values == list(range(values[0], values[-1] + 1))
    return f"{values[0]}-{values[-1]}" if whole else ",".join(map(str, values))
