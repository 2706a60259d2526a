"""Prompt pairs for activation patching: read from a file (or records in memory), checked, tokenized.

A pairs file is JSONL (one object per line) or CSV / TSV with a header, with four text columns:
    clean       the prompt on which the model shows the behaviour
    corrupt     the same prompt with the information changed (same number of tokens: positions patch one for one)
    answer      the token the clean prompt should be completed with (one token, encoded without special tokens)
    distractor  the token the corrupt prompt points to instead (one token)
Every text is kept as written: a prompt ending in a space is tokenized with that space (most tokenizers give it a
token of its own), and an answer of one space is the space's token. Blank lines (every column empty) are skipped;
`line` is the 1-based line in the file. Every problem is a one-line error naming the file and line.

Positions by role: a prompt may mark spans of its text as roles, `[[IO:Mary]]` (a name of letters, digits and _,
then the text), as IOI work names positions (IO, S1, S2). The marks are removed before tokenizing; a role's position
is the token holding its span's last character. `END`, the last token (where the metric is read), is a role of every
pair. Marks go in the clean prompt, the corrupt one, or both (then they must agree): the two prompts share positions.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from headscope.errors import ConfigError, CorpusError
from headscope.run.corpus import column_records, decoded_lines, surrogate_problem

PAIR_COLUMNS = ("clean", "corrupt", "answer", "distractor")
PAIR_FORMATS = (".jsonl", ".csv", ".tsv")
ROLE_MARK = re.compile(r"\[\[([A-Za-z_][A-Za-z0-9_]*):(.*?)\]\]", re.DOTALL)
END_ROLE = "END"  # every pair's last token


@dataclass(frozen=True)
class PromptPair:
    pair_id: int  # 0-based, in file order, counting only kept pairs
    line: int  # 1-based line in the file (index + 1 for pairs given in memory)
    clean: str  # as tokenized: role marks removed
    corrupt: str
    answer: str
    distractor: str
    # (role, the clean prompt's character span start, end), (the corrupt one's): where the marks were
    clean_roles: tuple[tuple[str, int, int], ...] = ()
    corrupt_roles: tuple[tuple[str, int, int], ...] = ()


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
    positions: dict[str, int]  # role -> token position (END: the last), from the marks

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
        (clean, clean_roles), (corrupt, corrupt_roles) = (unmarked(text, f"{path}:{line}") for text in values[:2])
        pairs.append(PromptPair(len(pairs), line, clean, corrupt, *values[2:], clean_roles, corrupt_roles))
    if not pairs:
        raise CorpusError(f"pairs file has no pairs (only blank lines or empty file): {path}")
    return pairs


def unmarked(text: str, where: str) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """The text without its role marks, and each marked role's character span in it (one line naming `where` for a
    role marked twice, an empty span, or END, which is every pair's last token)."""
    kept, roles, at = [], [], 0
    for match in ROLE_MARK.finditer(text):
        kept.append(text[at : match.start()])
        role, span = match.group(1), match.group(2)
        start = sum(len(piece) for piece in kept)
        if role == END_ROLE:
            raise CorpusError(f"{where}: {END_ROLE} is every pair's last token; mark other roles")
        if not span:
            raise CorpusError(f"{where}: role {role!r} marks no text")
        if any(role == seen for seen, _, _ in roles):
            raise CorpusError(f"{where}: role {role!r} is marked twice")
        roles.append((role, start, start + len(span)))
        kept.append(span)
        at = match.end()
    kept.append(text[at:])
    return "".join(kept), tuple(roles)


def _role_positions(pair: PromptPair, clean_offsets, corrupt_offsets, length: int, where: str) -> dict[str, int]:
    """Each marked role's token (the one holding its span's last character), END the last token; the clean and the
    corrupt prompt's marks must agree where both have them."""
    found = {}
    for roles, offsets, prompt in ((pair.clean_roles, clean_offsets, "clean"),
                                   (pair.corrupt_roles, corrupt_offsets, "corrupt")):  # fmt: skip
        for role, _, end in roles:
            token = next((t for t, (first, last) in enumerate(offsets) if first < last and first <= end - 1 < last),
                         None)  # fmt: skip
            if token is None:
                raise CorpusError(f"{where}: role {role!r} ends where the {prompt} prompt has no token")
            if found.get(role, token) != token:
                raise CorpusError(f"{where}: role {role!r} is token {found[role]} in the clean prompt and {token} in "
                                  "the corrupt one; the two prompts share positions")  # fmt: skip
            found[role] = token
    found[END_ROLE] = length - 1
    return found


def tokenize_pairs(pairs: PairsFile, tokenizer, max_length: int | None) -> list[TokenizedPair]:
    """Each pair's token ids (prompts with the tokenizer's special tokens, as a corpus is tokenized; answer and
    distractor without), refusing a pair whose prompts differ in length, whose answer or distractor is not one
    token (or is the same token), or that is longer than `max_length` (a prompt is never cut: the metric reads its
    last position)."""
    path = pairs.path
    marked = any(p.clean_roles or p.corrupt_roles for p in pairs.pairs)
    if marked and not getattr(tokenizer, "is_fast", False):
        raise CorpusError(f"{path}: role marks need a fast tokenizer (character offsets); this one is "
                          f"{type(tokenizer).__name__}")  # fmt: skip
    offsets = {"return_offsets_mapping": True} if marked else {}
    clean_tokens = tokenizer([p.clean for p in pairs.pairs], add_special_tokens=True, **offsets)
    corrupt_tokens = tokenizer([p.corrupt for p in pairs.pairs], add_special_tokens=True, **offsets)
    clean, corrupt = clean_tokens["input_ids"], corrupt_tokens["input_ids"]
    no_offsets = [[]] * len(pairs.pairs)
    clean_offsets = clean_tokens.get("offset_mapping", no_offsets) if marked else no_offsets
    corrupt_offsets = corrupt_tokens.get("offset_mapping", no_offsets) if marked else no_offsets
    answers = tokenizer([p.answer for p in pairs.pairs], add_special_tokens=False)["input_ids"]
    distractors = tokenizer([p.distractor for p in pairs.pairs], add_special_tokens=False)["input_ids"]
    found = []
    for index, (pair, clean_ids, corrupt_ids, answer, distractor) in enumerate(
        zip(pairs.pairs, clean, corrupt, answers, distractors, strict=True)
    ):
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
        positions = _role_positions(pair, clean_offsets[index], corrupt_offsets[index], len(clean_ids), where)
        found.append(TokenizedPair(pair, list(clean_ids), list(corrupt_ids), answer[0], distractor[0], positions))
    return found


def common_roles(tokenized: list[TokenizedPair], pairs: PairsFile, option: str = "--positions roles") -> list[str]:
    """Results by role compare roles across pairs: every pair must mark the first pair's roles (END, the last token,
    is every pair's). Returns them in the first pair's order of position; `option` names what asked, in errors."""
    first = tokenized[0]
    roles = sorted(first.positions, key=first.positions.get)
    for pair in tokenized:
        missing = [role for role in roles if role not in pair.positions]
        extra = [role for role in pair.positions if role not in first.positions]
        if missing or extra:
            which = f"marks no {missing[0]!r}" if missing else f"marks {extra[0]!r}"
            raise CorpusError(f"{pairs.path}:{pair.pair.line}: {which}, but line {first.pair.line} marks "
                              f"{', '.join(roles)}; {option} needs every pair to mark the same roles "
                              "([[ROLE:text]] in the prompt)")  # fmt: skip
    return roles
