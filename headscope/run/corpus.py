"""Read and validate sentence corpora.

Formats, chosen by file extension:
    .txt (or anything else)  UTF-8, one sentence per line
    .jsonl                   one JSON object per line, sentence in ``text_column``
    .csv / .tsv              header row, sentence in ``text_column`` (RFC 4180 quoting, checked strictly)
    .parquet                 sentence in ``text_column``
Surrounding whitespace (including \\r) is stripped and blank sentences are skipped.
``line`` is the 1-based line of the sentence in the file (for .parquet: 1-based row).
Every read of the file is guarded: bad input is a CorpusError naming the file, and the line where there is one.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from headscope.config import ENCODING_ERRORS
from headscope.errors import ConfigError, CorpusError

PACKAGE = Path(__file__).resolve().parents[1]  # headscope/
SHIPPED_CORPUS = PACKAGE.parent / "corpora" / "english-100.txt"  # a checkout (an editable install)
_LINE_BREAK = re.compile(rb"\r\n|\n|\r")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Sentence:
    sentence_id: int  # 0-based, in file order, counting only kept sentences
    line: int  # 1-based line (row) in the source file
    text: str


@dataclass(frozen=True)
class Corpus:
    path: Path
    sha256: str
    sentences: list[Sentence]
    blank_skipped: int  # blank lines / empty texts left out
    invalid_lines: int = 0  # lines with invalid UTF-8, replaced or skipped as --encoding-errors said


def default_corpus_path() -> Path:
    """The corpus shipped with headscope (100 varied English sentences)."""
    for candidate in (SHIPPED_CORPUS, PACKAGE / "corpora" / "english-100.txt"):  # ... or a wheel
        if candidate.is_file():
            return candidate
    raise CorpusError(f"the shipped corpus is missing ({SHIPPED_CORPUS}); pass --corpus FILE")


TABLE_FORMATS = (".jsonl", ".csv", ".tsv", ".parquet")  # formats with columns: --text-column applies
DEFAULT_TEXT_COLUMN = "text"


def read_corpus(path: str | Path, *, text_column: str | None = None, encoding_errors: str = "strict") -> Corpus:
    """Read a corpus file into sentences; raise CorpusError naming the file and line on bad input.

    text_column: the column holding the sentence in a table format (default ``text``); plain-text corpora
                 have no columns, so naming one for them is an error rather than silently ignored.
    encoding_errors: strict (invalid UTF-8 is an error), replace (with U+FFFD) or skip (drop the line).
    """
    if encoding_errors not in ENCODING_ERRORS:
        raise CorpusError(f"--encoding-errors must be one of {', '.join(ENCODING_ERRORS)}; got {encoding_errors!r}")
    path = Path(path)
    suffix = path.suffix.lower()
    if text_column is not None and suffix not in TABLE_FORMATS:  # an option that cannot apply: a usage error
        raise ConfigError(
            f"--text-column applies to {', '.join(TABLE_FORMATS)} corpora; {path} is read as plain text, "
            "one sentence per line"
        )
    text_column = text_column or DEFAULT_TEXT_COLUMN
    if not path.exists():
        raise CorpusError(f"corpus file not found: {path}")
    if not path.is_file():
        raise CorpusError(f"corpus path is not a file: {path}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CorpusError(f"cannot read corpus {path}: {err.strerror or err}") from None
    invalid: list[int] = []  # line numbers with invalid UTF-8 (not strict mode)
    if suffix == ".parquet":
        records = _parquet_records(path, data, text_column)
    else:
        text_lines = decoded_lines(path, data, encoding_errors, invalid)
        if suffix in (".jsonl", ".csv", ".tsv"):
            rows = column_records(path, text_lines, (text_column,), hint="set --text-column")
            records = ((line, values[0]) for line, values in rows)
        else:
            records = text_lines

    # Only JSON escapes ("\\ud800") can make a lone surrogate: decoded UTF-8 and Arrow strings never hold one.
    sentences, blank = _keep_sentences(records, path, encoding_errors, invalid, surrogates=suffix == ".jsonl")
    if not sentences:
        raise CorpusError(f"corpus has no sentences (only blank lines or empty file): {path}")
    return Corpus(
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        sentences=sentences,
        blank_skipped=blank,
        invalid_lines=len(invalid),
    )


def _keep_sentences(
    records, path: Path, encoding_errors: str, invalid: list[int], *, surrogates: bool = True
) -> tuple[list[Sentence], int]:
    """Strip every (line, text) record; number the non-blank ones, count the blank ones. Text that is not
    Unicode text (a lone surrogate, which a JSON escape such as "\\ud800" can make) is handled like invalid UTF-8:
    an error naming the line, or replaced or skipped as `encoding_errors` says (counted in `invalid`)."""
    sentences: list[Sentence] = []
    blank = 0
    for line, text in records:
        text = text.strip()
        problem = surrogate_problem(path, line, text) if surrogates else None
        if problem:
            if encoding_errors == "strict":
                raise CorpusError(f"{problem}; --encoding-errors replace or skip goes on")
            invalid.append(line)
            if encoding_errors == "skip":
                continue
            text = _SURROGATE.sub("\ufffd", text)
        if text:
            sentences.append(Sentence(sentence_id=len(sentences), line=line, text=text))
        else:
            blank += 1
    return sentences, blank


def surrogate_problem(path: Path, line: int, text: str) -> str | None:
    """What is wrong with `text` if it holds a lone surrogate (which a JSON escape such as "\\ud800" can make):
    it is not Unicode text, and a tokenizer cannot take it. None when it is text."""
    surrogate = _SURROGATE.search(text)
    if surrogate is None:
        return None
    return (f"{path}:{line}: a lone surrogate ({surrogate.group()!r}) at column {surrogate.start() + 1} is not a "
            "character (half of an escaped pair?)")  # fmt: skip


def decoded_lines(path: Path, data: bytes, encoding_errors: str, invalid: list[int]):
    """Yield (line number, text) for every line; NUL bytes and (in strict mode) invalid UTF-8 are errors."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    if data.endswith((b"\n", b"\r")):
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    if not data:
        return
    for number, raw in enumerate(_LINE_BREAK.split(data), start=1):
        if b"\x00" in raw:
            raise CorpusError(f"{path}:{number}: NUL byte at column {raw.index(0) + 1}; is this a text file?")
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as err:
            if encoding_errors == "strict":
                raise CorpusError(
                    f"{path}:{number}: invalid UTF-8 at byte {err.start} of the line; "
                    "--encoding-errors replace or skip goes on"
                ) from None
            invalid.append(number)
            if encoding_errors == "replace":
                yield number, raw.decode("utf-8", errors="replace")


def column_records(path: Path, lines, columns: tuple[str, ...], *, hint: str):
    """(line, the columns' values) of every line of a .jsonl, .csv or .tsv file (decoded `lines`), each value a
    string ("" for null or missing); hint: what to do about a missing column, as its error says it."""
    if path.suffix.lower() == ".jsonl":
        return _jsonl_records(path, lines, columns, hint)
    return _delimited_records(path, lines, columns, hint, delimiter="," if path.suffix.lower() == ".csv" else "\t")


def _jsonl_records(path: Path, lines, columns: tuple[str, ...], hint: str):
    for number, line in lines:
        if not line.strip():
            yield number, ("",) * len(columns)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        except RecursionError:
            raise CorpusError(f"{path}:{number}: JSON nested too deeply to read") from None
        missing = [column for column in columns if not isinstance(record, dict) or column not in record]
        if missing:
            raise CorpusError(f"{path}:{number}: no {missing[0]!r} field ({hint})")
        for column in columns:
            value = record[column]
            if value is not None and not isinstance(value, str):
                raise CorpusError(f"{path}:{number}: {column!r} is {type(value).__name__}, not a string")
        # null counts as blank, as a missing value does in .csv and .parquet
        yield number, tuple(record[column] or "" for column in columns)


def _delimited_records(path: Path, lines, columns: tuple[str, ...], hint: str, *, delimiter: str):
    """Rows of a .csv / .tsv file with a header, parsed strictly: a row whose field count differs from the
    header's, or a quote left open, is an error naming the line (lenient parsing once merged 99 rows into
    one sentence)."""
    lines = list(lines)
    if not lines:
        return
    first_line = lines[0][0]
    reader = csv.reader(io.StringIO("\n".join(text for _, text in lines)), delimiter=delimiter, strict=True)

    def line_of(physical: int) -> int:  # reader.line_num counts physical lines read, from 1
        return first_line + physical - 1

    header: list[str] | None = None
    indices: list[int] = []
    while True:
        opened = reader.line_num + 1  # where the next row starts
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            raise CorpusError(_csv_problem(path, line_of(opened), line_of(reader.line_num), str(err))) from None
        if not row:  # a blank line
            continue
        if header is None:
            header = row
            missing = [column for column in columns if column not in header]
            if missing:
                raise _no_column(path, missing[0], header, hint)
            indices = [header.index(column) for column in columns]
            continue
        if len(row) != len(header):
            kind = "tab" if delimiter == "\t" else "comma"
            raise CorpusError(
                f"{path}:{line_of(opened)}: {len(row)} fields, but the header has {len(header)} "
                f"(an unquoted {kind} or a stray quote?)"
            )
        yield line_of(opened), tuple(row[index] for index in indices)


def _csv_problem(path: Path, opened: int, reached: int, reason: str) -> str:
    if "unexpected end of data" in reason:
        return f"{path}:{opened}: a quote opened on this line is never closed (it runs to line {reached})"
    if "field larger than field limit" in reason:
        return f"{path}:{opened}: a field longer than {csv.field_size_limit():,} characters (an unclosed quote?)"
    return f"{path}:{reached}: malformed CSV ({reason})"


def _parquet_records(path: Path, data: bytes, text_column: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        names = parquet.schema_arrow.names
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise CorpusError(f"{path}: not a readable Parquet file ({_first_line(err)})") from None
    if text_column not in names:
        raise _no_column(path, text_column, names, "set --text-column")
    try:  # the footer can be intact while data pages are corrupt: reading the column is guarded too
        column = parquet.read(columns=[text_column]).column(0).to_pylist()
    except Exception as err:
        raise CorpusError(f"{path}: column {text_column!r} cannot be read ({_first_line(err)})") from None
    for row, value in enumerate(column, start=1):
        if value is not None and not isinstance(value, str):
            raise CorpusError(f"{path}: row {row}: {text_column!r} is {type(value).__name__}, not a string")
        yield row, value or ""


def _no_column(path: Path, column: str, names: list[str], hint: str) -> CorpusError:
    return CorpusError(f"{path}: no column {column!r} (columns: {', '.join(names)}); {hint}")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def corpus_from_texts(texts: list[str], *, name: str = "<texts>") -> Corpus:
    """A corpus from sentences already in memory (notebooks, tests); `line` is the 1-based list index."""
    sentences, blank = _keep_sentences(enumerate(texts, start=1), Path(name), "strict", [])
    if not sentences:
        raise CorpusError("the list of texts holds no non-blank sentence")
    digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    return Corpus(path=Path(name), sha256=digest, sentences=sentences, blank_skipped=blank)


def as_corpus(corpus, settings) -> Corpus:
    """What every command takes as a corpus, as a Corpus: a Corpus, a list of sentences, a file path, or None (the
    shipped corpus); a file is read with the settings' (a RunConfig's) text column and encoding rule."""
    if isinstance(corpus, Corpus):
        return corpus
    if isinstance(corpus, list | tuple):
        wrong = [text for text in corpus if not isinstance(text, str)]
        if wrong:
            raise ConfigError(f"a corpus given as a list holds strings (sentences); got {wrong[0]!r} in it")
        return corpus_from_texts(list(corpus))
    if corpus is not None and not isinstance(corpus, str | os.PathLike):
        raise ConfigError(f"corpus takes a file path, a list of sentences or None (the shipped corpus); got {corpus!r}")
    path = corpus if corpus is not None else default_corpus_path()
    return read_corpus(path, text_column=settings.text_column, encoding_errors=settings.encoding_errors)
