"""Each layer's attention kind (full, or sliding and its window) as the config declares it, in layers.parquet and
run.json; reports written before these columns existed still open."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest
from transformers import Gemma2Config, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

import headscope
from headscope.model.architecture import layer_attention

from helpers import QUICK, run_cli, tiny_model_folder


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (Gemma2Config(num_hidden_layers=3, sliding_window=64), [("sliding", 64), ("full", None), ("sliding", 64)]),
        (MistralConfig(num_hidden_layers=2, sliding_window=32), [("sliding", 32)] * 2),
        (MistralConfig(num_hidden_layers=2, sliding_window=None), [("full", None)] * 2),
        (
            Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1),
            [("full", None), ("sliding", 16), ("sliding", 16)],
        ),
        (Qwen2Config(num_hidden_layers=2, sliding_window=16), [("full", None)] * 2),  # use_sliding_window off
        (LlamaConfig(num_hidden_layers=2), [("full", None)] * 2),
        (GPT2Config(n_layer=2), [("full", None)] * 2),
    ],
)
def test_each_layers_attention_as_its_config_declares_it(config, expected):
    assert list(layer_attention(config)) == expected


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, corpus_lines):
    """A tiny Gemma2: layer 0 slides over 4 keys, layer 1 sees everything."""
    from transformers import Gemma2ForCausalLM

    config = Gemma2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, sliding_window=4, max_position_embeddings=128,
    )  # fmt: skip
    return tiny_model_folder(tmp_path_factory.mktemp("gemma2"), config, Gemma2ForCausalLM, corpus_lines)


def test_the_layers_table_and_run_json_say_which_layers_slide(gemma2, corpus_lines, tmp_path):
    """And the sliding layer does slide: no row of it puts mass on a key more than 3 positions back, which the
    first token of a long sentence is (its sink is 0 there, and not in the full layer)."""
    long = [line for line in corpus_lines if len(line.split()) > 10][:8]
    report = headscope.analyze(str(gemma2), long, out=tmp_path / "report", probes=False, bootstrap=0, charts=None)
    layers = pd.read_parquet(tmp_path / "report" / "layers.parquet")
    assert list(layers["attention"]) == ["sliding", "full"]
    assert layers["window"].iloc[0] == 4 and pd.isna(layers["window"].iloc[1])
    recorded = json.loads((tmp_path / "report" / "run.json").read_text())["model"]["layer_attention"]
    assert recorded == [{"layer": 0, "attention": "sliding", "window": 4}, {"layer": 1, "attention": "full",
                                                                            "window": None}]  # fmt: skip
    sink = report.heads.groupby("layer")["sink"].mean()
    assert sink[1] > 0.01 and sink[0] < sink[1]


@pytest.mark.slow  # over 1.5 s on two cores
def test_a_report_from_before_the_columns_still_opens(gemma2, corpus_lines, tmp_path):
    out = tmp_path / "report"
    assert run_cli("analyze", gemma2, "--out", out, *QUICK, "--no-charts").exit_code == 0
    path = out / "layers.parquet"
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["attention", "window"]), path)
    layers = headscope.Report.open(out).layers
    assert layers["attention"].isna().all() and layers["window"].isna().all()
    result = run_cli("plot", out)  # the page and the charts take the empty columns
    assert result.exit_code == 0, result.output
    assert (out / "report.html").stat().st_size > 10_000
