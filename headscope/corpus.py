"""Read and validate sentence corpora.

Formats, chosen by file extension:
    .txt (or anything else)  UTF-8, one sentence per line
    .jsonl                   one JSON object per line, sentence in ``text_column``
    .csv                     header row, sentence in ``text_column``
    .parquet                 sentence in ``text_column``
Surrounding whitespace (including \\r) is stripped and blank sentences are skipped.
``line`` is the 1-based line of the sentence in the file (for .parquet: 1-based row).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

from headscope.errors import CorpusError

SHIPPED_CORPUS = Path(__file__).resolve().parent.parent / "corpora" / "english-100.txt"
_LINE_BREAK = re.compile(rb"\r\n|\n|\r")


@dataclass(frozen=True)
class Sentence:
    sentence_id: int  # 0-based, in file order, counting only kept sentences
    line: int  # 1-based line (row) in the source file
    text: str


ENCODING_ERRORS = ("strict", "replace", "skip")


@dataclass(frozen=True)
class Corpus:
    path: Path
    sha256: str
    sentences: list[Sentence]
    blank_skipped: int  # blank lines / empty texts left out
    invalid_lines: int = 0  # lines with invalid UTF-8, replaced or skipped as --encoding-errors said


def default_corpus_path() -> Path:
    """The corpus shipped with headscope (100 varied English sentences)."""
    for candidate in (SHIPPED_CORPUS, Path(__file__).resolve().parent / "corpora" / "english-100.txt"):
        if candidate.is_file():
            return candidate
    raise CorpusError(f"the shipped corpus is missing ({SHIPPED_CORPUS}); pass --corpus FILE")


def read_corpus(path: str | Path, *, text_column: str = "text", encoding_errors: str = "strict") -> Corpus:
    """Read a corpus file into sentences; raise CorpusError naming the file and line on bad input.

    encoding_errors: strict (invalid UTF-8 is an error), replace (with U+FFFD) or skip (drop the line).
    """
    if encoding_errors not in ENCODING_ERRORS:
        raise CorpusError(f"--encoding-errors must be one of {', '.join(ENCODING_ERRORS)}; got {encoding_errors!r}")
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"corpus file not found: {path}")
    if not path.is_file():
        raise CorpusError(f"corpus path is not a file: {path}")
    data = path.read_bytes()
    suffix = path.suffix.lower()
    invalid: list[int] = []  # line numbers with invalid UTF-8 (not strict mode)
    if suffix == ".parquet":
        records = _parquet_records(path, text_column)
    else:
        text_lines = list(_decoded_lines(path, data, encoding_errors, invalid))
        if suffix == ".jsonl":
            records = _jsonl_records(path, text_lines, text_column)
        elif suffix == ".csv":
            records = _csv_records(path, text_lines, text_column)
        else:
            records = text_lines

    sentences, blank = _keep_sentences(records)
    if not sentences:
        raise CorpusError(f"corpus has no sentences (only blank lines or empty file): {path}")
    return Corpus(
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        sentences=sentences,
        blank_skipped=blank,
        invalid_lines=len(invalid),
    )


def _keep_sentences(records) -> tuple[list[Sentence], int]:
    """Strip every (line, text) record; number the non-blank ones, count the blank ones."""
    sentences: list[Sentence] = []
    blank = 0
    for line, text in records:
        text = text.strip()
        if text:
            sentences.append(Sentence(sentence_id=len(sentences), line=line, text=text))
        else:
            blank += 1
    return sentences, blank


def _decoded_lines(path: Path, data: bytes, encoding_errors: str, invalid: list[int]):
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


def _jsonl_records(path: Path, lines, text_column: str):
    for number, line in lines:
        if not line.strip():
            yield number, ""
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or text_column not in record:
            raise CorpusError(f"{path}:{number}: no {text_column!r} field (set --text-column)")
        value = record[text_column]
        if not isinstance(value, str):
            raise CorpusError(f"{path}:{number}: {text_column!r} is {type(value).__name__}, not a string")
        yield number, value


def _csv_records(path: Path, lines, text_column: str):
    lines = list(lines)
    if not lines:
        return
    first_line = lines[0][0]
    reader = csv.DictReader(io.StringIO("\n".join(text for _, text in lines)))
    if reader.fieldnames is None or text_column not in reader.fieldnames:
        columns = ", ".join(reader.fieldnames or [])
        raise CorpusError(f"{path}: no column {text_column!r} (columns: {columns}); set --text-column")
    for row in reader:
        # line_num counts physical lines read so far, so quoted multi-line fields keep the right number.
        yield first_line + reader.line_num - 1, row[text_column] or ""


def _parquet_records(path: Path, text_column: str):
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises several unrelated types for unreadable files
        raise CorpusError(f"{path}: not a readable Parquet file ({err})") from None
    if text_column not in schema.names:
        raise CorpusError(f"{path}: no column {text_column!r} (columns: {', '.join(schema.names)}); set --text-column")
    column = pq.read_table(path, columns=[text_column]).column(0).to_pylist()
    for row, value in enumerate(column, start=1):
        if value is not None and not isinstance(value, str):
            raise CorpusError(f"{path}: row {row}: {text_column!r} is {type(value).__name__}, not a string")
        yield row, value or ""


def corpus_from_texts(texts: list[str], *, name: str = "<texts>") -> Corpus:
    """A corpus from sentences already in memory (notebooks, tests); `line` is the 1-based list index."""
    sentences, blank = _keep_sentences(enumerate(texts, start=1))
    if not sentences:
        raise CorpusError("the list of texts holds no non-blank sentence")
    digest = hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()
    return Corpus(path=Path(name), sha256=digest, sentences=sentences, blank_skipped=blank)
