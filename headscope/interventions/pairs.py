"""Prompt pairs for activation patching: read from a file (or records in memory), checked, tokenized.

A pairs file is JSONL (one object per line) or CSV / TSV with a header, with four text columns:
    clean       the prompt on which the model shows the behaviour
    corrupt     the same prompt with the information changed (same number of tokens: positions patch one for one)
    answer      the token the clean prompt should be completed with (one token, encoded without special tokens)
    distractor  the token the corrupt prompt points to instead (one token)
Every text is kept as written: a prompt ending in a space is tokenized with that space (most tokenizers give it a
token of its own), and an answer of one space is the space's token. Blank lines (every column empty) are skipped;
`line` is the 1-based line in the file. Every problem is a one-line error naming the file and line.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from headscope.errors import ConfigError, CorpusError
from headscope.run.corpus import column_records, decoded_lines, surrogate_problem

PAIR_COLUMNS = ("clean", "corrupt", "answer", "distractor")
PAIR_FORMATS = (".jsonl", ".csv", ".tsv")


@dataclass(frozen=True)
class PromptPair:
    pair_id: int  # 0-based, in file order, counting only kept pairs
    line: int  # 1-based line in the file (index + 1 for pairs given in memory)
    clean: str
    corrupt: str
    answer: str
    distractor: str


@dataclass(frozen=True)
class PairsFile:
    path: Path
    sha256: str
    pairs: list[PromptPair]


@dataclass(frozen=True)
class TokenizedPair:
    pair: PromptPair
    clean_ids: list[int]
    corrupt_ids: list[int]
    answer_id: int
    distractor_id: int

    @property
    def length(self) -> int:
        return len(self.clean_ids)


def read_pairs(path: str | os.PathLike) -> PairsFile:
    """The pairs of a .jsonl, .csv or .tsv file; CorpusError naming the file and line on bad input."""
    path = Path(path)
    if path.suffix.lower() not in PAIR_FORMATS:
        raise ConfigError(f"--pairs takes a {', '.join(PAIR_FORMATS)} file with columns {', '.join(PAIR_COLUMNS)}; "
                          f"got {path}")  # fmt: skip
    if not path.is_file():
        raise CorpusError(f"pairs file not found: {path}" if not path.exists() else f"--pairs is not a file: {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CorpusError(f"cannot read pairs file {path}: {err.strerror or err}") from None
    lines = decoded_lines(path, data, "strict", [])
    rows = column_records(path, lines, PAIR_COLUMNS, hint=f"a pair has the columns {', '.join(PAIR_COLUMNS)}")
    return PairsFile(path, hashlib.sha256(data).hexdigest(), _kept(path, rows))


def pairs_from_records(records: Sequence[dict], *, name: str = "<pairs>") -> PairsFile:
    """Pairs given in memory (a list of dicts with the four columns); `line` is the 1-based list index."""
    if isinstance(records, str | bytes) or not isinstance(records, Sequence):
        raise ConfigError(f"pairs takes a file path or a list of dicts with {', '.join(PAIR_COLUMNS)}; got {records!r}")
    rows = []
    for line, record in enumerate(records, start=1):
        missing = [c for c in PAIR_COLUMNS if not isinstance(record, dict) or not isinstance(record.get(c), str)]
        if missing:
            raise ConfigError(f"pair {line}: no {missing[0]!r} string (a pair has {', '.join(PAIR_COLUMNS)})")
        rows.append((line, tuple(record[c] for c in PAIR_COLUMNS)))
    text = "\n".join("\t".join(values) for _, values in rows)
    return PairsFile(Path(name), hashlib.sha256(text.encode("utf-8")).hexdigest(), _kept(Path(name), rows))


def as_pairs(pairs) -> PairsFile:
    """What `patch` takes as pairs: a PairsFile, a file path, or a list of dicts."""
    if isinstance(pairs, PairsFile):
        return pairs
    if isinstance(pairs, str | os.PathLike):
        return read_pairs(pairs)
    if pairs is None:
        raise ConfigError("patch needs prompt pairs: pass --pairs FILE (.jsonl, .csv or .tsv)")
    return pairs_from_records(pairs)


def _kept(path: Path, rows) -> list[PromptPair]:
    pairs = []
    for line, values in rows:
        values = tuple(values)  # as written: a trailing space is a token the model reads
        if not any(values):
            continue  # a blank line
        empty = [name for name, value in zip(PAIR_COLUMNS, values, strict=True) if not value]
        if empty:
            raise CorpusError(f"{path}:{line}: {empty[0]!r} is empty")
        problems = [problem for value in values if (problem := surrogate_problem(path, line, value))]
        if problems:
            raise CorpusError(problems[0])
        pairs.append(PromptPair(len(pairs), line, *values))
    if not pairs:
        raise CorpusError(f"pairs file has no pairs (only blank lines or empty file): {path}")
    return pairs


def tokenize_pairs(pairs: PairsFile, tokenizer, max_length: int | None) -> list[TokenizedPair]:
    """Each pair's token ids (prompts with the tokenizer's special tokens, as a corpus is tokenized; answer and
    distractor without), refusing a pair whose prompts differ in length, whose answer or distractor is not one
    token (or is the same token), or that is longer than `max_length` (a prompt is never cut: the metric reads its
    last position)."""
    path = pairs.path
    clean = tokenizer([p.clean for p in pairs.pairs], add_special_tokens=True)["input_ids"]
    corrupt = tokenizer([p.corrupt for p in pairs.pairs], add_special_tokens=True)["input_ids"]
    answers = tokenizer([p.answer for p in pairs.pairs], add_special_tokens=False)["input_ids"]
    distractors = tokenizer([p.distractor for p in pairs.pairs], add_special_tokens=False)["input_ids"]
    found = []
    for pair, clean_ids, corrupt_ids, answer, distractor in zip(pairs.pairs, clean, corrupt, answers, distractors,
                                                                strict=True):  # fmt: skip
        where = f"{path}:{pair.line}"
        if len(clean_ids) != len(corrupt_ids):
            raise CorpusError(f"{where}: clean has {len(clean_ids)} tokens and corrupt {len(corrupt_ids)}; patching "
                              "puts positions one for one, so both prompts need the same number")  # fmt: skip
        for name, ids in (("answer", answer), ("distractor", distractor)):
            if len(ids) != 1:
                shown = [tokenizer.decode([i]) for i in ids]
                raise CorpusError(f"{where}: {name} {getattr(pair, name)!r} is {len(ids)} tokens {shown}, not one "
                                  "(a leading space is part of a token: ' Mary')")  # fmt: skip
        if answer[0] == distractor[0]:
            raise CorpusError(f"{where}: answer and distractor are the same token ({pair.answer!r})")
        if max_length is not None and len(clean_ids) > max_length:
            raise CorpusError(f"{where}: the prompts have {len(clean_ids)} tokens, more than --max-length "
                              f"{max_length} (a prompt is never cut)")  # fmt: skip
        found.append(TokenizedPair(pair, list(clean_ids), list(corrupt_ids), answer[0], distractor[0]))
    return found
