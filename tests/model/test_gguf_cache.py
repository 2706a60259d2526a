"""A GGUF file's de-quantized checkpoint, cached (model/gguf_cache.py): a load from the cache is the load of the file,
bit for bit, and the cache is written, skipped, refreshed and repaired as docs/input.md says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import headscope
from headscope.model.gguf_cache import LIMIT_VARIABLE, NOTE
from headscope.model.identity import weights_fingerprint

from helpers import assert_one_line_error, run_cli
from tiny_gguf import write_tiny_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("HEADSCOPE_CACHE", str(folder))
    monkeypatch.delenv(LIMIT_VARIABLE, raising=False)
    return folder


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "models" / "tiny.gguf")


def cached_folders(cache):
    return sorted(path.name for path in (cache / "gguf").glob("*")) if (cache / "gguf").exists() else []


def direct_load(path, monkeypatch, **options):
    """The file read by transformers itself, as before the cache."""
    with monkeypatch.context() as patched:
        patched.setenv(LIMIT_VARIABLE, "0")
        return headscope.load_model(str(path), device="cpu", **options)


def assert_same_load(cached, direct, sentences):
    cached_weights, direct_weights = cached.lm.state_dict(), direct.lm.state_dict()
    assert cached_weights.keys() == direct_weights.keys()
    for name, tensor in direct_weights.items():
        assert cached_weights[name].dtype == tensor.dtype and torch.equal(cached_weights[name], tensor), name
    assert weights_fingerprint(cached.model) == weights_fingerprint(direct.model)
    assert cached.architecture == direct.architecture and cached.source == direct.source
    settings = ("quantization_config", "dtype", "architectures", "transformers_version", "_name_or_path")
    config = {key: value for key, value in cached.model.config.to_dict().items() if key not in settings}
    assert config == {key: value for key, value in direct.model.config.to_dict().items() if key not in settings}
    for sentence in sentences:
        assert cached.tokenizer(sentence)["input_ids"] == direct.tokenizer(sentence)["input_ids"], sentence
    assert cached.tokenizer.special_tokens_map == direct.tokenizer.special_tokens_map
    assert cached.tokenizer.chat_template == direct.tokenizer.chat_template


def refuse_to_parse(monkeypatch):
    """gguf's reader raises: a load that succeeds did not read the GGUF file."""
    import gguf

    def refused(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed")

    monkeypatch.setattr(gguf, "GGUFReader", refused)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_load_from_the_cache_is_the_load_of_the_file(tiny, cache, monkeypatch, corpus_lines, dtype):
    first = headscope.load_model(str(tiny), device="cpu", dtype=dtype, lm_head=True)  # writes the cache
    assert len(cached_folders(cache)) == 1
    refuse_to_parse(monkeypatch)
    cached = headscope.load_model(str(tiny), device="cpu", dtype=dtype, lm_head=True)
    monkeypatch.undo()
    direct = direct_load(tiny, monkeypatch, dtype=dtype, lm_head=True)
    assert_same_load(first, direct, [*corpus_lines[:20], "the then than", ""])
    assert_same_load(cached, direct, corpus_lines[:20])


def test_the_cache_holds_files_up_to_the_limit(tiny, cache, monkeypatch):
    size_mb = tiny.stat().st_size / 2**20
    for limit in ("0", f"{size_mb * 0.9:.6f}"):
        monkeypatch.setenv(LIMIT_VARIABLE, limit)
        headscope.load_model(str(tiny), device="cpu")
        assert cached_folders(cache) == [], limit
    monkeypatch.setenv(LIMIT_VARIABLE, f"{size_mb * 1.1:.6f}")
    headscope.load_model(str(tiny), device="cpu")
    assert len(cached_folders(cache)) == 1


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_limit_that_is_not_a_size_is_one_line(tiny, cache, monkeypatch, tmp_path, value):
    monkeypatch.setenv(LIMIT_VARIABLE, value)
    assert_one_line_error(run_cli("analyze", tiny, "--out", tmp_path / "o"), LIMIT_VARIABLE, repr(value))


def test_an_edited_file_is_read_again_and_its_old_folder_removed(tiny, cache, monkeypatch):
    before = headscope.load_model(str(tiny), device="cpu")
    old = cached_folders(cache)
    write_tiny_gguf(tiny, seed=1)
    os.utime(tiny, ns=(tiny.stat().st_atime_ns, tiny.stat().st_mtime_ns + 10**9))  # a later time on any clock
    after = headscope.load_model(str(tiny), device="cpu")
    assert weights_fingerprint(after.model) != weights_fingerprint(before.model)
    assert weights_fingerprint(after.model) == weights_fingerprint(direct_load(tiny, monkeypatch).model)
    assert len(cached_folders(cache)) == 1 and cached_folders(cache) != old


def test_a_damaged_cache_is_written_again(tiny, cache, monkeypatch):
    headscope.load_model(str(tiny), device="cpu")
    (folder,) = (cache / "gguf").iterdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    repaired = headscope.load_model(str(tiny), device="cpu")
    assert weights_fingerprint(repaired.model) == weights_fingerprint(direct_load(tiny, monkeypatch).model)
    note = json.loads((folder / NOTE).read_text())
    assert weights.stat().st_size == note["files"]["model.safetensors"] > 1000


def test_a_cache_that_cannot_be_written_costs_only_time(tiny, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("HEADSCOPE_CACHE", str(blocked))
    loaded = headscope.load_model(str(tiny), device="cpu")
    assert weights_fingerprint(loaded.model) == weights_fingerprint(direct_load(tiny, monkeypatch).model)
    assert blocked.read_text() == "not a folder"


def test_a_file_that_cannot_be_parsed_is_one_line(tmp_path, cache):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:4096])
    assert_one_line_error(run_cli("analyze", cut, "--out", tmp_path / "o"), f"cannot load a model from {cut}")
    assert cached_folders(cache) == []


@pytest.mark.slow
def test_concurrent_first_loads_write_one_folder(tiny, cache):
    """Two processes load the uncached file at once: each writes its own folder and renames it into place; both
    load the same weights and one folder is left."""
    script = f"import headscope; print(headscope.load_model({str(tiny)!r}).model.embed_tokens.weight.sum().item())"
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert outputs[0] == outputs[1]
    assert len(cached_folders(cache)) == 1
    assert not [path.name for path in (cache / "gguf").iterdir() if path.name.startswith(".")]


@pytest.mark.slow
def test_smollm2_from_the_cache_is_smollm2_from_its_file(smollm2, monkeypatch, corpus_lines):
    """The session's SmolLM2 comes from the cache; transformers' own load of its Q4_1 file gives the same float32
    weights bit for bit, the same config and the same tokens."""
    direct = direct_load("smollm2", monkeypatch, dtype="float32", lm_head=True)
    assert_same_load(smollm2, direct, corpus_lines)


def test_a_disk_without_room_to_spare_is_left_alone_until_it_has_some(tiny, cache, monkeypatch):
    """The checkpoint is written only where the disk keeps its size and 1 GiB free after it: a cache that filled
    the disk would fail the run's own outputs. Nothing is noted, so a later load with room writes it."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    with monkeypatch.context() as full:
        full.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 2**30, 2**30))  # 1 GiB free
        loaded = headscope.load_model(str(tiny), device="cpu")
        assert cached_folders(cache) == []
    assert weights_fingerprint(loaded.model) == weights_fingerprint(direct_load(tiny, monkeypatch).model)
    headscope.load_model(str(tiny), device="cpu")
    assert len(cached_folders(cache)) == 1


def test_a_model_too_large_for_the_hosts_memory_in_float32_is_not_written(tiny, cache, monkeypatch):
    """The checkpoint is written from the float32 model: where that would take more than half of the host's free
    memory, nothing is written and the load goes on as before (its own check decides)."""
    with monkeypatch.context() as small:
        small.setattr("headscope.model.memory.host_free_memory", lambda: 80_000)  # the tiny model: 52 KB in float32
        loaded = headscope.load_model(str(tiny), device="cpu")
        assert cached_folders(cache) == []
    assert weights_fingerprint(loaded.model) == weights_fingerprint(direct_load(tiny, monkeypatch).model)
    headscope.load_model(str(tiny), device="cpu")
    assert len(cached_folders(cache)) == 1
