"""--resume: a checkpoint continues to the tables an uninterrupted run writes, and is refused when it is not whole or
not of this run."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from headscope.config import RunConfig

from helpers import (
    Interrupting,
    assert_one_line_error,
    hidden_leftovers,
    run_cli,
    snapshot,
)


@pytest.fixture
def interrupted(planted_gpt2, tmp_path, corpus_lines):
    """A --resume run over three chunks (8,200 sentences), interrupted (Ctrl-C) in the third."""
    corpus = tmp_path / "big.txt"
    corpus.write_text("\n".join(corpus_lines * 82) + "\n")
    out = tmp_path / "report"
    ctrl_c = Interrupting(after=2 * RunConfig().chunk_sentences)
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume", "--no-charts", reporter=ctrl_c
    )
    assert result.exit_code == 130, result.output
    checkpoint = tmp_path / ".report.partial"
    assert json.loads((checkpoint / "checkpoint.json").read_text())["progress"]["chunks_done"] == 2
    return corpus, out, checkpoint


@pytest.mark.slow  # an interrupted 8,200-sentence run
def test_a_checkpoint_with_a_part_missing_is_refused(planted_gpt2, interrupted):
    corpus, out, checkpoint = interrupted
    (checkpoint / "sentences.part-000001.parquet").unlink()
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume"),
        "is incomplete (sentences.part-000001.parquet is missing)",
    )
    assert not out.exists()


@pytest.mark.slow  # an interrupted 8,200-sentence run
def test_a_checkpoint_planned_for_another_model_is_refused(planted_gpt2, interrupted):
    """The checkpoint keeps the resolved plan; a resume that resolves another one (here: the checkpoint says the
    model was 24 layers deep) is refused, not continued with sums of another shape or meaning."""
    corpus, out, checkpoint = interrupted
    record = json.loads((checkpoint / "checkpoint.json").read_text())
    record["plan"]["depth"] = 24
    (checkpoint / "checkpoint.json").write_text(json.dumps(record))
    assert_one_line_error(
        run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume"),
        "was planned differently (depth: the model changed?)",
    )
    assert not out.exists()


@pytest.mark.slow  # an interrupted 8,200-sentence run
def test_a_resumed_run_records_the_batching_it_used(planted_gpt2, interrupted):
    corpus, out, _ = interrupted
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--resume", "--batch-size", "7", "--no-charts"
    )
    assert result.exit_code == 0, result.output
    assert "resuming with the interrupted run's batching (--batch-size auto" in result.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["batch_size"] is None and run["batching"]["max_sentences"] == 256
    assert len(pd.read_parquet(out / "sentences.parquet")) == 8200


@pytest.mark.slow  # an interrupted 8,200-sentence run
def test_a_checkpoint_belongs_to_the_run_that_wrote_it(planted_gpt2, interrupted):
    """Only the same command with --resume continues (and then consumes) a checkpoint: a run without --resume is
    refused, saying what is there, and the checkpoint is left for --resume."""
    corpus, out, checkpoint = interrupted
    before = snapshot(checkpoint)
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts")
    assert_one_line_error(result, str(checkpoint), "interrupted `headscope analyze` run", "delete that folder")
    assert snapshot(checkpoint) == before and not out.exists()
    result = run_cli("analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--no-charts", "--resume")
    assert result.exit_code == 0, result.output
    assert not checkpoint.exists() and hidden_leftovers(out.parent) == []
