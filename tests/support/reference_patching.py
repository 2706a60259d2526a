"""An independent activation-patching reference: one pair at a time, float32, plain transformers, no headscope.

- `output`: a forward pre-hook on the layer's output projection records the source prompt's input to it and
  puts the head's slice (at every position, or one) into the target prompt's.
- `pattern` / `values`: a plain eager attention function of our own (softmax(q k^T * scaling) under a causal mask,
  times the values), registered with transformers, records the source prompt's probabilities and values and puts
  one head's (a query row of probabilities, or a key's value vector) into the target prompt's computation.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

NAME = "patching_reference"
_STATE: dict = {}


def _plain_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    layer = _STATE["layers"][module]
    heads, t = query.shape[1], query.shape[2]
    groups = heads // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    if _STATE["mode"] == "record":
        _STATE["weights"][layer], _STATE["values"][layer] = weights.clone(), value.clone()
    elif _STATE["mode"] == "patch" and layer == _STATE["layer"]:
        head, position = _STATE["head"], _STATE["position"]
        weights, value = weights.clone(), value.clone()
        if _STATE["what"] == "pattern":
            rows = slice(None) if position is None else slice(position, position + 1)
            weights[:, head, rows] = _STATE["weights"][layer][:, head, rows]
        else:
            keys = slice(None) if position is None else slice(position, position + 1)
            value[:, head, keys] = _STATE["values"][layer][:, head, keys]
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


AttentionInterface.register(NAME, _plain_attention)


def _projection(model, layer: int):
    block = model.base_model.layers[layer] if hasattr(model.base_model, "layers") else model.base_model.h[layer]
    attention = block.self_attn if hasattr(block, "self_attn") else block.attn
    return attention.o_proj if hasattr(attention, "o_proj") else attention.c_proj


class Reference:
    def __init__(self, folder=None, *, model=None, tokenizer=None) -> None:
        """A model folder (loaded here, float32), or an already loaded causal LM and its tokenizer."""
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(folder)
        self.model = model if model is not None else AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        self.model.eval()
        config = self.model.config
        self.heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.depth = config.num_hidden_layers

    def metric(self, ids: list[int], answer: int, distractor: int) -> float:
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, -1].double()
        return float(logits[answer] - logits[distractor])

    def _ids(self, pair: dict) -> tuple[list[int], list[int], int, int]:
        tok = self.tokenizer
        clean, corrupt = tok(pair["clean"])["input_ids"], tok(pair["corrupt"])["input_ids"]
        answer = tok(pair["answer"], add_special_tokens=False)["input_ids"]
        distractor = tok(pair["distractor"], add_special_tokens=False)["input_ids"]
        return clean, corrupt, answer[0], distractor[0]

    def patched(self, pair: dict, what: str, direction: str, layer: int, head: int, position: int | None) -> float:
        """The metric of one pair with one head's `what` patched from the other prompt."""
        clean, corrupt, answer, distractor = self._ids(pair)
        source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
        if what == "output":
            return self._patched_output(source, target, answer, distractor, layer, head, position)
        if what in ("q", "k"):
            return self._patched_input(source, target, answer, distractor, what, layer, head, position)
        return self._patched_attention(source, target, answer, distractor, what, layer, head, position)

    def baseline(self, pair: dict) -> tuple[float, float]:
        clean, corrupt, answer, distractor = self._ids(pair)
        return self.metric(clean, answer, distractor), self.metric(corrupt, answer, distractor)

    def _patched_output(self, source, target, answer, distractor, layer, head, position) -> float:
        projection, kept = _projection(self.model, layer), {}
        columns = slice(head * self.head_dim, (head + 1) * self.head_dim)

        def record(module, args):
            kept["input"] = args[0].clone()

        def put(module, args):
            patched = args[0].clone()
            rows = slice(None) if position is None else slice(position, position + 1)
            patched[:, rows, columns] = kept["input"][:, rows, columns]
            return (patched, *args[1:])

        hook = projection.register_forward_pre_hook(record)
        with torch.no_grad():
            self.model(torch.tensor([source]))
        hook.remove()
        hook = projection.register_forward_pre_hook(put)
        try:
            return self.metric(target, answer, distractor)
        finally:
            hook.remove()

    def _patched_input(self, source, target, answer, distractor, channel, layer, head, position) -> float:
        """The head's query (q), or its KV head's key (k), as the q or k projection outputs it, from the source: by
        name (Llama's q_proj / k_proj, GPT-2's c_attn: q | k | v)."""
        block = self.model.base_model.layers[layer] if hasattr(self.model.base_model, "layers") else \
            self.model.base_model.h[layer]  # fmt: skip
        config = self.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        unit = head if channel == "q" else head // (self.heads // kv_heads)
        if hasattr(block, "self_attn"):
            module, offset = getattr(block.self_attn, f"{channel}_proj"), 0
        else:
            module, offset = block.attn.c_attn, 0 if channel == "q" else self.heads * self.head_dim
        columns = slice(offset + unit * self.head_dim, offset + (unit + 1) * self.head_dim)
        kept = {}
        hook = module.register_forward_hook(lambda m, a, o: kept.update(out=o.clone()))
        with torch.no_grad():
            self.model(torch.tensor([source]))
        hook.remove()

        def put(module, args, output):
            output = output.clone()
            rows = slice(None) if position is None else slice(position, position + 1)
            output[:, rows, columns] = kept["out"][:, rows, columns]
            return output

        hook = module.register_forward_hook(put)
        try:
            return self.metric(target, answer, distractor)
        finally:
            hook.remove()

    def _patched_attention(self, source, target, answer, distractor, what, layer, head, position) -> float:
        modules = {}
        for index in range(self.depth):
            block = (
                self.model.base_model.layers[index]
                if hasattr(self.model.base_model, "layers")
                else (self.model.base_model.h[index])
            )
            modules[block.self_attn if hasattr(block, "self_attn") else block.attn] = index
        previous = self.model.config._attn_implementation
        _STATE.update(layers=modules, weights={}, values={}, mode="record", what=what)
        self.model.set_attn_implementation(NAME)
        try:
            with torch.no_grad():
                self.model(torch.tensor([source]))
            _STATE.update(mode="patch", layer=layer, head=head, position=position)
            return self.metric(target, answer, distractor)
        finally:
            _STATE["mode"] = None
            self.model.set_attn_implementation(previous)

    def attributed(self, pair: dict, direction: str, layer: int, head: int) -> float:
        """The first-order estimate of patching one head's output at every position: m + (z' - z) . dm/dz, the
        gradient from torch autograd through a pre-hook on the output projection."""
        clean, corrupt, answer, distractor = self._ids(pair)
        source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
        projection, kept = _projection(self.model, layer), {}
        columns = slice(head * self.head_dim, (head + 1) * self.head_dim)

        def record(module, args):
            kept["input"] = args[0].detach().clone()

        def track(module, args):
            tracked = args[0].detach().clone().requires_grad_()
            kept["tracked"] = tracked
            return (tracked, *args[1:])

        hook = projection.register_forward_pre_hook(record)
        with torch.no_grad():
            self.model(torch.tensor([source]))
        hook.remove()
        source_input = kept["input"]
        hook = projection.register_forward_pre_hook(track)
        try:
            logits = self.model(torch.tensor([target])).logits[0, -1]
        finally:
            hook.remove()
        metric = logits[answer] - logits[distractor]
        metric.backward()
        tracked = kept["tracked"]
        change = (source_input - tracked.detach())[..., columns]
        return float(metric.detach()) + float((change * tracked.grad[..., columns]).sum())
