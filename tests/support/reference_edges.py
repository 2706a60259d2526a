"""A plain computation of edge attribution and direct logit attribution (tests/measures/test_edges.py), one pair at a
time in float64, sharing nothing with headscope.interventions.edges: an edge's score is the derivative of the metric
when the sender's change (corrupt minus clean write) is added, scaled by a scalar e, into its receiver's channel alone
(the receiver's own norm and projection computed again on the changed stream, every other reader left as it was), at
e = 0: autograd on e, or a central finite difference. GPT-2 (ln_1, c_attn, ln_2, ln_f), Llama (input_layernorm,
q_proj/k_proj/v_proj, post_attention_layernorm before the MLP, norm) and Gemma 2 (input_layernorm, q/k/v_proj,
post_attention_layernorm after the attention, pre_ and post_feedforward_layernorm around the MLP, norm) are spelled out
by name.

Gemma 2's heads write through the post-attention norm P together. A head's change, scaled by e, enters its receiver
as P(o + e (W_h z_h corrupt - W_h z_h clean)) - P(o), o the clean output projection: its derivative at e = 0 is EAP's
product through P's Jacobian, and at e = 1 the exact edge patch."""

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
        self.gemma = type(self.lm).__name__.startswith("Gemma")
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
        if self.gemma:
            return layer.pre_feedforward_layernorm
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
        """Each sender's write (t, hidden) on a clean pass of `ids`, by name (Gemma 2's heads: W_h z_h, before the
        post-attention norm); `oL`: layer L's output projection."""
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
                projection.register_forward_hook(lambda m, a, o, index=index: found.update({f"o{index}": o[0]}))
            )
            writer = layer.post_feedforward_layernorm if self.gemma else layer.mlp
            handles.append(
                writer.register_forward_hook(lambda m, a, o, index=index: found.update({f"mlp{index}": o[0]}))
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
    def added(self, sender: str, clean: dict, corrupt: dict, position: int | None = None):
        """scale -> (t, hidden): what the sender's change, times scale, adds to the stream its receivers read (at
        `position` alone, if given)."""
        change = (corrupt[sender] - clean[sender]).detach()
        if position is not None:
            alone = torch.zeros_like(change)
            alone[position] = change[position]
            change = alone
        if not self.gemma or sender == "embed" or sender.startswith("mlp"):
            return lambda scale: scale * change
        layer = int(sender.partition(".")[0])
        norm, o = self.layers[layer].post_attention_layernorm, clean[f"o{layer}"].detach()
        return lambda scale: norm(o + scale * change) - norm(o)

    def metric(self, pair, receiver: str, channel: str, added, scale, embeds=None):
        """m on the clean prompt with added(scale) added into `receiver`'s `channel` input alone."""
        handles, kept = [], {}
        if receiver == "logits":
            handles.append(self.final_norm.register_forward_pre_hook(lambda m, a: (a[0] + added(scale)[None],)))
        elif receiver.startswith("mlp"):
            layer = self.layers[int(receiver[3:])]
            norm = self._mlp_norm(layer)
            handles.append(norm.register_forward_pre_hook(lambda m, a: kept.update(h=a[0])))
            handles.append(layer.mlp.register_forward_pre_hook(lambda m, a: (norm(kept["h"] + added(scale)[None]),)))
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
                x = norm(kept["r"] + added(scale)[None])
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

    def edge(self, pair, sender: str, receiver: str, channel: str, *, steps: int | None = None, step=None,
             position: int | None = None) -> float:  # fmt: skip
        """The edge's score: dm/de at e = 0 (EAP), averaged over the interpolated inputs (EAP-IG, `steps`), or its
        central finite difference with `step`; at `position` alone, if given."""
        change = self.added(sender, self.writes(pair.clean_ids), self.writes(pair.corrupt_ids), position)
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
        """Each sender's write at the last position through the final norm (Gemma 2's heads: through the
        post-attention norm first), each norm's scale frozen, on the logit difference's direction; `bias`: the rest
        of m (the biases). Gemma 2's softcapped logits: every component times m / (their uncapped sum)."""
        writes = self.writes(pair.clean_ids)
        if self.gemma:
            for index, layer in enumerate(self.layers):
                o, norm = writes.pop(f"o{index}")[-1], layer.post_attention_layernorm
                rms = math.sqrt(float((o**2).mean()) + norm.eps)
                for head in range(self.heads):
                    write = writes[f"{index}.{head}"]
                    writes[f"{index}.{head}"] = write.clone()
                    writes[f"{index}.{head}"][-1] = (1 + norm.weight) * write[-1] / rms
        else:
            for index in range(len(self.layers)):
                writes.pop(f"o{index}")
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
        else:  # RMS: g x / rms (Gemma's: (1 + w) x / rms)
            rms = math.sqrt(float((x**2).mean()) + getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))
            gain = 1 + norm.weight if self.gemma else norm.weight

            def frozen(w):
                return gain * w / rms

        found = {name: float(frozen(write[-1]) @ direction) for name, write in writes.items()}
        m = float(logits[pair.answer_id] - logits[pair.distractor_id])
        cap = getattr(self.lm.config, "final_logit_softcapping", None)
        if cap:  # the uncapped difference, from the capped logits: l = cap * atanh(logit / cap)
            uncapped = cap * (
                math.atanh(float(logits[pair.answer_id]) / cap) - math.atanh(float(logits[pair.distractor_id]) / cap)
            )
            found["bias"] = uncapped - sum(found.values())
            return {name: value * m / uncapped for name, value in found.items()}
        found["bias"] = m - sum(found.values())
        return found
