"""The one description of a model's layers (model/layers.py), on every architecture the suite builds: each piece is
the module the architecture's own code uses for it, found from the data flow (never from the names checked here),
with the residual multiplier and the parallel block told apart, found once per capture; and circuit refusing, from it,
what its graph cannot read."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as t

from headscope.model.capture import attached

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 128, "vocab_size": 96}  # fmt: skip
GQA = {"num_key_value_heads": 2}
CPU = torch.device("cpu")

# name -> (model, what each layer's pieces are, as module names under the layer; the final norm's full name)
LLAMA_LIKE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "fused": None,
              "output": "self_attn.o_proj", "mlp": "mlp", "attention": "self_attn"}  # fmt: skip
ARCHITECTURES = {
    "gpt2": (
        lambda: t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=96)),
        {
            "q": None,
            "k": None,
            "v": None,
            "fused": "attn.c_attn",
            "output": "attn.c_proj",
            "mlp": "mlp",
            "attention": "attn",
            "input_norm": "ln_1",
            "mlp_norm": "ln_2",
            "post_attention": None,
            "post_mlp": None,
            "scale": 1.0,
            "seen": True,
            "unplaced": None,
        },
        "transformer.ln_f",
    ),
    "llama": (
        lambda: t.LlamaForCausalLM(t.LlamaConfig(**SHAPE, **GQA)),
        {
            **LLAMA_LIKE,
            "input_norm": "input_layernorm",
            "mlp_norm": "post_attention_layernorm",
            "post_attention": None,
            "post_mlp": None,
            "scale": 1.0,
            "seen": True,
            "unplaced": None,
        },
        "model.norm",
    ),
    "granite": (  # a residual multiplier: h = r + 0.22 * o
        lambda: t.GraniteForCausalLM(t.GraniteConfig(**SHAPE, **GQA, residual_multiplier=0.22)),
        {
            **LLAMA_LIKE,
            "input_norm": "input_layernorm",
            "mlp_norm": "post_attention_layernorm",
            "post_attention": None,
            "post_mlp": None,
            "scale": 0.22,
            "seen": True,
            "unplaced": None,
        },
        "model.norm",
    ),
    "gemma2": (  # post-norms, and Gemma 2's `post_attention_layernorm` really is one
        lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**SHAPE, **GQA, head_dim=16, sliding_window=64)),
        {
            **LLAMA_LIKE,
            "input_norm": "input_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "post_attention": "post_attention_layernorm",
            "post_mlp": "post_feedforward_layernorm",
            "scale": 1.0,
            "seen": True,
            "unplaced": None,
        },
        "model.norm",
    ),
    "gemma3": (
        lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**SHAPE, **GQA, head_dim=16, sliding_window=64)),
        {
            **LLAMA_LIKE,
            "input_norm": "input_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "post_attention": "post_attention_layernorm",
            "post_mlp": "post_feedforward_layernorm",
            "scale": 1.0,
            "seen": True,
            "unplaced": None,
        },
        "model.norm",
    ),
    "olmo2": (  # no input norms: q, k, v read the stream itself; post-norms only
        lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**SHAPE, **GQA)),
        {
            **LLAMA_LIKE,
            "input_norm": None,
            "mlp_norm": None,
            "post_attention": "post_attention_layernorm",
            "post_mlp": "post_feedforward_layernorm",
            "scale": 1.0,
            "seen": True,
            "unplaced": None,
        },
        "model.norm",
    ),
    "neox-parallel": (  # attention beside the MLP: no module reads r + o, and a fused q|k|v circuit cannot read
        lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**SHAPE, use_parallel_residual=True)),
        {
            "q": None,
            "k": None,
            "v": None,
            "fused": None,
            "output": "attention.dense",
            "mlp": "mlp",
            "attention": "attention",
            "post_attention": None,
            "post_mlp": None,
            "scale": 1.0,
            "seen": False,
            "unplaced": "GPTNeoXAttention: headscope reads q_proj, k_proj and v_proj",
        },
        "gpt_neox.final_layer_norm",
    ),
}


def described(model):
    """{piece: its module's name under the layer, or its value} per layer, and the final norm's name."""
    names = {id(module): name for name, module in model.named_modules()}
    with attached(model) as capture:
        found = capture.layer_map(CPU)
        assert capture.layer_map(CPU) is found  # found once: a second question is answered from it
        decoder = capture.decoder
    layers = []
    for index, place in enumerate(found.layers):
        prefix = names[id(decoder[index])] + "."
        layers.append({key: (names[id(value)].removeprefix(prefix) if isinstance(value, torch.nn.Module) else value)
                       for key, value in vars(place).items()})  # fmt: skip
    return layers, names.get(id(found.final_norm))


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_each_architecture_has_one_description_found_from_its_data_flow(architecture):
    build, expected, final = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = build().eval()
    layers, final_norm = described(model)
    assert final_norm == final
    for index, layer in enumerate(layers):
        unplaced = layer.pop("unplaced")
        wanted = {key: value for key, value in expected.items() if key != "scale"}
        assert (unplaced is None) == (wanted.pop("unplaced") is None) and (
            unplaced is None or unplaced.startswith(expected["unplaced"])
        ), unplaced
        assert {key: layer[key] for key in wanted} == wanted
        if expected["scale"] == 1.0:
            assert layer["scale"] == 1.0  # the plain add, snapped to exactly 1
        else:
            assert abs(layer["scale"] - expected["scale"]) <= scale_bound(model, index, expected["scale"])


def scale_bound(model, index: int, scale: float) -> float:
    """How far the fitted scale may be from `scale`: the layer adds u = fl(x + fl(scale * w)) in float32, so u - x is
    scale * w within 2 UNIT relative (the multiplier's and the product's rounding) plus the sum's rounding, UNIT |u|
    per feature, which the least-squares fit <u - x, w> / <w, w> turns into at most UNIT ||u|| / ||w||. The
    magnitudes are read from the model's own pass on the description's ids."""
    from headscope.model.layers import dry_ids

    from tolerances import UNIT

    layer, seen = model.get_decoder().layers[index], {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0] if args else
                                             kwargs["hidden_states"]), with_kwargs=True),
             layer.self_attn.register_forward_hook(lambda m, args, output: seen.update(w=output[0]))]  # fmt: skip
    with torch.no_grad():
        model(dry_ids(model.get_input_embeddings().num_embeddings)[None])
    for hook in hooks:
        hook.remove()
    x, w = seen["x"].double(), seen["w"].double()
    return 2 * UNIT * scale + UNIT * float((x + scale * w).norm() / w.norm())


def test_a_partial_description_stops_early_and_a_whole_one_is_found_again():
    """--layers 0 needs layer 0 alone (later layers are not even run, as analyze promises); a question about every
    layer then runs the pass again, to the model's output and its final norm."""
    torch.manual_seed(0)
    model = t.LlamaForCausalLM(t.LlamaConfig(**{**SHAPE, "num_hidden_layers": 3}, **GQA)).eval()
    ran = []
    hook = model.model.layers[2].register_forward_pre_hook(lambda module, args: ran.append(2))
    with attached(model) as capture:
        first = capture.layer_map(CPU, through=1)
        assert len(first.layers) == 1 and first.final_norm is None and not ran
        assert capture.layer_map(CPU, through=1) is first
        whole = capture.layer_map(CPU)
    hook.remove()
    assert len(whole.layers) == 3 and whole.final_norm is model.model.norm and ran == [2]
    assert whole.layers[0].input_norm is first.layers[0].input_norm is model.model.layers[0].input_layernorm


@pytest.mark.parametrize(
    ("architecture", "refusal"),
    [("granite", "layer 0 adds its attention x 0.22 (a residual multiplier)"), ("gptj", "layer 0 adds its attention in "
     "parallel with the MLP"), ("llama", None)],
)  # fmt: skip
def test_circuit_refuses_what_its_graph_cannot_read_from_the_description_in_one_line(architecture, refusal):
    """Before any pass: the description says how each layer adds its attention, and circuit's graph reads h = r + o."""
    from headscope.errors import ConfigError
    from headscope.interventions.edge_layers import circuit_places

    torch.manual_seed(0)
    if architecture == "gptj":
        model = t.GPTJForCausalLM(t.GPTJConfig(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=96,
                                               rotary_dim=8))  # fmt: skip
    else:
        model = ARCHITECTURES[architecture][0]()
    with attached(model.eval()) as capture:
        if refusal is None:
            places, final = circuit_places(capture, CPU, plain_residual=True)
            assert len(places) == 2 and final is model.model.norm
        else:
            with pytest.raises(ConfigError, match=re.escape(refusal)):
                circuit_places(capture, CPU, plain_residual=True)
            assert len(circuit_places(capture, CPU)[0]) == 2  # the OV circuits read such a model all the same
