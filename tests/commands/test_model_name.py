"""What the outputs call a model: titles, pages and printouts name a local model by its folder's or file's own name,
never by the path on the machine that ran it (issue 65: a circuit's charts and page carried it); the records keep
what the user typed beside it (`model.input`: the command can be run again from the record)."""

from __future__ import annotations

import json

import pytest

from headscope.model.loading import resolve_source
from headscope.summary import model_name

from helpers import run_cli
from planted import build_planted_induction


def test_a_models_name_is_its_alias_hub_id_folder_or_file(tmp_path):
    folder = tmp_path / "deep" / "models" / "my-model"
    folder.mkdir(parents=True)
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    assert resolve_source(str(folder)).name == "my-model"
    assert resolve_source(str(folder) + "/").name == "my-model"
    (tmp_path / "linked").symlink_to(folder, target_is_directory=True)
    assert resolve_source(str(tmp_path / "linked")).name == "linked"  # the name typed, not the link's target
    assert resolve_source(str(tmp_path / "weights.gguf")).name == "weights.gguf"
    assert resolve_source("smollm2").name == "smollm2" and resolve_source("org/some-model").name == "org/some-model"
    assert model_name({"model": {"input": str(folder), "name": "my-model"}}) == "my-model"
    assert model_name({"model": {"input": "/old/record/without/a/name"}}) == "/old/record/without/a/name"


@pytest.mark.slow
def test_a_circuits_page_and_printout_name_the_folder_not_its_path(tmp_path):
    folder = build_planted_induction(tmp_path / "somewhere" / "private" / "induction-lm", predicts=True)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"clean": "w5 w9 w12 w5", "corrupt": "w7 w9 w12 w5", "answer": "w9",
                                 "distractor": "w12"}) + "\n")  # fmt: skip
    out = tmp_path / "circuit"
    common = ("circuit", str(folder), "--pairs", str(pairs), "--device", "cpu", "--verify", "1", "--no-curve",
              "--no-charts", "--bootstrap", "0")  # fmt: skip
    done = run_cli(*common, "--out", str(out))
    assert done.exit_code == 0, done.output
    assert run_cli(*common, "--out", str(tmp_path / "bare"), "--no-page").exit_code == 0
    assert not (tmp_path / "bare" / "circuit.html").exists() and (tmp_path / "bare" / "circuit.json").is_file()
    private = str(tmp_path / "somewhere")
    title = next(line for line in done.output.splitlines() if "logit_diff =" in line)  # the printout's title
    assert title.strip().startswith("induction-lm:") and private not in title  # (the log says where it loads from)
    assert private not in (out / "circuit.html").read_text()
    record = json.loads((out / "circuit.json").read_text())
    assert record["model"]["name"] == "induction-lm" and record["model"]["input"] == str(folder)
