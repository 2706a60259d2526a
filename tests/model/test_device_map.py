"""Models larger than one device: accelerate's device maps, disk offload included, measured like a plain run."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import headscope
from headscope.errors import ConfigError, ModelLoadError
from headscope.model.loading import load_config, load_for_run, load_model, resolve_source
from headscope.model.memory import free_memory
from headscope.model.placement import check_device_map

from helpers import QUICK, assert_one_line_error, refuse_to_load, run_cli, snapshot
from planted import build_planted_copier, copy_words

# The planted GPT-2: embeddings and layer 0 on the CPU, layer 1 kept on disk and loaded for each pass.
OFFLOADED = {"wte": "cpu", "wpe": "cpu", "h.0": "cpu", "h.1": "disk", "ln_f": "cpu"}
OPTIONS = {"charts": None, "page": False, "probe_seeds": 2, "bootstrap": 20}


def test_a_layer_offloaded_to_disk_measures_like_the_plain_run(planted_gpt2, corpus_lines, tmp_path):
    plain = headscope.analyze(str(planted_gpt2), corpus_lines, **OPTIONS)
    loaded = load_model(str(planted_gpt2), device_map=OFFLOADED, offload_folder=tmp_path / "offload")
    # Layer 1's weights stay on disk (read from the safetensors file for each pass): only placeholders in memory.
    assert {p.device.type for p in loaded.model.h[1].parameters()} == {"meta"}
    assert {p.device.type for p in loaded.model.h[0].parameters()} == {"cpu"}
    mapped = headscope.analyze(loaded, corpus_lines, out=tmp_path / "report", **OPTIONS)
    numbers = plain.heads.select_dtypes("number").columns
    np.testing.assert_array_equal(mapped.heads[numbers].to_numpy(float), plain.heads[numbers].to_numpy(float))
    pd.testing.assert_frame_equal(mapped.sentence_heads, plain.sentence_heads)
    run = json.loads((tmp_path / "report" / "run.json").read_text())
    assert run["model"]["device_map"] == OFFLOADED  # the map, as accelerate applied it
    assert plain.run["model"]["device_map"] is None


def test_a_device_map_from_a_json_file_on_the_command_line(planted_gpt2, tmp_path):
    (tmp_path / "map.json").write_text(json.dumps(OFFLOADED))
    out = tmp_path / "report"
    options = ["--no-charts", "--no-page", "--no-probes", "--bootstrap", "0"]
    result = run_cli("analyze", planted_gpt2, "--out", out, "--device-map", tmp_path / "map.json", *options)
    assert_one_line_error(result, "give --offload-folder DIR", code=2)
    result = run_cli(
        "analyze", planted_gpt2, "--out", out, "--device-map", tmp_path / "map.json",
        "--offload-folder", tmp_path / "offload", *options,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["model"]["device_map"]["h.1"] == "disk"
    result = run_cli("analyze", planted_gpt2, "--out", out, "--device-map", "everywhere", *options)
    assert_one_line_error(result, "--device-map must be one of auto, balanced", "got 'everywhere'", code=2)


def test_the_memory_check_counts_what_each_device_of_the_map_holds(planted_gpt2, monkeypatch):
    import torch

    config = load_config(resolve_source(str(planted_gpt2)))
    check_device_map(config, "m", torch.float32, OFFLOADED, "offload")  # fits: a few KiB on the CPU
    monkeypatch.setattr("headscope.model.memory.host_free_memory", lambda: 1024)  # a host with 1 KiB free
    with pytest.raises(ModelLoadError, match=r"the device map puts .* GiB of m's weights on cpu"):
        check_device_map(config, "m", torch.float32, OFFLOADED, "offload")
    check_device_map(config, "m", torch.float32, {"": "disk"}, "offload")  # all on disk: nothing to hold
    with pytest.raises(ModelLoadError, match="add --offload-folder DIR"):
        check_device_map(config, "m", torch.float32, "auto", None)  # a strategy: every device together
    check_device_map(config, "m", torch.float32, "auto", "offload")  # ... with the disk as the last resort
    with pytest.raises(ConfigError, match="give --offload-folder"):
        check_device_map(config, "m", torch.float32, {"": "disk"}, None)
    assert free_memory  # the real function stays importable for the loader


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("gpu7", "'gpu7': not a device"),
        (3, "GPU 3, but this machine has"),
        ("meta", "the meta device, which holds no weights"),
        (None, "None: not a device"),
        ([1], "[1]: not a device"),
        (0.5, "0.5: not a device"),
    ],
)
def test_a_device_map_value_that_is_no_device_is_refused(value, message, planted_gpt2, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"": value}))
    started = time.perf_counter()
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", "--device-map", path, *QUICK)
    assert_one_line_error(result, "--device-map sends 'the model' to", message, code=2)
    assert time.perf_counter() - started < 20 and not (tmp_path / "o").exists()


def test_a_device_map_naming_modules_the_model_lacks_is_refused(planted_gpt2, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"wte": "cpu", "transformer.h.0": "cpu", "h": "cpu"}))
    result = run_cli("analyze", planted_gpt2, "--out", tmp_path / "o", "--device-map", path, *QUICK)
    assert_one_line_error(
        result, "names modules", "does not have: 'transformer.h.0'", "top-level modules: drop, h", code=2
    )


def test_run_json_records_the_device_map_applied(planted_gpt2, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"": "cpu"}))
    out = tmp_path / "o"
    result = run_cli("analyze", planted_gpt2, "--out", out, "--device-map", path, *QUICK, "--no-charts")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "run.json").read_text())["model"]["device_map"] == {"": "cpu"}


@pytest.mark.parametrize("where", ["out", "inside out", "corpus folder", "model folder"])
def test_the_offload_folder_may_not_be_an_input_or_the_output(where, planted_gpt2, tmp_path, corpus_lines):
    data = tmp_path / "data"
    data.mkdir()
    corpus = data / "corpus.txt"
    corpus.write_text("\n".join(corpus_lines[:5]) + "\n")
    out = tmp_path / "report"
    offload = {"out": out, "inside out": out / "x", "corpus folder": data, "model folder": planted_gpt2}[where]
    before = snapshot(planted_gpt2)
    result = run_cli(
        "analyze", planted_gpt2, "--corpus", corpus, "--out", out, "--device-map", "auto",
        "--offload-folder", offload, *QUICK, loader=refuse_to_load,
    )  # fmt: skip
    assert_one_line_error(result, "--offload-folder", "choose a folder of its own", code=2)
    assert snapshot(planted_gpt2) == before


@pytest.mark.slow  # converts a checkpoint for accelerate
def test_what_loading_offloads_is_removed_when_the_run_ends(planted_gpt2, tmp_path):
    """A checkpoint accelerate must convert (GGUF, .bin) leaves copies of the offloaded weights in the offload
    folder: they go when the run ends; what was there before stays."""
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "mine.txt").write_text("mine")

    def loader(source, settings, model_config, lm_head):  # writes what accelerate writes for a converted checkpoint
        Path(settings.offload_folder).mkdir(exist_ok=True)
        (Path(settings.offload_folder) / "h.1.attn.c_attn.weight.dat").write_bytes(b"\0" * 1024)
        (Path(settings.offload_folder) / "index.json").write_text("{}")
        return load_for_run(source, settings, model_config, lm_head)

    out = tmp_path / "o"
    options = ("--device-map", "auto", "--offload-folder", offload, *QUICK, "--no-charts")
    assert run_cli("analyze", planted_gpt2, "--out", out, *options, loader=loader).exit_code == 0
    assert sorted(p.name for p in offload.iterdir()) == ["mine.txt"]
    fresh = tmp_path / "fresh-offload"
    assert run_cli("analyze", planted_gpt2, "--out", tmp_path / "o2", *options[:2], "--offload-folder", fresh,
                   *QUICK, loader=loader).exit_code == 0  # fmt: skip
    assert not fresh.exists()  # made by loading: removed whole


# ---------------------------------------------------------------- every model command


# The same placement for the model with its LM head (ablate, prune, importance): transformers names the base model's
# modules under "transformer." there.
LM_OFFLOADED = {f"transformer.{name}": device for name, device in OFFLOADED.items()} | {"lm_head": "cpu"}


@pytest.mark.slow  # over 1.5 s on two cores
def test_interventions_with_a_layer_offloaded_to_disk_equal_the_plain_run(tmp_path):
    """ablate, importance, inspect and patch through accelerate's hooks (layer 1 read from disk for each pass, the
    removed heads' constants put where the layer runs) give the numbers of the plain run, on a model whose heads
    matter (the planted copier: heads 0.0 and 0.1 carry what the next token needs)."""
    folder = build_planted_copier(tmp_path / "model", copiers=(0, 1))
    words = copy_words()
    texts = [" ".join([words[i % 7]] * (3 + i % 6)) for i in range(12)]
    plain_model = load_model(str(folder), lm_head=True)
    mapped_model = load_model(str(folder), lm_head=True, device_map=LM_OFFLOADED, offload_folder=tmp_path / "off")
    assert {p.device.type for p in mapped_model.lm.transformer.h[1].parameters()} == {"meta"}
    groups = {"heads": [[(0, 0), (0, 1)], [(1, 2)]], "bootstrap": 20}
    for mode in ("zero", "mean"):
        plain = headscope.ablate(plain_model, texts, mode=mode, **groups).groups
        mapped = headscope.ablate(mapped_model, texts, mode=mode, **groups).groups
        pd.testing.assert_frame_equal(mapped, plain)
        assert plain["delta"][0] > 1.0  # the copiers matter: a pass that ignored the removal would differ
    # window mode: the layer's attention computed again under the window, where accelerate put the layer; on copiers
    # that read position 0 from every later query, so that a window of one key (and no sink) cuts them off, on texts
    # whose first word differs from the others
    reader = build_planted_copier(tmp_path / "reader", copiers=(0, 1), reads_from=0)
    mixed = [" ".join(words[(i + j) % 7] for j in range(3 + i % 6)) for i in range(12)]
    windowed = {"mode": "window", "window": 1, "sink": 0, **groups}
    plain = headscope.ablate(load_model(str(reader), lm_head=True), mixed, **windowed).groups
    mapped_reader = load_model(str(reader), lm_head=True, device_map=LM_OFFLOADED, offload_folder=tmp_path / "off2")
    pd.testing.assert_frame_equal(headscope.ablate(mapped_reader, mixed, **windowed).groups, plain)
    assert abs(plain["delta"][0]) > 0.1, plain  # the copiers no longer see what they copy
    options = {"importance": "exact", "charts": None, "page": False, "probes": False, "bootstrap": 0}
    plain = headscope.analyze(plain_model, texts, **options).heads
    mapped = headscope.analyze(mapped_model, texts, **options).heads
    importance = ["ablation_zero", "ablation_mean", "attribution_zero", "attribution_mean"]
    np.testing.assert_array_equal(mapped[importance].to_numpy(float), plain[importance].to_numpy(float))
    plain = headscope.inspect(plain_model, texts=texts[:2], heads=[(1, 0), (0, 1)]).attention
    mapped = headscope.inspect(mapped_model, texts=texts[:2], heads=[(1, 0), (0, 1)]).attention
    pd.testing.assert_frame_equal(mapped, plain)
    # patch: the clean run's head outputs recorded and put back in the corrupt run, per head and per position
    pairs = [{"clean": f"{a} {a} {a}", "corrupt": f"{b} {b} {b}", "answer": a, "distractor": b}
             for a, b in itertools.pairwise(words[:7])]  # fmt: skip
    for positions in ("all", "each"):
        plain = headscope.patch(plain_model, pairs, positions=positions, bootstrap=0, charts=None)
        mapped = headscope.patch(mapped_model, pairs, positions=positions, bootstrap=0, charts=None)
        pd.testing.assert_frame_equal(mapped.effects, plain.effects)
        pd.testing.assert_frame_equal(mapped.per_pair, plain.per_pair)


@pytest.mark.parametrize("command", ["inspect", "ablate", "prune", "patch"])
def test_every_model_command_takes_a_device_map_and_checks_its_offload_folder(command, planted_gpt2, tmp_path):
    """The options exist on every model command, reach the loader, and the offload folder's rule holds there too
    (it may not be --out): refused before the model loads."""
    out = tmp_path / "out"
    pairs = tmp_path / "pairs.jsonl"
    from transformers import AutoTokenizer

    a, b, c = sorted(w for w in AutoTokenizer.from_pretrained(planted_gpt2).get_vocab() if w.isalpha())[:3]
    pairs.write_text(json.dumps({"clean": f"{a} {b}", "corrupt": f"{a} {c}", "answer": b, "distractor": c}) + "\n")
    arguments = {
        "inspect": ["--text", "the cat sat", "--heads", "0.0"],
        "ablate": ["--heads", "0.0", "--bootstrap", "0"],
        "prune": ["--budget", "0.1"],
        "patch": ["--pairs", pairs],
    }[command]
    result = run_cli(command, planted_gpt2, *arguments, "--out", out, "--device-map", "auto",
                     "--offload-folder", out, loader=refuse_to_load)  # fmt: skip
    assert_one_line_error(result, "--offload-folder", "is --out or inside it", code=2)
    seen = {}

    def loader(source, settings, model_config, lm_head):
        seen.update(device_map=settings.device_map, offload_folder=settings.offload_folder)
        raise AssertionError("stop here")

    (tmp_path / "map.json").write_text(json.dumps({"": "cpu"}))
    run_cli(command, planted_gpt2, *arguments, "--out", out, "--device-map", tmp_path / "map.json",
            "--offload-folder", tmp_path / "offload", loader=loader)  # fmt: skip
    assert seen == {"device_map": str(tmp_path / "map.json"), "offload_folder": str(tmp_path / "offload")}
