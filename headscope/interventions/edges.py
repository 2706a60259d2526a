"""Which components feed which: edge attribution patching (EAP, EAP-IG) over every edge of a model's graph
(edge_graph), and direct logit attribution (DLA) of every component, for prompt pairs (docs/circuit.md has the
definitions). Where each layer's pieces sit, and the maps of its norms: edge_layers; the exact patched passes:
edge_patching.

EAP (Syed et al. 2023): score(u -> r.c) = sum over positions t of (s_u^corrupt(t) - s_u^clean(t)) . g_r,c(t), with s_u
the sender's write into the residual stream and g_r,c the gradient of the metric m with respect to the residual stream
where r reads it, through r's channel c alone (r's input norm and its rows of the q, k or v projection; the MLP's input
norm, the MLP and its post-norm; the final norm and the LM head), at the clean run. A negative score: corrupting the
edge lowers m. A head behind a post-attention norm P (Gemma 2 and 3, OLMo 2) changes the stream by P's Jacobian at
the clean run times W_h (z_h corrupt - z_h clean). EAP-IG (Hanna et al. 2024, "EAP-IG-inputs"): the same products, g
averaged over `steps` runs whose input embeddings lie on the straight line from the corrupt prompt's to the clean
one's (at k / steps, k = 1..steps).

DLA: each sender's write at the last position through the norms after it with their scales frozen at the clean run (a
post-attention norm's, then the final norm's), projected on W_U[answer] - W_U[distractor]; the biases (the output
projections', the norms', the LM head's) are one more component, `bias`, so the components add up to m. Softcapped
logits (Gemma 2): every component times m over the uncapped sum, the softcap's secant at the clean run.

Attention beside the MLP (GPT-J) and residual multipliers (Granite) are refused in one line: the stream the graph
adds up is not the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from headscope.config import DEFAULT_EDGE_STEPS, EDGE_METHODS
from headscope.errors import ConfigError, ResourceError
from headscope.interventions.edge_graph import Graph, build_graph
from headscope.interventions.edge_layers import circuit_places, head_writes
from headscope.interventions.edge_patching import patched_logits
from headscope.interventions.pairs import TokenizedPair
from headscope.interventions.patching import logit_difference
from headscope.model.batch import collate
from headscope.model.layers import LayerPlaces
from headscope.model.memory import readable
from headscope.model.norms import NORM_CHECK, FrozenNorm, norm_back, norm_jvp
from headscope.model.projection import head_columns, linear_weight

METHODS, DEFAULT_STEPS = EDGE_METHODS, DEFAULT_EDGE_STEPS


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
    # with roles: (pairs, roles, senders, receivers) float32, the scores' products at each role's position alone
    by_role: np.ndarray | None = None
    # EAP-IG's runs only: the EAP scores of the same pass (its last step runs the clean inputs exactly: the gradient
    # EAP takes), (pairs, senders, receivers) float64; --verify patches the strongest by either
    eap: np.ndarray | None = None

    @classmethod
    def joined(cls, parts: Sequence[EdgeScores]) -> EdgeScores:
        """Scores of several shares of the pairs (torchrun's ranks) as one, in pair order."""
        order = np.argsort(np.concatenate([part.pair_ids for part in parts]), kind="stable")
        fields = ("scores", "dla", "clean", "corrupt", "pair_ids")
        joined = (np.concatenate([getattr(part, name) for part in parts])[order] for name in fields)
        optional = {
            name: None if getattr(parts[0], name) is None else np.concatenate([getattr(p, name) for p in parts])[order]
            for name in ("by_role", "eap")
        }
        return cls(parts[0].graph, *joined, **optional)


class Recorder:
    """Hooks on every decoder layer for one pass (circuit's, and inspect --why's: interventions.qk_senders): the
    residual stream entering each layer (r), the heads' outputs before the output projection (z) and its result
    (attn), the post-attention norm's output (post), the q, k and v projections' outputs, the stream the MLP reads (h)
    and its input (reads: N_mlp(h)), the MLP's write (mlp: after its post-norm where there is one) and the final
    norm's input; torch tensors of the pass's graph (with gradients where the pass builds them)."""

    def __init__(self, model, decoder, places: list[LayerPlaces], final_norm: torch.nn.Module) -> None:
        self.model, self.decoder, self.places, self.final_norm = model, decoder, places, final_norm

    @contextlib.contextmanager
    def hooks(self) -> Iterator[dict[str, list]]:
        depth = len(self.decoder)
        kept = {name: [None] * depth for name in ("r", "z", "q", "k", "v", "h", "reads", "mlp", "attn", "post")}
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

        def on(module, name, index, position):
            if position == "input":
                handles.append(module.register_forward_pre_hook(keep(name, index, position=position), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(keep(name, index, position=position)))

        for index, (layer, place) in enumerate(zip(self.decoder, self.places, strict=True)):
            on(layer, "r", index, "input")
            on(place.output, "z", index, "input")
            on(place.output, "attn", index, "output")
            on(place.post_attention or place.output, "post", index, "output")
            on(place.post_mlp or place.mlp, "mlp", index, "output")
            on(place.mlp_norm or place.mlp, "h", index, "input")
            on(place.mlp, "reads", index, "input")
            if place.fused is not None:
                on(place.fused, "q", index, "output")
            else:
                for name in ("q", "k", "v"):
                    on(getattr(place, name), name, index, "output")
        on(self.final_norm, "final", 0, "input")
        try:
            yield kept
        finally:
            for handle in handles:
                handle.remove()


def _quiet(pairs: int, tokens: int) -> None:
    pass


def _tokens(chunk) -> int:
    """The tokens a batch of pairs runs: each clean and corrupt prompt."""
    return sum(len(p.clean_ids) + len(p.corrupt_ids) for p in chunk)


class EdgeModel:
    """A model attached for edges: its graph, where each sender writes and each receiver reads (the model's
    description, model/layers.py), and the passes over pairs: `scores` (EAP, EAP-IG and DLA) and `patched` (the
    metric with chosen edges carrying the corrupt prompt's sender)."""

    def __init__(self, capture, loaded, plan) -> None:
        model = loaded.lm
        architecture = plan.architecture
        self.heads, self.kv_heads, self.head_dim = (architecture[key] for key in ("heads", "kv_heads", "head_dim"))
        self.capture, self.model, self.plan, self.device = capture, model, plan, loaded.device
        self.decoder = capture.decoder
        self.places, final_norm = circuit_places(capture, self.device, plain_residual=True)
        self.graph = build_graph(len(self.decoder), self.heads, self.kv_heads)
        self.recorder = Recorder(model, self.decoder, self.places, final_norm)
        self.columns = [head_columns(place.output).to(self.device) for place in self.places]  # (hidden, heads * dim)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def batches(
        self, pairs: Sequence[TokenizedPair], roles: int = 0, method: str = "eap"
    ) -> Iterator[list[TokenizedPair]]:
        """Pairs of one length together (no padding), as many as --max-memory holds: a gradient pass of their
        tokens, and the edges' own tensors (`token_bytes` a token; with `roles`, each pair's scores at each role,
        float32, too; for EAP-IG, the last step's gradients and each pair's EAP scores, float64, besides)."""
        by_length: dict[int, list[TokenizedPair]] = {}
        for pair in pairs:
            by_length.setdefault(pair.length, []).append(pair)
        budget, token_bytes = self.plan.memory_budget, self.token_bytes()
        per_pair = roles * self.graph.edges.size * 4
        if method == "eap-ig":
            token_bytes += len(self.graph.receivers) * self.columns[0].shape[0] * 4
            per_pair += self.graph.edges.size * 8
        longest = max(pair.length for pair in pairs)
        if longest * token_bytes + per_pair > budget:
            what = " and its scores by role" if roles else ""
            raise ResourceError(
                f"circuit holds {readable(token_bytes)} a token (every sender's write and every receiver's gradient)"
                f"{f' and {readable(per_pair)} a pair{what}' if per_pair else ''}: a pair of {longest} tokens needs "
                f"{readable(longest * token_bytes + per_pair)} and --max-memory allows {readable(budget)}; raise "
                "--max-memory or shorten the prompts"
            )
        tokens = self.plan.limits("importance").max_tokens
        for length, same in sorted(by_length.items()):
            per_batch = max(1, min(tokens // length, budget // (length * token_bytes + per_pair)))
            for start in range(0, len(same), per_batch):
                yield same[start : start + per_batch]

    def token_bytes(self) -> int:
        """What a token of a batch holds beyond its passes: every sender's write on the clean and the corrupt prompt
        and its change, every receiver's gradient, and their copies laid out by position for the products (float32,
        the width of the residual stream)."""
        hidden = self.columns[0].shape[0]
        return (4 * len(self.graph.senders) + 2 * len(self.graph.receivers)) * hidden * 4

    def scores(self, pairs: Sequence[TokenizedPair], *, method: str, steps: int, roles: Sequence[str] | None = None,
               on_batch: Callable[[int, int], None] = _quiet) -> EdgeScores:  # fmt: skip
        """Every edge's score and every sender's DLA for each pair (EdgeScores), in pair order; with `roles` (marked
        in every pair), each edge's score at each role's position too. on_batch(pairs, tokens): after each batch."""
        if method not in METHODS:
            raise ConfigError(f"--method takes {', '.join(METHODS)}; got {method!r}")
        senders, receivers = self.graph.edges.shape
        if not pairs:  # a rank dealt none
            by_role = None if roles is None else np.zeros((0, len(roles), senders, receivers), dtype=np.float32)
            eap = np.zeros((0, senders, receivers)) if method == "eap-ig" else None
            return EdgeScores(self.graph, np.zeros((0, senders, receivers)), np.zeros((0, senders + 1)),
                              np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64), by_role, eap)  # fmt: skip
        found = {"scores": [], "dla": [], "clean": [], "corrupt": [], "ids": [], "by_role": [], "eap": []}
        for chunk in self.batches(pairs, 0 if roles is None else len(roles), method):
            for key, value in self._batch_scores(chunk, method, steps, roles).items():
                found[key].append(value)
            found["ids"].append(np.array([p.pair.pair_id for p in chunk]))
            on_batch(len(chunk), _tokens(chunk))
        order = np.argsort(np.concatenate(found["ids"]), kind="stable")  # pair order, whatever the batching
        by_role = None if roles is None else np.concatenate(found["by_role"])[order]
        eap = np.concatenate(found["eap"])[order] if found["eap"] else None
        return EdgeScores(self.graph, *(np.concatenate(found[key])[order] for key in ("scores", "dla", "clean",
                          "corrupt")), np.concatenate(found["ids"])[order], by_role, eap)  # fmt: skip

    def patched(self, pairs: Sequence[TokenizedPair], excluded: Sequence[np.ndarray],
                on_batch: Callable[[int, int], None] = _quiet) -> np.ndarray:  # fmt: skip
        """(sets, pairs) float64, in pair order: the metric on each clean prompt when every edge of each set (a
        (senders, receivers) bool mask) carries the corrupt prompt's write of its sender into its receiver, every other
        edge the write of this very pass (which the changed edges change downstream). on_batch(pairs, tokens): after
        each set's patched run of a batch."""
        if not pairs:  # a rank dealt none
            return np.zeros((len(excluded), 0))
        found, ids = [], []
        for chunk in self.batches(pairs):
            answers, distractors = _targets(chunk, self.device)
            _, corrupt_kept = _run(self.capture, self.recorder, [p.corrupt_ids for p in chunk], self.device, grad=False)
            corrupt = self._writes(corrupt_kept)
            rows = []
            for mask in excluded:
                logits = patched_logits(self, chunk, corrupt, torch.as_tensor(mask, device=self.device))
                rows.append(logit_difference(logits, answers, distractors).double().cpu().numpy())
                on_batch(len(chunk), _tokens(chunk))
            found.append(np.stack(rows))
            ids.append(np.array([p.pair.pair_id for p in chunk]))
        order = np.argsort(np.concatenate(ids), kind="stable")
        return np.concatenate(found, axis=1)[:, order]

    def _batch_scores(self, chunk, method: str, steps: int, roles=None) -> dict[str, np.ndarray]:
        """One batch's edge scores, DLA and m on both prompts: a corrupt pass, a clean pass with gradients (and, for
        EAP-IG, `steps` interpolated ones), the receivers' gradients, the products."""
        capture, recorder, places, device = self.capture, self.recorder, self.places, self.device
        answers, distractors = _targets(chunk, device)
        clean_ids, corrupt_ids = [p.clean_ids for p in chunk], [p.corrupt_ids for p in chunk]

        def metric(logits):
            return logit_difference(logits, answers, distractors)

        def gradients_of(m, kept):
            return _receiver_gradients(m, kept, places, self.heads, self.kv_heads, self.head_dim)

        corrupt_logits, corrupt_kept = _run(capture, recorder, corrupt_ids, device, grad=False)
        corrupt_embeds = _embeddings(self.model, corrupt_ids, device)
        with torch.enable_grad():
            clean_logits, kept = _run(capture, recorder, clean_ids, device, grad=True)
            _check_residual(kept, len(places))
            m_clean = metric(clean_logits)
            if method == "eap":
                gradients = gradients_of(m_clean, kept)
            else:
                clean_embeds = _embeddings(self.model, clean_ids, device)
                gradients = None
                for k in range(1, steps + 1):
                    between = torch.lerp(corrupt_embeds, clean_embeds, k / steps)  # the last: the clean inputs exactly
                    step_logits, step_kept = _run(capture, recorder, clean_ids, device, grad=True, embeds=between)
                    found = gradients_of(metric(step_logits), step_kept)
                    gradients = found if gradients is None else gradients + found
                clean_gradients = found  # the last step's inputs are the clean ones exactly: EAP's gradient
                gradients = gradients / steps
            dla = self._dla(kept, self._writes(kept, last=True), answers, distractors, m_clean.detach())
        at = None if roles is None else torch.tensor([[p.positions[r] for r in roles] for p in chunk], device=device)
        changes = self._changes(corrupt_kept, kept)
        scores, by_role = _products(self.graph, changes, gradients, at)
        eap = None if method == "eap" else _products(self.graph, changes, clean_gradients)[0]
        return {
            "scores": scores.cpu().numpy(),
            **({} if by_role is None else {"by_role": by_role.cpu().numpy()}),
            **({} if eap is None else {"eap": eap.cpu().numpy()}),
            "dla": dla.cpu().numpy(),
            "clean": m_clean.detach().double().cpu().numpy(),
            "corrupt": metric(corrupt_logits).double().cpu().numpy(),
        }

    def _writes(self, kept, *, last: bool = False) -> torch.Tensor:
        """(senders, rows, t, hidden) float32, in graph order (embed, then per layer its heads and its MLP): what
        each sender writes into the residual stream (last: at the last position only, t = 1); a head of a layer
        with a post-attention norm: what it writes into the norm (W_h z_h)."""
        at = slice(-1, None) if last else slice(None)
        writes = [kept["r"][0][:, at].detach().float()]
        for layer, weight in enumerate(self.columns):
            writes += list(head_writes(kept["z"][layer][:, at], weight, self.heads, self.head_dim))
            writes.append(kept["mlp"][layer][:, at].detach().float())
        return torch.stack(writes)

    def _changes(self, corrupt, clean) -> torch.Tensor:
        """(rows, t, senders, hidden) float32, laid out by position for the products: each sender's change (its
        corrupt write minus its clean one) as the residual stream sees it. A head's: W_h (z_h corrupt - z_h clean);
        behind a post-attention norm P, that times P's Jacobian at the clean run (EAP's direct path runs through
        P's full Jacobian)."""
        rows, t, hidden = clean["r"][0].shape
        change = torch.empty(rows, t, len(self.graph.senders), hidden, device=self.device)

        def difference(name, layer):
            return corrupt[name][layer].detach().float() - clean[name][layer].detach().float()

        change[:, :, 0] = difference("r", 0)
        for layer, (place, weight) in enumerate(zip(self.places, self.columns, strict=True)):
            first = 1 + layer * (self.heads + 1)
            heads = slice(first, first + self.heads)
            moved = difference("z", layer).view(rows, t, self.heads, self.head_dim)
            written = torch.einsum("rthd,mhd->rthm", moved, weight.view(hidden, self.heads, self.head_dim))
            if place.post_attention is not None:
                written = norm_jvp(place.post_attention, clean["attn"][layer], written.permute(2, 0, 1, 3))
                written = written.permute(1, 2, 0, 3)
            change[:, :, heads] = written
            change[:, :, first + self.heads] = difference("mlp", layer)
        return change

    def _dla(self, kept, writes, answers, distractors, m: torch.Tensor) -> torch.Tensor:
        """(rows, senders + 1) float64: each sender's write at the last position through the norms after it, their
        scales frozen at the clean run (a post-attention norm's, then the final norm's), on W_U[answer] -
        W_U[distractor]; last, the biases' (the output projections', the norms', the LM head's). With softcapped
        logits, every component times m / (the components' sum), the softcap's secant at the clean run, so that
        they add up to m."""
        final_in = kept["final"][0].detach()[:, -1:]  # (rows, 1, hidden): the last position
        final_norm = self.recorder.final_norm
        with torch.no_grad():
            frozen = FrozenNorm(final_norm, final_in, final_norm(final_in))
        last = writes[:, :, -1].double().transpose(0, 1).clone()  # (rows, senders, hidden)
        biases = torch.zeros(last.shape[0], last.shape[2], dtype=torch.float64, device=last.device)  # (rows, hidden)
        for layer, place in enumerate(self.places):
            bias = getattr(place.output, "bias", None)
            bias = torch.zeros_like(biases[0]) if bias is None else bias.detach().double()
            if place.post_attention is None:
                biases = biases + bias
                continue
            o = kept["attn"][layer].detach()[:, -1:]
            with torch.no_grad():
                post = FrozenNorm(place.post_attention, o, place.post_attention(o))
            first = 1 + layer * (self.heads + 1)
            last[:, first : first + self.heads] = post(last[:, first : first + self.heads])
            biases = biases + post(bias.expand(len(biases), 1, -1))[:, 0] + post.bias
        unembed = self.model.get_output_embeddings()
        weight = unembed.weight.detach().double()
        direction = weight[answers] - weight[distractors]  # (rows, hidden)
        dla = (frozen(last) * direction[:, None, :]).sum(-1)  # (rows, senders)
        bias_term = ((frozen(biases[:, None])[:, 0] + frozen.bias) * direction).sum(-1)
        head_bias = getattr(unembed, "bias", None)
        if head_bias is not None:
            bias_term = bias_term + head_bias.detach().double()[answers] - head_bias.detach().double()[distractors]
        found = torch.cat([dla, bias_term[:, None]], dim=1)
        if self.softcap:
            total = found.sum(1, keepdim=True)
            found = found * torch.where(total == 0, 1.0, m.double()[:, None] / total)
        return found


def _targets(chunk, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([p.answer_id for p in chunk], device=device),
            torch.tensor([p.distractor_id for p in chunk], device=device))  # fmt: skip


def _run(capture, recorder: Recorder, ids: list[list[int]], device, *, grad: bool, embeds=None):
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


def _receiver_gradients(metric, kept, places, heads, kv_heads, head_dim) -> torch.Tensor:
    """(rows, t, receivers, hidden) float32: the metric's gradient with respect to the residual stream where each
    receiver reads it, through that receiver's channel alone (graph order). One backward pass gives the gradient at
    each projection's output and at each MLP's input; a channel's, through its rows of the projection (a product
    with the weight) and then the input norm; the MLP's, through its input norm (each norm run again on copies of
    its input, one backward for all of a layer's channels). An MLP that reads the stream itself (no input norm)
    gets a backward pass of its own."""
    depth = len(places)
    fused = places[0].fused is not None
    wanted = [kept["q"][layer] for layer in range(depth)]
    if not fused:
        wanted += [kept[name][layer] for name in ("k", "v") for layer in range(depth)]
    wanted += [kept["reads" if place.mlp_norm is not None else "mlp"][layer] for layer, place in enumerate(places)]
    wanted.append(kept["final"][0])
    grads = torch.autograd.grad(metric.sum(), wanted, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wanted, grads, strict=True)]
    rows, t, hidden = kept["r"][0].shape
    per_layer = heads + 2 * kv_heads + 1
    found = torch.empty(rows, t, depth * per_layer + 1, hidden, device=kept["r"][0].device)
    for layer, place in enumerate(places):
        if fused:  # GPT-2's c_attn: q | k | v in one projection
            channels = [(grads[layer], linear_weight(place.fused), heads + 2 * kv_heads)]
        else:
            channels = [
                (grads[layer + depth * index], linear_weight(getattr(place, name)), units)
                for index, (name, units) in enumerate((("q", heads), ("k", kv_heads), ("v", kv_heads)))
            ]
        pre = []  # per channel: (rows, t, units, hidden), the gradient at the norm's output
        for grad, weight, units in channels:
            per_unit = grad.float().view(rows, t, units, head_dim)
            pre.append(torch.einsum("rtud,udm->rtum", per_unit, weight.detach().float().view(units, head_dim, -1)))
        start = layer * per_layer
        found[:, :, start : start + per_layer - 1] = norm_back(place.input_norm, kept["r"][layer],
                                                                   torch.cat(pre, dim=2))  # fmt: skip
        at_mlp = grads[-depth - 1 + layer]
        if place.mlp_norm is not None:
            found[:, :, start + per_layer - 1] = norm_back(place.mlp_norm, kept["h"][layer], at_mlp[:, :, None])[
                :, :, 0
            ]
        else:
            (through_mlp,) = torch.autograd.grad(kept["mlp"][layer], kept["h"][layer], grad_outputs=at_mlp,
                                                  retain_graph=True)  # fmt: skip
            found[:, :, start + per_layer - 1] = through_mlp.float()
    found[:, :, -1] = grads[-1].float()  # the logits read the final norm's input directly
    return found


def _check_residual(kept, layer_count: int) -> None:
    """What the model adds is what the graph adds: r + P_attn(o) is the stream the MLP reads, and that plus the
    MLP's write the next layer's input (edge_layers). Else refused: attention beside the MLP (GPT-J) or a residual
    multiplier (Granite) adds something else."""
    for layer in range(layer_count):
        r, attention, h = (kept[name][layer].detach().double() for name in ("r", "post", "h"))
        scale = r.abs().max() + attention.abs().max() + 1e-30
        if (r + attention - h).abs().max() > NORM_CHECK * scale:
            raise ConfigError(
                f"layer {layer}'s attention output does not reach the MLP's input as it is (attention in parallel "
                "with the MLP, or a residual multiplier): circuit does not take this architecture yet"
            )
        if layer + 1 < layer_count:
            following = kept["r"][layer + 1].detach().double()
            mlp = kept["mlp"][layer].detach().double()
            if (h + mlp - following).abs().max() > NORM_CHECK * (h.abs().max() + mlp.abs().max() + 1e-30):
                raise ConfigError(f"layer {layer}'s MLP output does not reach the next layer as it is (a residual "
                                  "multiplier): circuit does not take this architecture yet")  # fmt: skip


def _products(graph: Graph, change: torch.Tensor, gradients: torch.Tensor, at: torch.Tensor | None = None):
    """(rows, senders, receivers) float64: sum over positions and features of change (rows, t, senders, hidden) times
    gradients (rows, t, receivers, hidden), 0 where there is no edge; and with `at` (rows, roles) positions, the
    products at each row's role positions alone, (rows, roles, senders, receivers) float32 (else None). Senders and
    receivers are in the order of the computation, so each receiver reads a prefix of the senders: the products run
    receiver group by receiver group over that prefix only (about half of all pairs). Each position's sum over the
    hidden features is a float32 product (within gamma_hidden of its terms' magnitudes: 3.4e-5 of them at SmolLM2's
    576), the positions added in float64."""
    rows, t, senders, hidden = change.shape
    by_position = change.view(rows * t, senders, hidden)
    read_by_position = gradients.view(rows * t, -1, hidden)
    scores = torch.zeros(rows, senders, len(graph.receivers), dtype=torch.float64, device=change.device)
    by_role = None
    if at is not None:
        by_role = torch.zeros(rows, at.shape[1], senders, len(graph.receivers), device=change.device)
        row_index = torch.arange(rows, device=change.device)[:, None]
    reads = graph.edges.sum(0)  # each receiver's prefix of senders
    start = 0
    while start < len(graph.receivers):
        end = start
        while end < len(graph.receivers) and reads[end] == reads[start]:
            end += 1
        prefix = int(reads[start])
        if prefix:
            products = torch.bmm(read_by_position[:, start:end], by_position[:, :prefix].transpose(1, 2))
            per_position = products.view(rows, t, end - start, prefix)
            scores[:, :prefix, start:end] = per_position.sum(1, dtype=torch.float64).transpose(1, 2)
            if by_role is not None:
                by_role[:, :, :prefix, start:end] = per_position[row_index, at].transpose(2, 3)
        start = end
    return scores, by_role


def _embeddings(model, ids: list[list[int]], device) -> torch.Tensor:
    """What the model's embedding module returns for these rows (before any position embedding or scaling)."""
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids, device=device)).detach()
