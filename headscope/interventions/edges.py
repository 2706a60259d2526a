"""Which components feed which: edge attribution patching (EAP, EAP-IG) over every edge of a model's graph, and
direct logit attribution (DLA) of every component, for prompt pairs (docs/circuit.md has the definitions).

The graph. Senders write into the residual stream: `embed` (what enters the first layer: token embeddings, with any
position embedding and scaling the model applies), each head `L.H` (its output through its columns of the output
projection) and each MLP `mlpL`. Receivers read it: each query head's query input (`L.H`, channel q), each key-value
head's key and value inputs (`L.kvG`, channels k and v: a grouped-KV model's query heads share them), each MLP's
input (`mlpL`) and the logits (`logits`). An edge joins a sender to every receiver that reads after it: layer L's
heads and MLP read every sender of the layers before; layer L's MLP also reads layer L's heads; the logits read every
sender.

EAP (Syed et al. 2023): score(u -> r.c) = sum over positions t of (s_u^corrupt(t) - s_u^clean(t)) . g_r,c(t), with s_u
the sender's write into the residual stream and g_r,c the gradient of the metric m with respect to the residual stream
where r reads it, through r's channel c alone (r's input norm and its rows of the q, k or v projection; the MLP's input
norm and the MLP; the final norm and the LM head), at the clean run. A negative score: corrupting the edge lowers m.
EAP-IG (Hanna et al. 2024, "EAP-IG-inputs"): the same products, g averaged over `steps` runs whose input embeddings
lie on the straight line from the corrupt prompt's to the clean one's (at k / steps, k = 1..steps).

DLA: each sender's write at the last position through the final norm with the norm's scale frozen at the clean run,
projected on W_U[answer] - W_U[distractor]; the biases (attention output projections', the final norm's, the LM
head's) are one more component, `bias`, so the components add up to m.

Models whose attention output is not added as it is to the residual stream the MLP reads (post-attention norms, as
in Gemma 2 and OLMo 2; attention beside the MLP, as in GPT-J), and models that softcap their logits, are refused in
one line: their edges need a norm's Jacobian this version does not take.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.config import DEFAULT_EDGE_STEPS, EDGE_METHODS
from headscope.errors import ConfigError, ModelLoadError, ResourceError
from headscope.interventions.pairs import TokenizedPair
from headscope.interventions.patching import logit_difference
from headscope.model.batch import collate
from headscope.model.memory import readable
from headscope.model.projection import output_projection

METHODS, DEFAULT_STEPS = EDGE_METHODS, DEFAULT_EDGE_STEPS
# The faithfulness curve's circuits, as shares of the edges (MIB's sizes from 0.1%; the empty circuit and the full one
# are 0 and 1 by definition, and cost no pass): nine patched passes.
CURVE_SHARES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
# Relative error up to which the linearised final norm must reproduce the model's own (float32 rounding of a norm).
NORM_CHECK = 1e-4


@dataclass(frozen=True)
class Graph:
    """Every node and edge of a model's graph. senders: names; receivers: (name, channel); edges: (senders,
    receivers) bool, True where the receiver reads after the sender writes."""

    layers: int
    heads: int
    kv_heads: int
    senders: tuple[str, ...]
    receivers: tuple[tuple[str, str], ...]
    edges: np.ndarray

    @property
    def edge_count(self) -> int:
        return int(self.edges.sum())


def build_graph(layers: int, heads: int, kv_heads: int) -> Graph:
    """The graph of a decoder of `layers` layers, each `heads` query heads on `kv_heads` key-value heads and an MLP."""
    senders, sender_step = ["embed"], [-1]
    receivers, receiver_step = [], []
    for layer in range(layers):
        senders += [f"{layer}.{head}" for head in range(heads)]
        sender_step += [2 * layer] * heads
        senders.append(f"mlp{layer}")
        sender_step.append(2 * layer + 1)
        receivers += [(f"{layer}.{head}", "q") for head in range(heads)]
        receivers += [(f"{layer}.kv{group}", channel) for channel in ("k", "v") for group in range(kv_heads)]
        receiver_step += [2 * layer] * (heads + 2 * kv_heads)
        receivers.append((f"mlp{layer}", ""))
        receiver_step.append(2 * layer + 1)
    receivers.append(("logits", ""))
    receiver_step.append(2 * layers)
    edges = np.array(sender_step)[:, None] < np.array(receiver_step)[None, :]
    return Graph(layers, heads, kv_heads, tuple(senders), tuple(receivers), edges)


@dataclass
class EdgeScores:
    """Per pair: every edge's score, (pairs, senders, receivers) float64 (0 where there is no edge); every sender's
    DLA and the biases', (pairs, senders + 1) (the last column: `bias`); m on the clean and the corrupt prompt."""

    graph: Graph
    scores: np.ndarray
    dla: np.ndarray
    clean: np.ndarray
    corrupt: np.ndarray
    pair_ids: np.ndarray


@dataclass(frozen=True)
class _Parts:
    """Where a decoder layer's pieces are: its attention's q, k, v projections (or one fused q|k|v projection),
    output projection, and MLP."""

    q: torch.nn.Module | None
    k: torch.nn.Module | None
    v: torch.nn.Module | None
    fused: torch.nn.Module | None
    output: torch.nn.Module
    mlp: torch.nn.Module


def _layer_parts(layer: torch.nn.Module, heads: int, kv_heads: int, head_dim: int) -> _Parts:
    names = dict(layer.named_modules())
    attention = next((m for n, m in names.items() if n.rpartition(".")[2] in ("self_attn", "attn", "attention")), None)
    mlp = getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        raise ModelLoadError(f"{type(layer).__name__}: circuit finds no attention or no mlp module in a decoder layer")
    _, out = output_projection(layer, heads * head_dim)
    own = dict(attention.named_children())
    if all(name in own for name in ("q_proj", "k_proj", "v_proj")):
        return _Parts(own["q_proj"], own["k_proj"], own["v_proj"], None, out, mlp)
    if "c_attn" in own and kv_heads == heads:  # GPT-2: one Conv1D computing q | k | v
        return _Parts(None, None, None, own["c_attn"], out, mlp)
    raise ModelLoadError(
        f"{type(attention).__name__}: circuit reads q_proj, k_proj and v_proj (or GPT-2's c_attn); this attention "
        "has neither"
    )


def _columns(projection: torch.nn.Module) -> torch.Tensor:
    """(hidden, inputs) float32 weight of a Linear or GPT-2 Conv1D."""
    weight = projection.weight.detach().float()
    return weight.T if type(projection).__name__ == "Conv1D" else weight


class _Recorder:
    """Hooks on every decoder layer for one pass: the residual stream entering each layer (r_L), the heads' outputs
    before the output projection, the q, k and v projections' outputs, the MLP's input residual (h_L) and output, and
    the final norm's input; torch tensors of the pass's graph (with gradients where the pass builds them)."""

    def __init__(self, model, decoder, parts: list[_Parts], final_norm: torch.nn.Module, mlp_norms: list) -> None:
        self.model, self.decoder, self.parts = model, decoder, parts
        self.final_norm, self.mlp_norms = final_norm, mlp_norms

    @contextlib.contextmanager
    def hooks(self) -> Iterator[dict[str, list]]:
        depth = len(self.decoder)
        kept = {name: [None] * depth for name in ("r", "z", "q", "k", "v", "h", "mlp", "attn")}
        kept["final"] = [None]
        handles = []

        def keep(name, index, *, position: str):
            def hook(module, args, third):  # third: a pre-hook's kwargs, or a hook's output
                if position == "input":
                    value = args[0] if args else third.get("hidden_states", next(iter(third.values())))
                else:
                    value = third[0] if isinstance(third, tuple) else third
                kept[name][index] = value

            return hook

        for index, (layer, parts) in enumerate(zip(self.decoder, self.parts, strict=True)):
            handles.append(layer.register_forward_pre_hook(keep("r", index, position="input"), with_kwargs=True))
            handles.append(parts.output.register_forward_pre_hook(keep("z", index, position="input"), with_kwargs=True))
            handles.append(parts.output.register_forward_hook(keep("attn", index, position="output")))
            handles.append(parts.mlp.register_forward_hook(keep("mlp", index, position="output")))
            norm = self.mlp_norms[index]
            handles.append(norm.register_forward_pre_hook(keep("h", index, position="input"), with_kwargs=True))
            if parts.fused is not None:
                handles.append(parts.fused.register_forward_hook(keep("q", index, position="output")))
            else:
                for name in ("q", "k", "v"):
                    handles.append(getattr(parts, name).register_forward_hook(keep(name, index, position="output")))
        handles.append(self.final_norm.register_forward_pre_hook(keep("final", 0, position="input"), with_kwargs=True))
        try:
            yield kept
        finally:
            for handle in handles:
                handle.remove()


def _find_norms(
    capture, model, decoder, parts: list[_Parts], ids: list[int], device
) -> tuple[list, list, torch.nn.Module]:
    """Each layer's attention input norm (whose output the q projection reads) and MLP input norm (whose output is the
    MLP's input), and the final norm (whose output is the LM head's input), found by one pass on `ids`: the data
    flow, not module names."""
    outputs, handles = {}, []
    wanted = {}

    def remember(module, args, output):
        # By storage: the LM head may read a view of the final norm's output (logits_to_keep slices it); the first
        # module to produce a storage made it (dropout and identity modules pass it on). Kept alive with the map,
        # so that no later tensor takes its storage.
        if isinstance(output, torch.Tensor):
            outputs.setdefault(output.untyped_storage().data_ptr(), (module, output))

    def want(name):
        def hook(module, args):
            wanted[name] = (args[0].untyped_storage().data_ptr(), args[0])

        return hook

    for layer, part in zip(decoder, parts, strict=True):
        for child in layer.children():
            handles.append(child.register_forward_hook(remember))
        handles.append(part.mlp.register_forward_pre_hook(want(id(part.mlp))))
        reads = part.fused if part.fused is not None else part.q
        handles.append(reads.register_forward_pre_hook(want(id(reads))))
    head = model.get_output_embeddings()
    for module in model.modules():
        if module is not head and not any(module is layer for layer in decoder) and len(list(module.children())) == 0:
            handles.append(module.register_forward_hook(remember))
    handles.append(head.register_forward_pre_hook(want("head")))
    try:
        capture.run(collate([0], [ids]).to(device))
    finally:
        for handle in handles:
            handle.remove()

    def producer(name):
        found = outputs.get(wanted[name][0]) if name in wanted else None
        return None if found is None else found[0]

    norms, inputs = [], []
    for index, part in enumerate(parts):
        norm = producer(id(part.mlp))
        if norm is None or norm is part.mlp:
            raise ModelLoadError(f"layer {index}'s MLP reads no norm of the residual stream; circuit cannot place it")
        norms.append(norm)
        reads = part.fused if part.fused is not None else part.q
        norm = producer(id(reads))
        if norm is None:
            raise ModelLoadError(
                f"layer {index}'s attention reads no norm of the residual stream; circuit cannot place its inputs"
            )
        inputs.append(norm)
    final = producer("head")
    if final is None:
        raise ModelLoadError("the LM head reads no final norm; circuit cannot place the logits' input")
    return inputs, norms, final


class _FrozenNorm:
    """The final norm as a linear map, its scale frozen at the clean run: LayerNorm's g (x - mean x) / sigma or an RMS
    norm's g x / rms (g or 1 + w, whichever reproduces the module), its bias kept apart."""

    def __init__(self, norm: torch.nn.Module, residual: torch.Tensor, output: torch.Tensor) -> None:
        x = residual.detach().double()
        want = output.detach().double()
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        w = torch.ones(x.shape[-1], dtype=torch.float64) if weight is None else weight.detach().double().cpu()
        w = w.to(x.device)
        b = torch.zeros_like(w) if bias is None else bias.detach().double().to(x.device)
        centred = x - x.mean(-1, keepdim=True)
        candidates = {
            "layer": (True, w, centred.square().mean(-1, keepdim=True).add(eps).rsqrt()),
            "rms": (False, w, x.square().mean(-1, keepdim=True).add(eps).rsqrt()),
            "rms 1 + w": (False, 1 + w, x.square().mean(-1, keepdim=True).add(eps).rsqrt()),
        }
        for centre, gain, scale in candidates.values():
            got = (centred if centre else x) * scale * gain + b
            if (got - want).abs().max() <= NORM_CHECK * want.abs().max() + 1e-30:
                self.centre, self.gain, self.scale, self.bias = centre, gain, scale, b
                return
        raise ModelLoadError(
            f"circuit cannot linearise the final norm ({type(norm).__name__}): neither a LayerNorm nor an RMS norm"
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, n, hidden), writes at the one position per row `scale` was frozen at."""
        x = x.double()
        if self.centre:
            x = x - x.mean(-1, keepdim=True)
        return x * self.scale * self.gain


class EdgeModel:
    """A model attached for edges: its graph, where each sender writes and each receiver reads (found once, on the
    first pair), and the passes over pairs: `scores` (EAP, EAP-IG and DLA) and `patched` (the metric with chosen
    edges carrying the corrupt prompt's sender)."""

    def __init__(self, capture, loaded, plan, first: TokenizedPair) -> None:
        model = loaded.lm
        if getattr(model.config, "final_logit_softcapping", None):
            raise ConfigError("circuit does not take models that softcap their logits (final_logit_softcapping)")
        architecture = plan.architecture
        self.heads, self.kv_heads, self.head_dim = (architecture[key] for key in ("heads", "kv_heads", "head_dim"))
        self.capture, self.model, self.plan, self.device = capture, model, plan, loaded.device
        self.decoder = capture.decoder
        self.parts = [_layer_parts(layer, self.heads, self.kv_heads, self.head_dim) for layer in self.decoder]
        self.input_norms, mlp_norms, final_norm = _find_norms(capture, model, self.decoder, self.parts, first.clean_ids,
                                                              self.device)  # fmt: skip
        self.graph = build_graph(len(self.decoder), self.heads, self.kv_heads)
        self.recorder = _Recorder(model, self.decoder, self.parts, final_norm, mlp_norms)
        self.columns = [_columns(part.output).to(self.device) for part in self.parts]  # (hidden, heads * head_dim)

    def batches(self, pairs: Sequence[TokenizedPair]) -> Iterator[list[TokenizedPair]]:
        """Pairs of one length together (no padding), as many as --max-memory holds: a gradient pass of their
        tokens, and the edges' own tensors (`token_bytes` a token)."""
        by_length: dict[int, list[TokenizedPair]] = {}
        for pair in pairs:
            by_length.setdefault(pair.length, []).append(pair)
        budget, token_bytes = self.plan.memory_budget, self.token_bytes()
        longest = max(pair.length for pair in pairs)
        if longest * token_bytes > budget:
            raise ResourceError(
                f"circuit holds {readable(token_bytes)} a token (every sender's write and every receiver's gradient): "
                f"a pair of {longest} tokens needs {readable(longest * token_bytes)} and --max-memory allows "
                f"{readable(budget)}; raise --max-memory or shorten the prompts"
            )
        rows = max(1, min(self.plan.limits("importance").max_tokens, budget // token_bytes))
        for length, same in sorted(by_length.items()):
            per_batch = max(1, rows // length)
            for start in range(0, len(same), per_batch):
                yield same[start : start + per_batch]

    def token_bytes(self) -> int:
        """What a token of a batch holds beyond its passes: every sender's write on the clean and the corrupt prompt
        and its change, every receiver's gradient, and their copies laid out by position for the products (float32,
        the width of the residual stream)."""
        hidden = self.columns[0].shape[0]
        return (4 * len(self.graph.senders) + 2 * len(self.graph.receivers)) * hidden * 4

    def scores(self, pairs: Sequence[TokenizedPair], *, method: str, steps: int) -> EdgeScores:
        """Every edge's score and every sender's DLA for each pair (EdgeScores), in pair order."""
        if method not in METHODS:
            raise ConfigError(f"--method takes {', '.join(METHODS)}; got {method!r}")
        found = {"scores": [], "dla": [], "clean": [], "corrupt": [], "ids": []}
        for chunk in self.batches(pairs):
            for key, value in self._batch_scores(chunk, method, steps).items():
                found[key].append(value)
            found["ids"].append(np.array([p.pair.pair_id for p in chunk]))
        order = np.argsort(np.concatenate(found["ids"]), kind="stable")  # pair order, whatever the batching
        return EdgeScores(self.graph, *(np.concatenate(found[key])[order] for key in ("scores", "dla", "clean",
                          "corrupt")), np.concatenate(found["ids"])[order])  # fmt: skip

    def patched(self, pairs: Sequence[TokenizedPair], excluded: Sequence[np.ndarray]) -> np.ndarray:
        """(sets, pairs) float64, in pair order: the metric on each clean prompt when every edge of each set (a
        (senders, receivers) bool mask) carries the corrupt prompt's write of its sender into its receiver, every other
        edge the write of this very pass (which the changed edges change downstream)."""
        found, ids = [], []
        for chunk in self.batches(pairs):
            answers, distractors = _targets(chunk, self.device)
            _, corrupt_kept = _run(self.capture, self.recorder, [p.corrupt_ids for p in chunk], self.device, grad=False)
            corrupt = _writes(corrupt_kept, self.columns, self.heads, self.head_dim)
            rows = []
            for mask in excluded:
                logits = self._patched_run(chunk, corrupt, torch.as_tensor(mask, device=self.device))
                rows.append(logit_difference(logits, answers, distractors).double().cpu().numpy())
            found.append(np.stack(rows))
            ids.append(np.array([p.pair.pair_id for p in chunk]))
        order = np.argsort(np.concatenate(ids), kind="stable")
        return np.concatenate(found, axis=1)[:, order]

    def _batch_scores(self, chunk, method: str, steps: int) -> dict[str, np.ndarray]:
        """One batch's edge scores, DLA and m on both prompts: a corrupt pass, a clean pass with gradients (and, for
        EAP-IG, `steps` interpolated ones), the receivers' gradients, the products."""
        capture, recorder, parts, device = self.capture, self.recorder, self.parts, self.device
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        answers, distractors = _targets(chunk, device)
        clean_ids, corrupt_ids = [p.clean_ids for p in chunk], [p.corrupt_ids for p in chunk]

        def metric(logits):
            return logit_difference(logits, answers, distractors)

        corrupt_logits, corrupt_kept = _run(capture, recorder, corrupt_ids, device, grad=False)
        corrupt_writes = _writes(corrupt_kept, self.columns, heads, head_dim)
        corrupt_embeds = _embeddings(self.model, corrupt_ids, device)
        with torch.enable_grad():
            clean_logits, kept = _run(capture, recorder, clean_ids, device, grad=True)
            _check_residual(kept, parts, len(parts))
            clean_writes = _writes(kept, self.columns, heads, head_dim)
            m_clean = metric(clean_logits)
            if method == "eap":
                gradients = _receiver_gradients(m_clean, kept, parts, heads, kv_heads, head_dim)
            else:
                clean_embeds = _embeddings(self.model, clean_ids, device)
                gradients = None
                for k in range(1, steps + 1):
                    between = torch.lerp(corrupt_embeds, clean_embeds, k / steps)  # the last: the clean inputs exactly
                    step_logits, step_kept = _run(capture, recorder, clean_ids, device, grad=True, embeds=between)
                    found = _receiver_gradients(metric(step_logits), step_kept, parts, heads, kv_heads, head_dim)
                    gradients = found if gradients is None else gradients + found
                gradients = gradients / steps
            unembed = self.model.get_output_embeddings()
            dla = _dla(recorder, kept, clean_writes, parts, unembed, answers, distractors)
        scores = _products(self.graph, corrupt_writes - clean_writes, gradients)
        return {
            "scores": scores.cpu().numpy(),
            "dla": dla.cpu().numpy(),
            "clean": m_clean.detach().double().cpu().numpy(),
            "corrupt": metric(corrupt_logits).double().cpu().numpy(),
        }

    def _patched_run(self, chunk, corrupt: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
        """The clean prompts' last logits, the `excluded` edges carrying `corrupt` writes (senders, rows, t, hidden)."""
        graph, heads, kv_heads, head_dim = self.graph, self.heads, self.kv_heads, self.head_dim
        receiver_index = {receiver: index for index, receiver in enumerate(graph.receivers)}
        sender_index = {sender: index for index, sender in enumerate(graph.senders)}
        senders = corrupt.shape[0]
        # corrupt - this pass's write, per sender, set as each sender writes; `written` sums them (every sender so far)
        difference = corrupt.clone()
        written = torch.zeros_like(corrupt[0])
        edges = torch.as_tensor(graph.edges, device=excluded.device)
        kept, handles = {}, []

        def wrote(first: int, writes: torch.Tensor) -> None:
            difference[first : first + len(writes)] = corrupt[first : first + len(writes)] - writes
            written.add_(difference[first : first + len(writes)].sum(0))

        def change(receivers: list[int]) -> torch.Tensor | None:
            """(receivers, rows, t, hidden): what the excluded edges into each of them change, or None if none: the
            sum over those edges of (corrupt - this pass's) sender write, taken over the fewer of the edges it
            excludes and those it keeps (then as everything written so far, every earlier sender's, minus those)."""
            chosen = excluded[:, receivers]
            if not bool(chosen.any()):
                return None
            kept_edges = edges[:, receivers] & ~chosen
            flat = difference.view(senders, -1)
            if int(chosen.sum()) <= int(kept_edges.sum()):
                rows = chosen.any(1).nonzero()[:, 0]
                found = chosen[rows].T.to(flat.dtype) @ flat[rows]
            else:
                rows = kept_edges.any(1).nonzero()[:, 0]
                found = written.view(1, -1) - kept_edges[rows].T.to(flat.dtype) @ flat[rows]
            return found.view(len(receivers), *corrupt.shape[1:])

        for layer, (block, part) in enumerate(zip(self.decoder, self.parts, strict=True)):

            def entering(module, args, kwargs, layer=layer):
                residual = args[0] if args else kwargs["hidden_states"]
                kept[("r", layer)] = residual
                if layer == 0:
                    wrote(0, residual.detach().float()[None])

            handles.append(block.register_forward_pre_hook(entering, with_kwargs=True))

            def heads_written(module, args, layer=layer):
                wrote(sender_index[f"{layer}.0"], _head_writes(args[0], self.columns[layer], heads, head_dim))

            handles.append(part.output.register_forward_pre_hook(heads_written))

            def mlp_written(module, args, output, layer=layer):
                wrote(sender_index[f"mlp{layer}"], output.detach().float()[None])

            handles.append(part.mlp.register_forward_hook(mlp_written))
            # The attention's inputs: each receiver channel of the layer reads its own changed stream.
            width = heads * head_dim
            # (channel, head or group, receiver name, where the channel's features start in a fused q|k|v output)
            fused = part.fused is not None
            channels = [("q", head, f"{layer}.{head}", 0) for head in range(heads)]
            channels += [(channel, group, f"{layer}.kv{group}", width if channel == "k" else 2 * width)
                         for channel in ("k", "v") for group in range(kv_heads)]  # fmt: skip
            by_module = {}
            for channel, unit, name, offset in channels:
                module = part.fused if fused else getattr(part, channel)
                start = (offset if fused else 0) + unit * head_dim
                read = (receiver_index[(name, channel)], slice(start, start + head_dim))
                by_module.setdefault(module, []).append(read)
            for module, reads in by_module.items():

                def reading(module, args, output, layer=layer, reads=reads):
                    found = change([index for index, _ in reads])
                    if found is None:
                        return None
                    output = output.clone()
                    residual = kept[("r", layer)]
                    for (_, features), changed in zip(reads, found, strict=True):
                        if not bool(changed.any()):
                            continue
                        normed = self.input_norms[layer](residual + changed.to(residual.dtype))
                        output[..., features] = _project(module, normed)[..., features]
                    return output

                handles.append(module.register_forward_hook(reading))
            mlp_index = receiver_index[(f"mlp{layer}", "")]

            def mlp_reads(module, args, layer=layer, mlp_index=mlp_index):
                found = change([mlp_index])
                if found is None:
                    return None
                h = kept[("h", layer)]
                return (self.recorder.mlp_norms[layer](h + found[0].to(h.dtype)),)

            def mlp_stream(module, args, layer=layer):
                kept[("h", layer)] = args[0]

            handles.append(self.recorder.mlp_norms[layer].register_forward_pre_hook(mlp_stream))
            handles.append(part.mlp.register_forward_pre_hook(mlp_reads))

        logits_index = receiver_index[("logits", "")]

        def final_reads(module, args):
            found = change([logits_index])
            return None if found is None else (args[0] + found[0].to(args[0].dtype),)

        handles.append(self.recorder.final_norm.register_forward_pre_hook(final_reads))
        try:
            batch = collate(list(range(len(chunk))), [p.clean_ids for p in chunk]).to(self.device)
            return self.capture.run(batch).logits[:, -1]
        finally:
            for handle in handles:
                handle.remove()


def _project(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A q, k or v projection by hand (calling the module would run its hooks again): a Linear, or GPT-2's Conv1D."""
    if type(module).__name__ == "Conv1D":
        return x @ module.weight + module.bias
    return torch.nn.functional.linear(x, module.weight, module.bias)


def _targets(chunk, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([p.answer_id for p in chunk], device=device),
            torch.tensor([p.distractor_id for p in chunk], device=device))  # fmt: skip


def _run(capture, recorder: _Recorder, ids: list[list[int]], device, *, grad: bool, embeds=None):
    """One pass of the rows `ids` (one length: no padding), with the recorder's hooks; embeds: what the embedding
    module returns instead (EAP-IG's interpolated inputs). Returns (logits at the last position, kept tensors)."""
    batch = collate(list(range(len(ids))), ids).to(device)
    with contextlib.ExitStack() as stack:
        kept = stack.enter_context(recorder.hooks())
        if embeds is not None:
            hook = recorder.model.get_input_embeddings().register_forward_hook(lambda module, args, output: embeds)
            stack.callback(hook.remove)
        output = capture.run(batch, grad=grad)
    return output.logits[:, -1], kept


def _head_writes(z: torch.Tensor, columns: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """(heads, rows, t, hidden) float32: each head's output z (rows, t, heads * head_dim) through its columns of the
    output projection (hidden, heads * head_dim), no bias."""
    rows, t = z.shape[:2]
    per_head = z.detach().float().view(rows, t, heads, head_dim)
    return torch.einsum("rthd,mhd->hrtm", per_head, columns.view(-1, heads, head_dim))


def _writes(kept, columns, heads: int, head_dim: int) -> torch.Tensor:
    """(senders, rows, t, hidden) float32: what each sender writes into the residual stream, in graph order: embed,
    then per layer its heads and its MLP."""
    writes = [kept["r"][0].detach().float()]
    for layer, weight in enumerate(columns):
        writes += list(_head_writes(kept["z"][layer], weight, heads, head_dim))
        writes.append(kept["mlp"][layer].detach().float())
    return torch.stack(writes)


def _receiver_gradients(metric, kept, parts, heads, kv_heads, head_dim) -> torch.Tensor:
    """(receivers, rows, t, hidden) float32: the metric's gradient with respect to the residual stream where each
    receiver reads it, through that receiver's channel alone (graph order)."""
    depth = len(parts)
    fused = parts[0].fused is not None
    wanted = [kept["q"][layer] for layer in range(depth)]
    if not fused:
        wanted += [kept[name][layer] for name in ("k", "v") for layer in range(depth)]
    wanted += [kept["mlp"][layer] for layer in range(depth)] + [kept["final"][0]]
    grads = torch.autograd.grad(metric.sum(), wanted, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wanted, grads, strict=True)]
    q_grads = grads[:depth]
    k_grads, v_grads = (None, None) if fused else (grads[depth : 2 * depth], grads[2 * depth : 3 * depth])
    mlp_grads = grads[-depth - 1 : -1]
    found = []
    width = heads * head_dim
    for layer in range(depth):
        residual = kept["r"][layer]
        slices = []  # (projection output, its gradient restricted to one head's features)
        for head in range(heads):
            slices.append((kept["q"][layer], q_grads[layer], slice(head * head_dim, (head + 1) * head_dim)))
        for channel in ("k", "v"):
            for group in range(kv_heads):
                if fused:  # GPT-2's c_attn: q | k | v
                    offset = width if channel == "k" else 2 * width
                    slices.append((kept["q"][layer], q_grads[layer],
                                   slice(offset + group * head_dim, offset + (group + 1) * head_dim)))  # fmt: skip
                else:
                    own = k_grads if channel == "k" else v_grads
                    tensor, grad = kept[channel][layer], own[layer]
                    slices.append((tensor, grad, slice(group * head_dim, (group + 1) * head_dim)))
        # One batched vector-Jacobian product per projection: each slice's gradient, the rest of the features 0.
        by_tensor: dict[int, list] = {}
        for tensor, grad, features in slices:
            by_tensor.setdefault(id(tensor), [tensor, grad, []])[2].append(features)
        for tensor, grad, all_features in by_tensor.values():
            masked = torch.zeros((len(all_features), *grad.shape), dtype=grad.dtype, device=grad.device)
            for index, features in enumerate(all_features):
                masked[index, ..., features] = grad[..., features]
            (through,) = torch.autograd.grad(tensor, residual, grad_outputs=masked, retain_graph=True,
                                             is_grads_batched=True)  # fmt: skip
            found.extend(through.float())
        (through_mlp,) = torch.autograd.grad(kept["mlp"][layer], kept["h"][layer], grad_outputs=mlp_grads[layer],
                                              retain_graph=True)  # fmt: skip
        found.append(through_mlp.float())
    found.append(grads[-1].float())  # the logits read the final norm's input directly
    return torch.stack(found)


def _check_residual(kept, parts, layer_count: int) -> None:
    """The attention's output is added as it is to the stream the MLP reads, and the MLP's output to the next
    layer's input: else this model's edges need a norm's Jacobian (a post-norm) or see no such stream (parallel)."""
    for layer in range(layer_count):
        r, attention, h = (kept[name][layer].detach().double() for name in ("r", "attn", "h"))
        scale = r.abs().max() + attention.abs().max() + 1e-30
        if (r + attention - h).abs().max() > NORM_CHECK * scale:
            raise ConfigError(
                f"layer {layer}'s attention output does not reach the MLP's input as it is (a post-attention norm, or "
                "attention in parallel with the MLP): circuit does not take this architecture yet"
            )
        if layer + 1 < layer_count:
            following = kept["r"][layer + 1].detach().double()
            mlp = kept["mlp"][layer].detach().double()
            if (h + mlp - following).abs().max() > NORM_CHECK * (h.abs().max() + mlp.abs().max() + 1e-30):
                raise ConfigError(f"layer {layer}'s MLP output does not reach the next layer as it is (a post-MLP "
                                  "norm): circuit does not take this architecture yet")  # fmt: skip


def _products(graph: Graph, change: torch.Tensor, gradients: torch.Tensor) -> torch.Tensor:
    """(rows, senders, receivers) float64: sum over positions and features of change (senders, rows, t, hidden) times
    gradients (receivers, rows, t, hidden), 0 where there is no edge. Senders and receivers are in the order of the
    computation, so each receiver reads a prefix of the senders: the products run receiver group by receiver group
    over that prefix only (about half of all pairs). Each position's sum over the hidden features is a float32
    product (within gamma_hidden of its terms' magnitudes: 3.4e-5 of them at SmolLM2's 576), the positions added in
    float64."""
    senders, rows, t, hidden = change.shape
    by_position = change.permute(1, 2, 0, 3).reshape(rows * t, senders, hidden).float()
    read_by_position = gradients.permute(1, 2, 3, 0).reshape(rows * t, hidden, -1).float()
    scores = torch.zeros(rows, senders, len(graph.receivers), dtype=torch.float64, device=change.device)
    reads = graph.edges.sum(0)  # each receiver's prefix of senders
    start = 0
    while start < len(graph.receivers):
        end = start
        while end < len(graph.receivers) and reads[end] == reads[start]:
            end += 1
        prefix = int(reads[start])
        if prefix:
            products = torch.bmm(by_position[:, :prefix], read_by_position[:, :, start:end])  # (rows * t, prefix, n)
            scores[:, :prefix, start:end] = products.view(rows, t, prefix, end - start).sum(1, dtype=torch.float64)
        start = end
    return scores


def _embeddings(model, ids: list[list[int]], device) -> torch.Tensor:
    """What the model's embedding module returns for these rows (before any position embedding or scaling)."""
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids, device=device)).detach()


def _dla(recorder, kept, writes, parts, unembed, answers, distractors) -> torch.Tensor:
    """(rows, senders + 1) float64: each sender's write at the last position through the frozen final norm, on
    W_U[answer] - W_U[distractor]; last, the biases' (the attention output projections', the final norm's, the LM
    head's)."""
    final_in = kept["final"][0].detach()[:, -1:]  # (rows, 1, hidden): the last position
    with torch.no_grad():
        frozen = _FrozenNorm(recorder.final_norm, final_in, recorder.final_norm(final_in))
    weight = unembed.weight.detach().double()
    direction = weight[answers] - weight[distractors]  # (rows, hidden)
    last = writes[:, :, -1].double().transpose(0, 1)  # (rows, senders, hidden)
    dla = (frozen(last) * direction[:, None, :]).sum(-1)  # (rows, senders)
    biases = torch.zeros(direction.shape[-1], dtype=torch.float64, device=direction.device)
    for part in parts:
        bias = getattr(part.output, "bias", None)
        if bias is not None:
            biases = biases + bias.detach().double()
    through = frozen(biases.expand(len(direction), 1, -1))[:, 0]  # (rows, hidden)
    bias_term = (through * direction).sum(-1) + (frozen.bias * direction).sum(-1)
    head_bias = getattr(unembed, "bias", None)
    if head_bias is not None:
        bias_term = bias_term + head_bias.detach().double()[answers] - head_bias.detach().double()[distractors]
    return torch.cat([dla, bias_term[:, None]], dim=1)


def ranked_edges(graph: Graph, mean_scores: np.ndarray) -> np.ndarray:
    """(edges, 2) sender and receiver indices of every edge, strongest |mean score| first (ties in graph order)."""
    senders, receivers = np.nonzero(graph.edges)
    order = np.argsort(-np.abs(mean_scores[senders, receivers]), kind="stable")
    return np.stack([senders[order], receivers[order]], axis=1)


def circuit_size(share: float, edge_count: int) -> int:
    """The edges a circuit of `share` of them holds: at least one, the share rounded up."""
    return max(1, math.ceil(share * edge_count - 1e-9))


def outside(graph: Graph, ranked: np.ndarray, size: int) -> np.ndarray:
    """(senders, receivers) bool: every edge but the `size` strongest, the edges a circuit of that size leaves out
    (they carry the corrupt prompt's sender)."""
    mask = graph.edges.copy()
    kept = ranked[:size]
    mask[kept[:, 0], kept[:, 1]] = False
    return mask


def faithfulness(circuit: np.ndarray, clean: np.ndarray, corrupt: np.ndarray) -> float:
    """(mean m with the circuit - mean m corrupt) / (mean m clean - mean m corrupt), means over pairs; NaN where the
    clean and corrupt means are equal (nothing to recover)."""
    gap = float(clean.mean() - corrupt.mean())
    return float("nan") if gap == 0 else float((circuit.mean() - corrupt.mean()) / gap)


def curve_areas(shares: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """CPR (the area under faithfulness against the share of edges, 0 to 1) and CMD (the area of |1 - faithfulness|),
    by trapezoids through the curve's points."""
    x, f = np.asarray(shares, dtype=float), np.asarray(values, dtype=float)
    width = np.diff(x)  # by hand: numpy 1.26 (which headscope takes) names it trapz, numpy 2 trapezoid

    def area(y: np.ndarray) -> float:
        return float((width * (y[1:] + y[:-1]) / 2).sum())

    return area(f), area(np.abs(1 - f))
