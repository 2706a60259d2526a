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
import shutil
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

from helpers import assert_one_line_error, run_cli, snapshot

pytestmark = pytest.mark.slow  # hundreds of random commands: the full suite's, not the fast loop's

FORMATS = ("txt", "jsonl", "csv", "tsv", "parquet")
# What can go wrong with a file; "none" and "bom_crlf" leave it valid.
DAMAGES = ("none", "bom_crlf", "truncated", "invalid_utf8", "random_bytes", "huge_field", "stray_quote", "odd_json")
DAMAGES += ("lone_surrogate",)  # a JSON escape of half a character: text the tokenizer's fast path cannot encode
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
    if damage == "lone_surrogate":
        return data.replace(b'"text": "', b'"text": "\\ud800', 1)
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
    """An error (1) or a usage error (2: an option's value refused), in one line, never a traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert_one_line_error(result, code=2 if result.exit_code == 2 else 1)


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

REPORT_FILES = ("heads.parquet", "run.json", "examples.parquet", "sentences.parquet", "sentence_heads.parquet")
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
                    b'{"model": {"input": "m", "architecture": {"layers": 1000000000000, "heads": 9}}, "corpus": {}}',
                    b'{"model": {"input": "m", "architecture": {"layers": 30, "heads": -3}}, "corpus": {}}',
                    b'{"model": {"input": "m", "architecture": {"layers": true, "heads": 2.5}}, "corpus": {}}',
                ]
            )
        )
    table = pq.read_table(valid / name)
    kinds = ["no_rows", "drop_column", "strings", "duplicates", "nan", "negative", "extra", "huge"]
    kind = draw(st.sampled_from(kinds))
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
    elif kind in ("negative", "huge"):  # a huge value must never size an array (a layer 10**9 once took minutes)
        frame = table.to_pandas()
        integer = [c for c in frame.columns if frame[c].dtype.kind == "i"]
        column = draw(st.sampled_from(integer))
        frame.loc[draw(st.integers(0, len(frame) - 1)), column] = -7 if kind == "negative" else 10**9
        table = pa.Table.from_pandas(frame, preserve_index=False)
    else:
        table = table.append_column("surprise", pa.array([1.5] * table.num_rows))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 2, 1))  # each draws charts: half the examples in CI
@given(st.data(), st.sampled_from(["classify", "classify_out", "plot", "compare"]))
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
            "compare": ["compare", folder, valid_report, "--out", other, "--replicates", "10", "--no-charts"],
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
        written = other if command in ("classify_out", "compare") else folder
        if command == "compare":
            assert (other / "compare.json").is_file()
        elif command.startswith("classify"):
            heads = pd.read_parquet(written / "heads.parquet")
            assert len(heads) > 0 and heads["head_type"].isin(HEAD_TYPES).all()
        else:
            assert (folder / "entropy_heatmap.svg").is_file()
        assert not [p.name for p in written.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- text that renderers would interpret

# Characters that mean something to mathtext ($ _ ^ \), rich ([ ] /), Plotly and HTML (< > & "), the page's
# template (__X__), and ordinary letters around them.
MARKUP = st.text(alphabet="$_^\\[]/<>&\"'=aXbY _-.", min_size=1, max_size=16)
NAME = MARKUP.map(lambda s: s.replace("/", "|").strip(" .") or "x").filter(lambda s: s not in (".", ".."))


@pytest.fixture(scope="module")
def byte_level_gpt2(tmp_path_factory) -> Path:
    """A tiny GPT-2 whose tokenizer has a token for every byte: every character of a corpus reaches the labels."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    folder = tmp_path_factory.mktemp("bytes") / "model"
    torch.manual_seed(0)
    GPT2Model(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 15, 1))  # each draws every chart and the page
@given(st.lists(MARKUP, min_size=2, max_size=4), NAME, NAME)
def test_markup_in_text_and_names_is_drawn_and_printed_as_text(byte_level_gpt2, sentences, corpus_name, model_name):
    """Any text in the corpus, the corpus's name and the model's name: analyze draws every chart and the page,
    prints its summary, and classify re-labels it; nothing is read as markup or a placeholder."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model = folder / model_name
        model.symlink_to(byte_level_gpt2, target_is_directory=True)
        corpus = folder / f"{corpus_name}.txt"
        corpus.write_text("".join(f"{s}\n" for s in sentences) + "a b c\n")
        out = folder / "report"
        result = run_cli("analyze", model, "--corpus", corpus, "--out", out, "--probe-seeds", "2", "--bootstrap", "0")
        assert result.exit_code == 0, result.output
        assert "warning" not in result.output and "Traceback" not in result.output
        assert {"examples.png", "entropy_heatmap.png", "report.html"} <= {p.name for p in out.iterdir()}
        page = (out / "report.html").read_text(encoding="utf-8")
        assert page.count("<script") == 3 and len(page) < 6e6  # one plotly.js, one data island, one app
        result = run_cli("classify", out)
        assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- device maps

DEVICES = st.one_of(
    st.sampled_from(["cpu", "disk", "meta", "cuda", "cuda:0", "cuda:7", "gpu7", "mps", "", "CPU"]),
    st.integers(-2, 9),
    st.none(),
    st.floats(allow_nan=True),
    st.lists(st.integers(0, 3), max_size=2),
    st.booleans(),
)
MODULES = st.sampled_from(["", "wte", "wpe", "h", "h.0", "h.1", "ln_f", "transformer.h.0", "h.9", "drop", "x"])


@FUZZ
@given(st.dictionaries(MODULES, DEVICES, max_size=4), st.booleans())
def test_random_device_maps(planted_gpt2, device_map, offload):
    """Any JSON map: the run works, or one line says what is wrong with the map; never a traceback, never a
    map silently ignored (a run that works records the map it applied)."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        path = folder / "map.json"
        path.write_text(json.dumps(device_map))
        out = folder / "report"
        extra = ["--offload-folder", folder / "offload"] if offload else []
        result = run_cli("analyze", planted_gpt2, "--out", out, "--device-map", path, *extra, "--no-probes",
                         "--bootstrap", "0", "--no-charts", "--no-page")  # fmt: skip
        event(f"exit {result.exit_code}")
        if result.exit_code != 0:
            assert_clean_failure(result)
            return
        assert json.loads((out / "run.json").read_text())["model"]["device_map"] is not None
        assert not (folder / "offload").exists() or not any((folder / "offload").iterdir())


# ---------------------------------------------------------------- users' files in and beside output folders

LOOKALIKES = st.sampled_from(
    [
        "report.html",
        "heads.parquet",
        "run.json",
        "compare.json",
        "plot.json",
        "entropy_heatmap.png",
        "notes.md",
        "examples.svg",
        ".headscope-work",
        "compare.parquet",
    ]
)
SIBLINGS = st.sampled_from([".out.old-1", ".out.staging-2", ".out.partial", ".out.tmp-3", ".out*.staging-4", "out.bak"])
WRITERS = st.sampled_from(["analyze", "classify --out", "plot --out", "compare"])


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 2, 1))  # each runs a whole command
@given(st.dictionaries(LOOKALIKES, st.binary(max_size=40), max_size=4), st.lists(SIBLINGS, max_size=3),
       WRITERS, st.booleans())  # fmt: skip
def test_every_byte_of_a_users_files_survives_every_command(valid_report, planted_gpt2, inside, beside, writer, force):
    """Files headscope did not write, in the output folder and beside it, named like its own or not: after any
    command, with or without --overwrite, each is byte for byte what it was (a command either refuses the
    folder, or the folder held nothing of the user's)."""
    from headscope.output import why_not_replaceable

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        out = folder / "out"
        out.mkdir()
        for name, content in inside.items():
            (out / name).write_bytes(content)
        for name in beside:
            (folder / name).mkdir(exist_ok=True)
            (folder / name / "keep").write_bytes(b"the user's")
        flag = ["--overwrite"] if force else []
        args = {
            "analyze": ["analyze", planted_gpt2, "--out", out, "--no-probes", "--bootstrap", "0", "--no-charts"],
            "classify --out": ["classify", valid_report, "--out", out],
            "plot --out": ["plot", valid_report, "--out", out, "--no-page", "--format", "svg"],
            "compare": ["compare", valid_report, valid_report, "--out", out, "--replicates", "10", "--no-charts"],
        }[writer]
        kind = {"analyze": "report", "classify --out": "report", "plot --out": "charts", "compare": "comparison"}
        replaceable = why_not_replaceable(out, kind[writer]) is None
        before = snapshot(folder)
        result = run_cli(*args, *flag)
        event(f"{writer} {'replaceable' if replaceable else 'foreign'} exit {result.exit_code}")
        if result.exit_code != 0:
            assert_clean_failure(result)
            assert snapshot(folder) == before
            return
        assert replaceable and (force or not inside)  # it wrote: the folder held nothing the user made
        assert {k: v for k, v in snapshot(folder).items() if not k.startswith("out/")} == {
            k: v for k, v in before.items() if not k.startswith("out/")
        }


# ---------------------------------------------------------------- head indices, from Python and from the CLI

ANYTHING = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.tuples(inner, inner)),
    max_leaves=8,
)
HEAD_TEXT = st.text(alphabet="0123456789.,- ²٣_x", max_size=16)


@FUZZ
@given(st.one_of(ANYTHING, HEAD_TEXT))
def test_random_heads_are_pairs_of_whole_numbers_or_one_error(value):
    """Any value where heads go: (layer, head) pairs of ints 0 or more within the limits, or a ConfigError; never
    a wrapped index, a bool taken for 1 or another exception."""
    from headscope.arguments import MAX_HEAD, MAX_LAYER, as_head_groups, as_heads
    from headscope.errors import ConfigError

    for parse in (as_heads, as_head_groups):
        try:
            found = parse(value)
        except ConfigError:
            continue
        pairs = [pair for group in found for pair in group] if parse is as_head_groups else list(found)
        for layer, head in pairs:
            assert type(layer) is int and type(head) is int
            assert 0 <= layer <= MAX_LAYER and 0 <= head <= MAX_HEAD


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 4, 1))
@given(HEAD_TEXT, HEAD_TEXT)
def test_random_heads_and_sentences_on_the_command_line(planted_gpt2, heads, sentences):
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        result = run_cli("inspect", planted_gpt2, "--sentences", sentences or "0", "--heads", heads or "0.0",
                         "--out", Path(scratch) / "o", "--no-page")  # fmt: skip
        assert time.perf_counter() - started < SECONDS_PER_RUN
        event(f"exit {result.exit_code}")
        if result.exit_code != 0:
            assert_clean_failure(result)


# ---------------------------------------------------------------- reports of other models


@pytest.fixture(scope="module")
def copier_report(tmp_path_factory):
    from planted import build_planted_copier, copy_words

    root = tmp_path_factory.mktemp("copier")
    model = build_planted_copier(root / "model", copiers=(0, 1), logit=20.0)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(" ".join(copy_words()[i : i + 5]) for i in range(6)) + "\n")
    report = root / "report"
    assert run_cli("analyze", model, "--corpus", corpus, "--out", report, "--no-probes", "--no-charts").exit_code == 0
    return model, corpus, report


IDENTITY = {
    ("architecture", "layers"): st.integers(1, 4),
    ("architecture", "heads"): st.integers(1, 6),
    ("architecture", "kv_heads"): st.integers(1, 6),
    ("architecture", "head_dim"): st.integers(1, 64),
    ("architecture", "model_type"): st.sampled_from(["gpt2", "llama"]),
    ("weights_sha256",): st.sampled_from([None, "0" * 64]),
    ("weights_dtype",): st.sampled_from(["float32", "bfloat16"]),
    ("location",): st.sampled_from(["/elsewhere", None]),
}


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 3, 1))
@given(st.data())
def test_a_report_is_used_only_on_the_model_it_was_measured_on(copier_report, data):
    """Change what identifies the report's model: ablate --report accepts it exactly when the change leaves it
    identifying the same model (the fingerprint when comparable, else the source), and otherwise refuses."""
    model, corpus, report = copier_report
    with tempfile.TemporaryDirectory() as scratch:
        changed = Path(scratch) / "report"
        shutil.copytree(report, changed)
        run = json.loads((changed / "run.json").read_text())
        original = json.loads(json.dumps(run["model"]))
        for path in data.draw(st.lists(st.sampled_from(sorted(IDENTITY)), min_size=1, max_size=3, unique=True)):
            section = run["model"]["architecture"] if path[0] == "architecture" else run["model"]
            section[path[-1]] = data.draw(IDENTITY[path], label="/".join(path))
        (changed / "run.json").write_text(json.dumps(run))
        result = run_cli("ablate", model, "--corpus", corpus, "--each-role", "--report", changed,
                         "--bootstrap", "0", "--out", Path(scratch) / "o")  # fmt: skip
        now, was = run["model"], original
        comparable = now["weights_sha256"] is not None and now["weights_dtype"] == was["weights_dtype"]
        same = now["architecture"] == was["architecture"] and (
            now["weights_sha256"] == was["weights_sha256"] if comparable else now["location"] == was["location"]
        )
        event(f"same model: {same}, exit {result.exit_code}")
        if same:
            assert result.exit_code == 0 or "has a role" in result.output, result.output
        else:  # refused: another model's, or a run.json that contradicts its own heads table
            assert_clean_failure(result)
            assert "was measured on" in result.stderr or "a damaged report" in result.stderr, result.stderr


# ---------------------------------------------------------------- interrupted publishing


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 6, 1))  # each runs a whole command twice
@given(st.sampled_from(["analyze", "compare", "plot", "plot --out", "classify", "inspect"]), st.integers(1, 12))
def test_a_command_interrupted_at_any_file_leaves_the_previous_output_whole(valid_report, planted_gpt2, name, k):
    """Ctrl-C as the k-th file of a command is put in place (with --overwrite over its previous output): either
    the command had finished (fewer files) or the previous output is byte for byte as it was."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        out = root / "out"
        commands = {
            "analyze": ["analyze", planted_gpt2, "--out", out, "--no-probes", "--bootstrap", "0", "--overwrite"],
            "compare": ["compare", valid_report, valid_report, "--out", out, "--replicates", "10", "--overwrite"],
            "plot": ["plot", out, "--format", "svg"],
            "plot --out": ["plot", valid_report, "--out", out, "--format", "svg", "--overwrite"],
            "classify": ["classify", out, "--role-probe-min", "0.9"],
            "inspect": ["inspect", planted_gpt2, "--text", "the cat sat", "--out", out, "--overwrite"],
        }
        if name in ("plot", "classify"):
            shutil.copytree(valid_report, out)
        else:
            assert run_cli(*commands[name]).exit_code == 0
        before = snapshot(root)
        calls, real = [0], os.replace

        def replace(source, destination, *args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                raise KeyboardInterrupt
            return real(source, destination, *args, **kwargs)

        os.replace = replace
        try:
            result = run_cli(*commands[name])
        finally:
            os.replace = real
        event(f"{name}: exit {result.exit_code}")
        assert result.exit_code in (0, 130), result.output
        if result.exit_code == 130:
            assert snapshot(root) == before
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- paths that loop or are too long

PATHS = st.sampled_from(["loop", "a/sub", "x" * 300, "y" * 250 + "/z", "dangling", "file", "file/sub", "ok"])


@settings(FUZZ, max_examples=max(FUZZ.max_examples // 3, 1))
@given(PATHS, st.sampled_from(["classify", "plot", "compare", "inspect", "ablate", "prune --save-model"]))
def test_paths_that_loop_or_are_too_long(valid_report, planted_gpt2, name, command):
    """An output path that is a symlink loop, too long, a file, or under one: one line, nothing written."""
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "loop").symlink_to(root / "loop")
        (root / "a").symlink_to(root / "b")
        (root / "b").symlink_to(root / "a")
        (root / "dangling").symlink_to(root / "nowhere" / "deeper")
        (root / "file").write_text("a file")
        target = root / name
        args = {
            "classify": ["classify", valid_report, "--out", target],
            "plot": ["plot", valid_report, "--out", target, "--no-page", "--format", "svg"],
            "compare": ["compare", valid_report, valid_report, "--out", target, "--replicates", "10", "--no-charts"],
            "inspect": ["inspect", planted_gpt2, "--text", "the cat", "--out", target, "--no-page"],
            "ablate": ["ablate", planted_gpt2, "--heads", "0.0", "--bootstrap", "0", "--out", target],
            "prune --save-model": [
                "prune",
                planted_gpt2,
                "--budget",
                "0.01",
                "--save-model",
                target,
                "--no-charts",
                "--out",
                root / "prune",
            ],
        }[command]
        before = snapshot(root)
        result = run_cli(*args)
        event(f"{command} {name[:8]}: exit {result.exit_code}")
        if result.exit_code != 0:
            assert_clean_failure(result)
            assert snapshot(root) == before
        else:  # a folder that can be made: a new one, one a dangling link points to, one under a long (legal) name
            assert name in ("ok", "dangling", "y" * 250 + "/z")
