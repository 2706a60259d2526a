"""Bad input, faults and interruptions: one-line errors, non-zero exits, outputs never half-written."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch

import headscope
from headscope.errors import ModelLoadError, OutputError
from headscope.estimates import metric_means
from headscope.measures.row_sums import head_row_sums
from headscope.model.loading import load_for_run
from headscope.model.masks import causal_visible_keys
from headscope.report.report import read_run
from headscope.run.checkpoint import PartFiles
from headscope.tables import SENTENCES_SCHEMA

from helpers import (
    HANG,
    Interrupting,
    assert_one_line_error,
    hidden_leftovers,
    previous_report,
    run_cli,
    tiny_model_folder,
)
from planted import build_tokenizer

# ---------------------------------------------------------------- corpus


@pytest.mark.slow  # analyze through the CLI, twice
def test_invalid_utf8_can_be_replaced_or_skipped(planted_gpt2, tmp_path):
    corpus = tmp_path / "mixed.txt"
    corpus.write_bytes(b"The cat sat.\nBroken \xff line here.\nThe dog ran.\n")
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", tmp_path / "a"),
        "mixed.txt:2: invalid UTF-8 at byte 7 of the line",
        "--encoding-errors",
    )
    for mode, expected in (
        ("replace", ["The cat sat.", "Broken \ufffd line here.", "The dog ran."]),
        ("skip", ["The cat sat.", "The dog ran."]),
    ):
        out = tmp_path / mode
        result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--encoding-errors", mode)
        assert result.exit_code == 0, result.output
        assert pd.read_parquet(out / "sentences.parquet")["text"].tolist() == expected
        assert read_run(out)["corpus"]["invalid_utf8_lines"] == 1


@pytest.mark.slow  # analyze through the CLI
def test_a_long_line_is_truncated_not_dropped(planted_gpt2, tmp_path):
    corpus = tmp_path / "long.txt"
    corpus.write_text("Short one.\n" + " ".join(["word"] * 500) + "\n")
    out = tmp_path / "out"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out)  # the model takes 64 positions
    assert result.exit_code == 0, result.output
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert sentences["n_tokens"].tolist() == [3, 64] and sentences["truncated"].tolist() == [False, True]


# ---------------------------------------------------------------- models


def test_encoder_only_model_is_refused(tmp_path, corpus_lines):
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    folder = tiny_model_folder(tmp_path / "bert", config, BertModel, corpus_lines)
    assert_one_line_error(run_cli("analyze", folder, "--out", tmp_path / "o"), "bidirectional")
    assert not (tmp_path / "o").exists()


def test_encoder_decoder_model_is_refused(tmp_path, corpus_lines):
    from transformers import T5Config, T5Model

    config = T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    folder = tiny_model_folder(tmp_path / "t5", config, T5Model, corpus_lines)
    assert_one_line_error(run_cli("analyze", folder, "--out", tmp_path / "o"), "encoder-decoder")


def test_state_space_model_is_refused(tmp_path, corpus_lines):
    from transformers import MambaConfig, MambaModel

    config = MambaConfig(hidden_size=32, num_hidden_layers=1, state_size=4)
    folder = tiny_model_folder(tmp_path / "mamba", config, MambaModel, corpus_lines)
    assert_one_line_error(run_cli("analyze", folder, "--out", tmp_path / "o"), "no attention heads")


def test_folder_that_is_not_a_model(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a model")
    assert_one_line_error(run_cli("analyze", folder, "--out", tmp_path / "o"), f"cannot load a model from {folder}")


def test_truncated_gguf_file(tmp_path):
    from headscope.model.loading import resolve_source

    source = resolve_source("smollm2")
    truncated = tmp_path / "cut.gguf"
    with open(os.path.join(source.location, source.gguf_file), "rb") as whole:
        truncated.write_bytes(whole.read(65536))
    assert_one_line_error(
        run_cli("analyze", truncated, "--out", tmp_path / "o"), f"cannot load a model from {truncated}"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is missing")
def test_cuda_requested_without_cuda(planted_gpt2, tmp_path):
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--device", "cuda", "--out", tmp_path / "o"), "no CUDA device"
    )


def test_model_too_large_for_memory_is_refused_before_loading(planted_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr("headscope.model.memory.host_free_memory", lambda: 2**20)
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--out", tmp_path / "o"), "GiB for its weights", "--dtype", "--device-map"
    )


def test_out_of_memory_during_a_batch(planted_gpt2, tmp_path):
    def exhausted(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    def loader(source, settings, model_config, lm_head):  # the model runs out of memory inside its first layer
        loaded = load_for_run(source, settings, model_config, lm_head)
        loaded.model.h[0].register_forward_pre_hook(exhausted)
        return loaded

    out = tmp_path / "o"
    assert_one_line_error(run_cli("analyze", planted_gpt2, "--out", out, loader=loader), "out of memory on a batch")
    assert hidden_leftovers(tmp_path) == [] and not out.exists()


# ---------------------------------------------------------------- numerics


def test_nonfinite_and_unnormalised_rows_are_counted_and_kept_out():
    attn = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5, dtype=torch.float32)[:, None]
    attn = attn[None, None].repeat(1, 2, 1, 1)
    attn[0, 0, 2, :] = float("nan")  # head 0, row 2: float16 overflow, say
    attn[0, 1, 3, :] = attn[0, 1, 3, :] * 0.9  # head 1, row 3: mass 0.9
    valid = torch.ones(1, 4, dtype=torch.bool)
    sums = head_row_sums(
        attn,
        key_visible=causal_visible_keys(valid),
        query_valid=valid,
        seq_start=torch.zeros(1, dtype=torch.long),
        window=2,
    )
    means = metric_means(sums.numpy())
    assert means["nonfinite_rows"][0].tolist() == [1, 0]
    assert means["unnormalised_rows"][0].tolist() == [0, 1]
    assert means["n_rows"][0].tolist() == [3, 4]
    assert means["entropy"][0, 0] == pytest.approx(np.mean([np.log(1), np.log(2), np.log(4)]))


# ---------------------------------------------------------------- outputs


@pytest.mark.slow  # analyze through the CLI, twice
def test_full_disk_fails_cleanly_and_keeps_the_previous_report(planted_gpt2, tmp_path, monkeypatch):
    out = tmp_path / "report"
    assert run_cli("analyze", planted_gpt2, "--out", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("headscope.tables.pq.write_table", disk_full)
    result = run_cli("analyze", planted_gpt2, "--out", out, "--overwrite")
    assert_one_line_error(result, "Error: cannot write", ": No space left on device")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert hidden_leftovers(tmp_path) == [] and hidden_leftovers(out) == []


def test_classify_and_plot_explain_a_foreign_or_missing_table(tmp_path, planted_gpt2):
    out = tmp_path / "report"
    assert run_cli("analyze", planted_gpt2, "--out", out, "--no-charts").exit_code == 0
    pd.DataFrame({"a": [1, 2]}).to_parquet(out / "heads.parquet")
    assert_one_line_error(run_cli("classify", out), "heads.parquet is not a headscope table", "layer")
    assert_one_line_error(run_cli("plot", out), "heads.parquet is not a headscope table")
    (out / "heads.parquet").write_bytes(b"PAR1 garbage")
    assert_one_line_error(run_cli("plot", out), "heads.parquet is not a readable Parquet file")
    (out / "heads.parquet").unlink()
    assert_one_line_error(run_cli("classify", out), "heads.parquet not found")


@pytest.mark.slow  # a child process
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_run_leaves_the_previous_report_intact(planted_gpt2, tmp_path, corpus_lines, sig, code):
    out = tmp_path / "report"
    previous_report(out)
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n".join(corpus_lines * 400) + "\n")  # 40,000 sentences: minutes of work
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headscope",
            "analyze",
            str(planted_gpt2),
            "--corpus",
            str(corpus),
            "--out",
            str(out),
            "--overwrite",
            # the staging folder holds the first chunk's checkpoint within seconds, with 19 chunks still to go: the
            # signal lands mid-run (with one chunk, the folder appeared only when the report was written, and a run
            # that wrote it within the second the test waits exited 0 before the signal came)
            "--chunk-sentences",
            "2000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        # A shell's background job (nohup ... &) starts with SIGINT ignored, and Python then never raises
        # KeyboardInterrupt: give the child the default disposition, as a terminal's foreground job has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + HANG
    while not hidden_leftovers(tmp_path) and time.monotonic() < deadline:  # the staging folder appears
        time.sleep(0.1)
    time.sleep(1.0)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=HANG)
    assert process.returncode == code, stderr
    assert (out / "heads.parquet").read_bytes() == b"the previous run"
    assert sorted(p.name for p in out.iterdir()) == ["heads.parquet", "run.json"]
    assert hidden_leftovers(tmp_path) == []
    assert "Traceback" not in stderr.decode()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowing, as Python does it
@pytest.mark.parametrize(("handler", "code"), [("raise_terminated", 143), ("raise_interrupted", 130)])
def test_a_signal_a_finalizer_swallows_still_stops_the_run_before_it_publishes(
    planted_gpt2, tmp_path, corpus_lines, handler, code
):
    """Python loses an exception raised while a finalizer (`__del__`) runs: it prints "Exception ignored in ..." and
    carries on. A SIGTERM that landed in the regex package's finalizer once let a terminated analyze run to its end
    and publish, exit 0. The signal is noted as its handler raises it, and the run stops before publishing: the
    previous report intact, the signal's exit code. Here the CLI's own handler fires inside a finalizer, as the
    signal did, during the load (through the loader seam)."""
    import headscope.cli.common as common

    out = previous_report(tmp_path / "report")

    class Collected:
        def __del__(self):
            getattr(common, handler)(None, None)

    def loader(*args):
        Collected()  # collected at once: its finalizer's exception is printed and lost
        return load_for_run(*args)

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(corpus_lines[:10]))
    options = ["--corpus", corpus, "--out", out, "--overwrite", "--no-charts", "--no-page"]
    result = run_cli("analyze", planted_gpt2, *options, loader=loader)
    assert result.exit_code == code, result.output
    assert (out / "heads.parquet").read_bytes() == b"the previous run"
    assert sorted(p.name for p in out.iterdir()) == ["heads.parquet", "run.json"]
    assert hidden_leftovers(tmp_path) == []


def test_same_input_gives_identical_tables(planted_gpt2, corpus_lines):
    first = headscope.analyze(str(planted_gpt2), corpus_lines[:50])
    second = headscope.analyze(str(planted_gpt2), corpus_lines[:50])
    pd.testing.assert_frame_equal(first.heads, second.heads, check_exact=True)
    pd.testing.assert_frame_equal(first.sentence_heads, second.sentence_heads, check_exact=True)


def test_loading_errors_are_headscope_errors():
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        headscope.load_model("missing.gguf")


@pytest.mark.slow  # over 1.5 s on two cores: out of the fast loop (docs/tests.md)
def test_resume_continues_from_the_checkpoint_and_matches_an_uninterrupted_run(planted_gpt2, corpus_lines, tmp_path):
    options = {"chunk_sentences": 10, "charts": None}
    whole = headscope.analyze(str(planted_gpt2), corpus_lines, out=tmp_path / "whole", **options)

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in the third chunk
        headscope.analyze(str(planted_gpt2), corpus_lines, out=out, resume=True, reporter=Interrupting(20), **options)
    assert not out.exists()
    checkpoint = json.loads((tmp_path / ".resumed.partial" / "checkpoint.json").read_text())
    assert checkpoint["progress"]["chunks_done"] == 2

    with pytest.raises(OutputError, match="from a different run"):
        headscope.analyze(str(planted_gpt2), corpus_lines, out=out, resume=True, window=3, **options)
    resumed = headscope.analyze(str(planted_gpt2), corpus_lines, out=out, resume=True, **options)
    pd.testing.assert_frame_equal(resumed.heads, whole.heads, check_exact=True)
    for name in ("sentences.parquet", "sentence_heads.parquet"):
        pd.testing.assert_frame_equal(pd.read_parquet(out / name), pd.read_parquet(tmp_path / "whole" / name))
    assert hidden_leftovers(tmp_path) == []
    assert not [p.name for p in out.iterdir() if "part" in p.name or "checkpoint" in p.name]


class CountingTokenizer:
    """A tokenizer that records how many texts each call of it encodes (and otherwise is the one it wraps)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def __call__(self, texts, *args, **kwargs):
        self.calls.append(1 if isinstance(texts, str) else len(texts))
        return self.tokenizer(texts, *args, **kwargs)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.slow  # 150,000 sentences
def test_a_large_corpus_is_streamed_in_chunks(tmp_path, corpus_lines):
    """150,000 sentences through a minute model: tokenized chunk by chunk (37 of them), never all at once."""
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path / "minute-gpt2"
    tokenizer = build_tokenizer([w for line in corpus_lines for w in line.split()])
    torch.manual_seed(0)
    GPT2Model(GPT2Config(vocab_size=len(tokenizer), n_embd=8, n_layer=1, n_head=2, n_positions=64)).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    corpus = tmp_path / "large.txt"
    corpus.write_text("\n".join(corpus_lines * 1_500) + "\n")
    loaded = headscope.load_model(str(folder), device="cpu")
    loaded.tokenizer = counting = CountingTokenizer(loaded.tokenizer)
    out = tmp_path / "report"
    report = headscope.analyze(loaded, corpus, out=out, charts=None, page=False, sentence_heads=False, probes=False)
    examples = report.examples.query("source == 'corpus'")["sentence_id"].nunique()
    # each example alone, then the exemplars' sentences together (tokenized again for their context), last
    chunks, example_sentences = counting.calls[: -examples - 1], counting.calls[-examples - 1 : -1]
    exemplar_sentences = counting.calls[-1]
    size = headscope.RunConfig().chunk_sentences
    assert max(chunks) == size and len(chunks) == -(-150_000 // size) and example_sentences == [1] * examples
    assert exemplar_sentences == report.exemplars["sentence"].nunique()
    assert report.run["corpus"]["sentences"] == 150_000
    per_sentence = pd.read_parquet(out / "sentences.parquet", columns=["n_tokens"])["n_tokens"]
    assert report.run["corpus"]["tokens"] == int(per_sentence.sum())


BAD_CORPORA = [
    ("absent.txt", None, "corpus file not found"),
    ("folder.txt", "dir", "corpus path is not a file"),
    ("empty.txt", b"", "corpus has no sentences"),
    ("blank.txt", b"\n   \r\n\n", "corpus has no sentences"),
    ("latin1.txt", b"caf\xe9 au lait\n", "latin1.txt:1: invalid UTF-8 at byte 3 of the line"),
    ("nul.txt", b"fine\nhas\x00nul\n", "nul.txt:2: NUL byte at column 4"),
    ("bad.jsonl", b'{"text": "fine"}\nnot json\n', "bad.jsonl:2: not valid JSON"),
    ("nofield.jsonl", b'{"body": "fine"}\n', "nofield.jsonl:1: no 'text' field"),
    ("nocolumn.csv", b"body\nfine\n", "no column 'text' (columns: body)"),
]


@pytest.mark.parametrize(("name", "content", "message"), BAD_CORPORA)
def test_bad_corpora_through_the_cli(planted_gpt2, tmp_path, name, content, message):
    corpus = tmp_path / name
    if content == "dir":
        corpus.mkdir()
    elif content is not None:
        corpus.write_bytes(content)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out), message)
    assert not out.exists() and hidden_leftovers(tmp_path) == []


@pytest.mark.slow  # analyze through the CLI
def test_messy_but_valid_text_goes_through_the_cli(planted_gpt2, tmp_path):
    corpus = tmp_path / "messy.txt"
    corpus.write_bytes(b"\xef\xbb\xbfThe cat sat.\r\n\r\n  The dog ran.  \rA bird sang.\n\n")
    out = tmp_path / "out"
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out)
    assert result.exit_code == 0, result.output
    sentences = pd.read_parquet(out / "sentences.parquet")
    assert sentences["text"].tolist() == ["The cat sat.", "The dog ran.", "A bird sang."]
    assert sentences["line"].tolist() == [1, 3, 4]


@pytest.mark.slow  # over 1.5 s on two cores: out of the fast loop (docs/tests.md)
def test_nan_attention_is_counted_and_reported_through_the_cli(planted_gpt2, tmp_path):
    """float16 overflow, simulated by a model whose own attention maths turns the first row of head 0 to NaN."""
    from overflowing import make_overflowing

    def loader(source, settings, model_config, lm_head):
        loaded = load_for_run(source, settings, model_config, lm_head)
        make_overflowing(loaded.model)
        return loaded

    out = tmp_path / "out"
    result = run_cli("analyze", planted_gpt2, "--out", out, "--batch-size", "1", "--no-charts", loader=loader)
    assert result.exit_code == 0, result.output
    assert "attention rows held NaN or inf" in result.output
    heads = pd.read_parquet(out / "heads.parquet")
    assert (heads.loc[heads["head"] == 0, "nonfinite_rows"] == 100).all()  # one row per sentence, per layer
    assert (heads.loc[heads["head"] != 0, "nonfinite_rows"] == 0).all()
    assert heads["entropy"].notna().all()
    assert read_run(out)["numerics"]["nonfinite_rows"] == 200


def test_a_report_kept_in_memory_holds_the_per_sentence_tables_a_written_one_does(planted_gpt2, corpus_lines, tmp_path):
    """Without an output folder the chunks' parts are merged in memory (run.checkpoint.PartFiles): the same tables,
    bit for bit and type for type, as the files a written report holds, over several chunks."""
    loaded = headscope.load_model(str(planted_gpt2), device="cpu")
    kept = headscope.analyze(loaded, corpus_lines[:30], chunk_sentences=8, charts=None, page=False)
    headscope.analyze(loaded, corpus_lines[:30], chunk_sentences=8, charts=None, page=False, out=tmp_path / "r")
    written = headscope.Report.open(tmp_path / "r")
    assert kept.run["corpus"]["sentences"] == 30 and len(kept.sentences) == 30
    pd.testing.assert_frame_equal(kept.sentences, written.sentences, check_exact=True)
    pd.testing.assert_frame_equal(kept.sentence_heads, written.sentence_heads, check_exact=True)


def test_parts_held_in_memory_are_never_written_and_a_lost_one_is_named(tmp_path):
    parts = PartFiles(tmp_path, {}, checkpoints=False, in_memory=True)
    sentences = pd.DataFrame({"sentence_id": [0], "line": [1], "text": ["a b"], "n_tokens": [2], "truncated": [False]})
    parts.add(0, sentences, None)
    parts.add(2, sentences, None)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputError, match=r"the sentences of chunks \[1\] were never measured"):
        parts.merged("sentences", SENTENCES_SCHEMA, tmp_path / "sentences.parquet", 3)
    with pytest.raises(ValueError, match="neither checkpointed"):
        PartFiles(tmp_path, {}, checkpoints=True, in_memory=True)


def test_a_signal_inside_a_finalizer_prints_no_traceback(monkeypatch, capsys):
    """A Ctrl-C that lands while a finalizer (__del__) runs cannot leave it; Python hands it to sys.unraisablehook,
    whose default prints 'Exception ignored in ... Traceback'. The CLI's hook stays quiet for a signal (noted, and
    raised again at the next safe point) and reports anything else as Python would."""
    from headscope.cli.common import Terminated, quiet_signals_in_finalizers

    monkeypatch.setattr(sys, "unraisablehook", quiet_signals_in_finalizers)

    class Finalized:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def __del__(self) -> None:
            raise self.error

    for signalled in (KeyboardInterrupt(), Terminated()):
        Finalized(signalled)  # dropped at once: its __del__ raises
    assert capsys.readouterr().err == ""
    Finalized(ValueError("a bug in a finalizer"))
    assert "a bug in a finalizer" in capsys.readouterr().err
