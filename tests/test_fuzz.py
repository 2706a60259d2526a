"""Fuzzing the CLI with hostile files: random corpora in every format and random report folders.

For every input, the command either succeeds with output consistent with the input, or fails with one
line `Error: ...`: never a traceback, never a hang, and never a file touched outside its output folder.
"""

from __future__ import annotations

import csv
import faulthandler
import hashlib
import io
import json
import math
import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from headscope.labels import HEAD_TYPES

from helpers import run_cli, snapshot

FORMATS = ("txt", "jsonl", "csv", "tsv", "parquet")
# What can go wrong with a file; "none" and "bom_crlf" leave it valid.
DAMAGES = ("none", "bom_crlf", "truncated", "invalid_utf8", "random_bytes", "huge_field", "stray_quote", "odd_json")
SECONDS_PER_RUN = 30  # a tiny model on a handful of sentences: anything near this is a hang
FUZZ = settings(
    max_examples=int(os.environ.get("HEADSCOPE_FUZZ_EXAMPLES", "60")),
    deadline=None,
    derandomize="HEADSCOPE_FUZZ_EXAMPLES" not in os.environ,  # CI: the same examples every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Sentences on one line each: any character but NUL, line breaks and lone surrogates.
SENTENCE = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00\r\n"), max_size=30)


def encode(fmt: str, sentences: list[str]) -> bytes:
    """A well-formed corpus file of `sentences` in `fmt`."""
    if fmt == "txt":
        return "".join(f"{s}\n" for s in sentences).encode()
    if fmt == "jsonl":
        return "".join(json.dumps({"id": i, "text": s}) + "\n" for i, s in enumerate(sentences)).encode()
    if fmt in ("csv", "tsv"):
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter="," if fmt == "csv" else "\t", lineterminator="\n")
        writer.writerow(["id", "text"])
        writer.writerows([i, s] for i, s in enumerate(sentences))
        return buffer.getvalue().encode()
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"id": list(range(len(sentences))), "text": pa.array(sentences, pa.string())}), sink)
    return sink.getvalue().to_pybytes()


def damaged(data: bytes, damage: str, draw) -> bytes:
    position = draw(st.integers(0, max(len(data) - 1, 0)))
    if damage == "bom_crlf":
        return b"\xef\xbb\xbf" + data.replace(b"\n", b"\r\n") if not data.startswith(b"PAR1") else data
    if damage == "truncated":
        return data[:position]
    if damage == "invalid_utf8":
        return data[:position] + b"\xff\xfe" + data[position:]
    if damage == "random_bytes":
        return draw(st.binary(max_size=300))
    if damage == "huge_field":
        return data + b"x" * 200_000 + b"\n"
    if damage == "stray_quote":
        return data[:position] + b'"' + data[position:]
    if damage == "odd_json":
        line = draw(
            st.sampled_from(
                [
                    b"[" * 5000,
                    b'{"text": {"nested": ["deep"]}}',
                    b"[1, 2]",
                    b'{"text": null}',
                    b'{"text": 12}',
                    b'"just a string"',
                ]
            )
        )
        return data + line + b"\n"
    return data


@st.composite
def corpora(draw):
    fmt = draw(st.sampled_from(FORMATS))
    sentences = draw(st.lists(SENTENCE, max_size=6))
    damage = draw(st.sampled_from(DAMAGES))
    return fmt, sentences, damage, damaged(encode(fmt, sentences), damage, draw)


def assert_clean_failure(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert message.startswith("Error: ") and "\n" not in message, message


@pytest.fixture(autouse=True)
def no_hangs():
    """A hang dumps every thread's stack and ends the run instead of stalling CI."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@FUZZ
@given(corpora())
def test_analyze_on_random_corpora(planted_gpt2, case):
    fmt, sentences, damage, data = case
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        corpus = folder / f"corpus.{fmt}"
        corpus.write_bytes(data)
        out = folder / "report"
        before = snapshot(folder)
        started = time.perf_counter()
        result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts")
        assert time.perf_counter() - started < SECONDS_PER_RUN
        event(f"{fmt} {damage}: exit {result.exit_code}")
        assert snapshot(folder, skip=(out,)) == before  # the corpus untouched, nothing written beside the report
        assert sorted(p.name for p in folder.iterdir()) == sorted([corpus.name] + (["report"] if out.exists() else []))
        expected = [s.strip() for s in sentences if s.strip()]
        if damage in ("none", "bom_crlf") and expected:
            assert result.exit_code == 0, result.output
        if result.exit_code != 0:
            assert_clean_failure(result)
            assert not out.exists()
            return
        check_report(out, data)
        if damage in ("none", "bom_crlf"):
            assert pd.read_parquet(out / "sentences.parquet")["text"].tolist() == expected


def check_report(out: Path, data: bytes) -> None:
    """A finished report agrees with itself and with the corpus it came from."""
    run = json.loads((out / "run.json").read_text())
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert run["corpus"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert run["corpus"]["sentences"] == len(sentences) > 0
    assert sentences["sentence_id"].tolist() == list(range(len(sentences)))
    assert run["corpus"]["tokens"] == int(sentences["n_tokens"].sum())
    assert (sentences["text"].str.strip() == sentences["text"]).all() and (sentences["text"] != "").all()
    heads = pd.read_parquet(out / "heads.parquet")
    assert len(heads) == 2 * 3 and heads["head_type"].isin(HEAD_TYPES).all()
    entropy = heads.loc[heads["n_rows"] > 0, "entropy"]
    assert entropy.between(0, math.log(64) + 1e-6).all()
    per_sentence = pd.read_parquet(out / "sentence_heads.parquet")
    assert len(per_sentence) == 2 * 3 * int((sentences["n_tokens"] > 0).sum())


# ---------------------------------------------------------------- report folders

REPORT_FILES = ("heads.parquet", "run.json", "examples.parquet")
FILE_STATES = ("valid", "missing", "empty", "truncated", "random", "wrong")


@pytest.fixture(scope="module")
def valid_report(planted_gpt2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("valid") / "report"
    assert run_cli("analyze", planted_gpt2, "--out", out, "--no-charts").exit_code == 0
    return out


def wrong_version(name: str, valid: Path, draw) -> bytes:
    """A readable file of the right kind holding the wrong thing."""
    if name == "run.json":
        return draw(
            st.sampled_from(
                [
                    b"[]",
                    b"{}",
                    b'{"model": 5, "corpus": "x"}',
                    b"[" * 5000 + b"]" * 5000,
                    b'{"classification": {"thresholds": [1, 2]}}',
                    b'{"classification": {"thresholds": {"copy_max_norm_entropy": 7}}}',
                    b'{"classification": 3}',
                ]
            )
        )
    table = pq.read_table(valid / name)
    kind = draw(st.sampled_from(["no_rows", "drop_column", "strings", "duplicates", "nan", "negative", "extra"]))
    if kind == "no_rows":
        table = table.slice(0, 0)
    elif kind == "drop_column":
        table = table.drop_columns([draw(st.sampled_from(table.column_names))])
    elif kind == "strings":
        column = draw(st.sampled_from(table.column_names))
        index = table.schema.get_field_index(column)
        table = table.set_column(index, column, pa.array(["x"] * table.num_rows))
    elif kind == "duplicates":
        table = pa.concat_tables([table, table])
    elif kind == "nan":
        frame = table.to_pandas()
        numeric = [c for c in frame.columns if frame[c].dtype.kind == "f"]
        frame[draw(st.sampled_from(numeric))] = float("nan")
        table = pa.Table.from_pandas(frame, preserve_index=False)
    elif kind == "negative":
        frame = table.to_pandas()
        integer = [c for c in frame.columns if frame[c].dtype.kind == "i"]
        frame[draw(st.sampled_from(integer))] = -7
        table = pa.Table.from_pandas(frame, preserve_index=False)
    else:
        table = table.append_column("surprise", pa.array([1.5] * table.num_rows))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


@FUZZ
@given(st.data(), st.sampled_from(["classify", "classify_out", "plot"]))
def test_classify_and_plot_on_random_report_folders(valid_report, data, command):
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "report"
        folder.mkdir()
        for name in REPORT_FILES:
            # Half the files valid, so that runs get past the first check and reach the charts too.
            state = data.draw(st.one_of(st.just("valid"), st.sampled_from(FILE_STATES)), label=name)
            valid = (valid_report / name).read_bytes()
            if state == "missing":
                continue
            content = {
                "valid": lambda valid=valid: valid,
                "empty": lambda: b"",
                "truncated": lambda valid=valid: valid[: len(valid) // 2],
                "random": lambda: data.draw(st.binary(max_size=200)),
                "wrong": lambda name=name: wrong_version(name, valid_report, data.draw),
            }[state]()
            (folder / name).write_bytes(content)
        elsewhere = Path(scratch) / "elsewhere.txt"
        elsewhere.write_text("not headscope's")
        other = Path(scratch) / "relabelled"
        args = {
            "classify": ["classify", folder],
            "classify_out": ["classify", folder, "--out", other],
            "plot": ["plot", folder, "--format", "svg"],
        }[command]
        before = snapshot(Path(scratch), skip=(folder, other))
        started = time.perf_counter()
        result = run_cli(*args)
        assert time.perf_counter() - started < SECONDS_PER_RUN
        event(f"{command} exit {result.exit_code}")
        assert snapshot(Path(scratch), skip=(folder, other)) == before
        if result.exit_code != 0:
            assert_clean_failure(result)
            return
        written = other if command == "classify_out" else folder
        if command.startswith("classify"):
            heads = pd.read_parquet(written / "heads.parquet")
            assert len(heads) > 0 and heads["head_type"].isin(HEAD_TYPES).all()
        else:
            assert (folder / "entropy_heatmap.svg").is_file()
        assert not [p.name for p in written.iterdir() if p.name.startswith(".")]
