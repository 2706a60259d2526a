"""circuit at research scale: each pass shows its progress (the reporter seam: scoring counts pairs, patching counts
patched runs), and an interrupted run continues with --resume from its saved scores and patched edge sets, to the
numbers an uninterrupted run gives (commands/circuit_resume.py)."""

from __future__ import annotations

import pandas as pd
import pytest

import headscope
from headscope.commands.circuit_resume import PATCH_GROUP
from headscope.errors import ConfigError, OutputError
from headscope.layout import CIRCUIT_PATCHED, CIRCUIT_SCORES
from headscope.output import checkpoint_of
from headscope.progress import NullReporter

from planted import build_planted_induction


class Passes(NullReporter):
    """Records each pass (what, unit, total) with the count it advanced by; raises KeyboardInterrupt (Ctrl-C) when
    the pass numbered `interrupt_at` starts."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.passes: list[list] = []
        self.notes: list[str] = []
        self.interrupt_at = interrupt_at

    def start(self, total_sentences: int, what: str = "measuring", unit: str = "sentences") -> None:
        if self.interrupt_at == len(self.passes):
            raise KeyboardInterrupt
        self.passes.append([what, unit, total_sentences, 0])

    def advance(self, sentences: int, tokens: int) -> None:
        self.passes[-1][3] += sentences

    def note(self, message: str) -> None:
        self.notes.append(message)


RECORDS = [
    {"clean": "w5 w9 w12 w20 w5", "corrupt": "w7 w9 w12 w20 w5", "answer": "w9", "distractor": "w12"},
    {"clean": "w3 w4 w6 w8 w11 w3", "corrupt": "w2 w4 w6 w8 w11 w3", "answer": "w4", "distractor": "w8"},
    {"clean": "w3 w4 w3", "corrupt": "w2 w4 w3", "answer": "w4", "distractor": "w8"},
]
VERIFY = PATCH_GROUP  # with the strongest by EAP too and the curve's sets: more than one group


@pytest.fixture(scope="module")
def induction(tmp_path_factory):
    folder = build_planted_induction(tmp_path_factory.mktemp("induction-lm"), predicts=True)
    return headscope.load_model(str(folder), device="cpu", lm_head=True)


def run(loaded, out, reporter, **options):
    return headscope.circuit(loaded, RECORDS, method="eap-ig", steps=2, verify=VERIFY, out=out, charts=None,
                             reporter=reporter, **options)  # fmt: skip


@pytest.mark.slow
def test_each_pass_counts_what_it_runs(induction, tmp_path):
    """Scoring advances by pairs to the pairs' count; the patched passes by patched runs (a pair with one edge set
    patched) to pairs x sets, one bar per group of PATCH_GROUP sets, with the time left on the terminal's bar."""
    reporter = Passes()
    found = run(induction, tmp_path / "c", reporter)
    sets = found.record["verified"] + len(found.record["faithfulness"]) - 2  # the curve's ends are the runs
    scoring = [p for p in reporter.passes if p[1] == "pairs"]
    patching = [p for p in reporter.passes if p[1] == "patched runs"]
    assert [p[2:] for p in scoring] == [[len(RECORDS), len(RECORDS)]] and "eap-ig, 2 steps" in scoring[0][0]
    assert all(total == done for _, _, total, done in patching) and len(patching) == -(-sets // PATCH_GROUP) > 1
    assert sum(p[2] for p in patching) == len(RECORDS) * sets


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_uninterrupted_numbers(induction, tmp_path):
    """Ctrl-C while the second group of edge sets is patched keeps the scores and the first group; --resume reads
    them back (no scoring pass, only the sets not saved are patched) and ends with the tables an uninterrupted run
    writes, without the checkpoint in them."""
    whole = run(induction, tmp_path / "whole", Passes())
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run(induction, out, Passes(interrupt_at=2))  # scoring, the first group, then Ctrl-C
    kept = checkpoint_of(out)
    assert (kept / CIRCUIT_SCORES).is_file() and (kept / CIRCUIT_PATCHED).is_file() and not out.exists()
    again = Passes()
    found = run(induction, out, again, resume=True)
    assert {p[1] for p in again.passes} == {"patched runs"}  # scores read back; the groups after the first alone
    sets = found.record["verified"] + len(found.record["faithfulness"]) - 2
    assert sum(p[2] for p in again.passes) == len(RECORDS) * (sets - PATCH_GROUP)
    assert [note.split(" read back")[0] for note in again.notes] == [
        f"resuming the interrupted run: the edge scores of {len(RECORDS)} pairs",
        f"resuming the interrupted run: {PATCH_GROUP} of {sets} patched edge sets",
    ]
    pd.testing.assert_frame_equal(found.edges, whole.edges)
    assert found.record["faithfulness"] == whole.record["faithfulness"]
    assert not kept.exists() and not {CIRCUIT_SCORES, CIRCUIT_PATCHED} & {p.name for p in out.iterdir()}


@pytest.mark.slow
def test_a_checkpoint_of_other_inputs_or_damaged_is_refused_and_resume_needs_an_out(induction, tmp_path):
    out = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        run(induction, out, Passes(interrupt_at=1))  # the scores saved, Ctrl-C before any patched pass
    with pytest.raises(OutputError, match="holds the checkpoint of an interrupted `headscope circuit`"):
        run(induction, out, Passes())  # without --resume: the checkpoint is not replaced
    with pytest.raises(OutputError, match="edge scores of a circuit with other inputs"):
        headscope.circuit(induction, RECORDS, method="eap", verify=VERIFY, out=out, charts=None, resume=True)
    scores = checkpoint_of(out) / CIRCUIT_SCORES
    scores.write_bytes(scores.read_bytes()[:100])  # a damaged checkpoint: refused, never read as numbers
    with pytest.raises(OutputError, match="cannot read the interrupted run's edge scores"):
        run(induction, out, Passes(), resume=True)
    with pytest.raises(ConfigError, match="--resume needs an output folder"):
        headscope.circuit(induction, RECORDS, resume=True)
