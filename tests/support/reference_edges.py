"""A plain computation of edge attribution and direct logit attribution (tests/measures/test_edges.py), one pair at a
time in float64, sharing nothing with headscope.interventions.edges: an edge's score is the derivative of the metric
when the sender's change (corrupt minus clean write) is added, scaled by a scalar e, into its receiver's channel alone
(the receiver's own norm and projection computed again on the changed stream, every other reader left as it was), at
e = 0: autograd on e, or a central finite difference. GPT-2 (ln_1, c_attn, ln_2, ln_f) and Llama (input_layernorm,
q_proj/k_proj/v_proj, post_attention_layernorm, norm) are spelled out by name."""

from __future__ import annotations

import copy
import math

import torch


class Reference:
    def __init__(self, lm) -> None:
        self.lm = copy.deepcopy(lm).double().eval()
        for parameter in self.lm.parameters():
            parameter.requires_grad_(False)
        self.gpt2 = hasattr(self.lm, "transformer")
        base = self.lm.transformer if self.gpt2 else self.lm.model
        self.layers = list(base.h if self.gpt2 else base.layers)
        self.final_norm = base.ln_f if self.gpt2 else base.norm
        config = self.lm.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = config.hidden_size // self.heads

    # ---------------------------------------------------------------- pieces, by name
    def _input_norm(self, layer):
        return layer.ln_1 if self.gpt2 else layer.input_layernorm

    def _mlp_norm(self, layer):
        return layer.ln_2 if self.gpt2 else layer.post_attention_layernorm

    def _projection(self, layer, channel):
        """(module, features of its output for `channel`'s first head, stride per head)."""
        attention = layer.attn if self.gpt2 else layer.self_attn
        width = self.heads * self.head_dim
        if self.gpt2:
            return attention.c_attn, {"q": 0, "k": width, "v": 2 * width}[channel]
        return getattr(attention, f"{channel}_proj"), 0

    def _output(self, layer):
        attention = layer.attn if self.gpt2 else layer.self_attn
        return attention.c_proj if self.gpt2 else attention.o_proj

    # ---------------------------------------------------------------- writes
    def writes(self, ids: list[int], embeds=None) -> dict[str, torch.Tensor]:
        """Each sender's write (t, hidden) on a clean pass of `ids`, by name."""
        found, handles = {}, []
        for index, layer in enumerate(self.layers):
            if index == 0:

                def embedded(module, args, kwargs):
                    found["embed"] = (args[0] if args else kwargs["hidden_states"])[0]

                handles.append(layer.register_forward_pre_hook(embedded, with_kwargs=True))
            projection = self._output(layer)
            weight = projection.weight.T if self.gpt2 else projection.weight  # (hidden, heads * head_dim)

            def heads_of(module, args, index=index, weight=weight):
                z = args[0][0].view(-1, self.heads, self.head_dim)
                for head in range(self.heads):
                    columns = weight[:, head * self.head_dim : (head + 1) * self.head_dim]
                    found[f"{index}.{head}"] = z[:, head] @ columns.T

            handles.append(projection.register_forward_pre_hook(heads_of))
            handles.append(
                layer.mlp.register_forward_hook(lambda m, a, o, index=index: found.update({f"mlp{index}": o[0]}))
            )
        try:
            self._forward(ids, embeds)
        finally:
            for handle in handles:
                handle.remove()
        return found

    def _forward(self, ids, embeds=None):
        handles = []
        if embeds is not None:
            handles.append(self.lm.get_input_embeddings().register_forward_hook(lambda m, a, o: embeds[None]))
        try:
            return self.lm(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        finally:
            for handle in handles:
                handle.remove()

    # ---------------------------------------------------------------- the metric with one channel changed
    def metric(self, pair, receiver: str, channel: str, change: torch.Tensor, scale, embeds=None):
        """m on the clean prompt with scale * change added into `receiver`'s `channel` input alone."""
        handles, kept = [], {}
        if receiver == "logits":
            handles.append(self.final_norm.register_forward_pre_hook(lambda m, a: (a[0] + scale * change[None],)))
        elif receiver.startswith("mlp"):
            layer = self.layers[int(receiver[3:])]
            norm = self._mlp_norm(layer)
            handles.append(norm.register_forward_pre_hook(lambda m, a: kept.update(h=a[0])))
            handles.append(layer.mlp.register_forward_pre_hook(lambda m, a: (norm(kept["h"] + scale * change[None]),)))
        else:
            index, _, unit = receiver.partition(".")
            layer = self.layers[int(index)]
            head = int(unit[2:]) if unit.startswith("kv") else int(unit)
            projection, offset = self._projection(layer, channel)
            features = slice(offset + head * self.head_dim, offset + (head + 1) * self.head_dim)
            norm = self._input_norm(layer)
            handles.append(layer.register_forward_pre_hook(
                lambda m, a, k: kept.update(r=a[0] if a else k["hidden_states"]), with_kwargs=True))  # fmt: skip

            def changed(module, args, output):
                x = norm(kept["r"] + scale * change[None])
                # the projection by hand: calling the module would run this hook again
                if self.gpt2:  # Conv1D: weight (in, out)
                    again = x @ module.weight + module.bias
                else:
                    again = torch.nn.functional.linear(x, module.weight, module.bias)
                output = output.clone()
                output[..., features] = again[..., features]
                return output

            handles.append(projection.register_forward_hook(changed))
        try:
            logits = self._forward(pair.clean_ids, embeds)
        finally:
            for handle in handles:
                handle.remove()
        return logits[pair.answer_id] - logits[pair.distractor_id]

    def edge(self, pair, sender: str, receiver: str, channel: str, *, steps: int | None = None, step=None) -> float:
        """The edge's score: dm/de at e = 0 (EAP), averaged over the interpolated inputs (EAP-IG, `steps`), or its
        central finite difference with `step`."""
        change = (self.writes(pair.corrupt_ids)[sender] - self.writes(pair.clean_ids)[sender]).detach()
        points = [None]
        if steps is not None:
            embedding = self.lm.get_input_embeddings()
            clean = embedding(torch.tensor(pair.clean_ids)).detach()
            corrupt = embedding(torch.tensor(pair.corrupt_ids)).detach()
            points = [torch.lerp(corrupt, clean, k / steps) for k in range(1, steps + 1)]
        total = 0.0
        for embeds in points:
            if step is not None:
                up = self.metric(pair, receiver, channel, change, step, embeds)
                down = self.metric(pair, receiver, channel, change, -step, embeds)
                total += float((up - down) / (2 * step))
                continue
            scale = torch.zeros((), dtype=torch.float64, requires_grad=True)
            with torch.enable_grad():
                m = self.metric(pair, receiver, channel, change, scale, embeds)
                (grad,) = torch.autograd.grad(m, scale)
            total += float(grad)
        return total / len(points)

    def dla(self, pair) -> dict[str, float]:
        """Each sender's write at the last position through the final norm, its scale frozen, on the logit
        difference's direction; `bias`: the rest of m (the biases)."""
        writes = self.writes(pair.clean_ids)
        kept = {}
        handle = self.final_norm.register_forward_pre_hook(lambda m, a: kept.update(x=a[0][0, -1]))
        try:
            logits = self._forward(pair.clean_ids)
        finally:
            handle.remove()
        x, norm = kept["x"], self.final_norm
        weight = self.lm.get_output_embeddings().weight
        direction = weight[pair.answer_id] - weight[pair.distractor_id]
        if self.gpt2:  # LayerNorm: g (x - mean) / sigma + b
            sigma = math.sqrt(float(((x - x.mean()) ** 2).mean()) + norm.eps)

            def frozen(w):
                return norm.weight * (w - w.mean()) / sigma
        else:  # RMS: g x / rms
            rms = math.sqrt(float((x**2).mean()) + norm.variance_epsilon)

            def frozen(w):
                return norm.weight * w / rms

        found = {name: float(frozen(write[-1]) @ direction) for name, write in writes.items()}
        found["bias"] = float(logits[pair.answer_id] - logits[pair.distractor_id]) - sum(found.values())
        return found
