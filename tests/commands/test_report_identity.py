"""A report's roles name heads by (layer, head): read into another model they name heads that do something else.
ablate and inspect take --report only when it was measured on this model: the same architecture and weights
(a fingerprint of every parameter), or, where weights cannot be compared, the same source."""

from __future__ import annotations

import json
import shutil

import pytest

import headscope
from headscope.errors import ConfigError

from helpers import assert_one_line_error, run_cli, tiny_model_folder
from planted import build_planted_copier, copy_words

SENTENCES = [" ".join(copy_words()[i : i + 5]) for i in range(6)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two copiers of one architecture whose weights differ (which heads copy), a copy of the first in another
    folder, a Llama of another architecture, and a report of the first."""
    root = tmp_path_factory.mktemp("identity")
    first = build_planted_copier(root / "first", copiers=(0, 1), logit=20.0)
    second = build_planted_copier(root / "second", copiers=(0,), logit=20.0)
    shutil.copytree(first, root / "copy")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    llama = tiny_model_folder(root / "llama", config, LlamaForCausalLM, SENTENCES)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES) + "\n")
    report = root / "report"
    assert (
        run_cli(
            "analyze", first, "--corpus", corpus, "--out", report, "--no-charts", "--no-page", "--no-probes"
        ).exit_code
        == 0
    )
    return {"first": first, "second": second, "copy": root / "copy", "llama": llama, "report": report,
            "corpus": corpus}  # fmt: skip


def test_a_report_of_another_architecture_is_refused(models, tmp_path):
    for command in (
        ["ablate", models["llama"], "--each-role", "--report", models["report"], "--corpus", models["corpus"]],
        ["inspect", models["llama"], "--text", SENTENCES[0], "--report", models["report"], "--role", "sink"],
    ):
        result = run_cli(*command, "--out", tmp_path / command[0])
        assert_one_line_error(result, f"--report {models['report']} was measured on", "another model's heads", code=2)
        assert not (tmp_path / command[0]).exists()


def test_a_report_of_other_weights_of_the_same_architecture_is_refused(models, tmp_path):
    result = run_cli("ablate", models["second"], "--each-role", "--report", models["report"],
                     "--corpus", models["corpus"], "--out", tmp_path / "a")  # fmt: skip
    assert_one_line_error(result, "whose weights differ", code=2)


def test_the_same_weights_from_another_folder_are_the_same_model(models):
    found = headscope.ablate(str(models["copy"]), SENTENCES, each_role=True, report=models["report"], bootstrap=0)
    assert found.record["groups"]


def test_a_report_without_a_fingerprint_is_matched_by_its_source(models, tmp_path):
    """Older reports (or a model offloaded to disk) carry no fingerprint: then the source must be the same."""
    report = tmp_path / "report"
    shutil.copytree(models["report"], report)
    run = json.loads((report / "run.json").read_text())
    run["model"]["weights_sha256"] = None
    (report / "run.json").write_text(json.dumps(run))
    assert headscope.ablate(str(models["first"]), SENTENCES, each_role=True, report=report, bootstrap=0)
    with pytest.raises(ConfigError, match="their weights cannot be compared here"):
        headscope.ablate(str(models["copy"]), SENTENCES, each_role=True, report=report, bootstrap=0)


def test_a_report_from_before_whole_weight_fingerprints_says_why_it_is_matched_by_source(models, tmp_path):
    report = tmp_path / "report"
    shutil.copytree(models["report"], report)
    run = json.loads((report / "run.json").read_text())
    del run["model"]["weights_fingerprint"]  # an older headscope sampled 16 values of each parameter
    (report / "run.json").write_text(json.dumps(run))
    with pytest.raises(ConfigError, match="the report's fingerprint samples the weights"):
        headscope.ablate(str(models["copy"]), SENTENCES, each_role=True, report=report, bootstrap=0)


def test_every_head_of_every_projection_is_in_the_fingerprint(models):
    """Zeroing one head's columns of one output projection, or scaling another's, changes the fingerprint (16
    values sampled per parameter missed whole heads of SmolLM2's output projections)."""
    import torch

    from headscope.model.identity import weights_fingerprint

    model = headscope.load_model(str(models["first"]), device="cpu").model
    before = weights_fingerprint(model)
    projection = model.h[0].attn.c_proj.weight  # Conv1D (heads * head_dim in, hidden out); head 1 copies
    head_dim = projection.shape[0] // model.config.n_head
    for edit in (lambda rows: rows.zero_(), lambda rows: rows.mul_(1.5)):
        with torch.no_grad():
            original = projection[head_dim : 2 * head_dim].clone()
            edit(projection[head_dim : 2 * head_dim])
        assert weights_fingerprint(model) != before
        with torch.no_grad():
            projection[head_dim : 2 * head_dim] = original
        assert weights_fingerprint(model) == before


def test_a_weight_changed_in_place_changes_the_fingerprint(models):
    """The fingerprint is remembered per model until a parameter changes: in place (its version counter moves) or
    replaced by another tensor of other values."""
    import torch

    from headscope.model.identity import weights_fingerprint

    model = headscope.load_model(str(models["first"]), device="cpu").model
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    parameter = next(model.parameters())
    with torch.no_grad():
        parameter.view(-1)[0] += 1.0  # the first value is always sampled
    edited = weights_fingerprint(model)
    assert edited != before
    with torch.no_grad():
        parameter.view(-1)[0] -= 1.0
    assert weights_fingerprint(model) == before  # the same values again: the same fingerprint
    parameter.data = parameter.data + 3.0
    assert weights_fingerprint(model) not in (before, edited)
