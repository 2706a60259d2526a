"""The exact patched passes of `circuit` (--verify, the faithfulness curve): the clean prompts run with chosen edges
carrying the corrupt prompt's write of their sender into their receiver, every other edge this pass's own write
(which the changed edges change downstream). Hooks on an EdgeModel's layers, one forward pass per set of edges."""

from __future__ import annotations

import torch

from headscope.interventions.edge_layers import head_writes, project
from headscope.model.batch import collate
from headscope.model.norms import through


def patched_logits(model, chunk, corrupt: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """The clean prompts' last logits on the EdgeModel `model`, the `excluded` edges carrying `corrupt` writes
    (senders, rows, t, hidden).

    Into each receiver, an excluded edge from a sender adds (corrupt - this pass's) write of it to the stream the
    receiver reads. Behind a post-attention norm P the layer's heads write through P together: the receiver
    reads P(o + the excluded heads' corrupt - this pass's W_h z_h) - P(o) in place of P(o), o this pass's
    output projection: every head outside those as this pass wrote it."""
    graph, heads, kv_heads, head_dim = model.graph, model.heads, model.kv_heads, model.head_dim
    receiver_index = {receiver: index for index, receiver in enumerate(graph.receivers)}
    sender_index = {sender: index for index, sender in enumerate(graph.senders)}
    senders = corrupt.shape[0]
    # Senders added to the stream as they are; a post-normed layer's heads, [(layer, first sender)], apart.
    behind_norm = [(layer, sender_index[f"{layer}.0"]) for layer, place in enumerate(model.places)
                   if place.post_attention is not None]  # fmt: skip
    plain = torch.ones(senders, dtype=torch.bool, device=excluded.device)
    for _, first in behind_norm:
        plain[first : first + heads] = False
    # corrupt - this pass's write, per sender, set as each sender writes; `written` sums the plain ones so far
    difference = corrupt.clone()
    written = torch.zeros_like(corrupt[0])
    edges = torch.as_tensor(graph.edges, device=excluded.device)
    kept, handles = {}, []

    def wrote(first: int, writes: torch.Tensor) -> None:
        difference[first : first + len(writes)] = corrupt[first : first + len(writes)] - writes
        if bool(plain[first]):
            written.add_(difference[first : first + len(writes)].sum(0))

    def change(receivers: list[int]) -> torch.Tensor | None:
        """(receivers, rows, t, hidden): what the excluded edges into each of them change, or None if none."""
        chosen = excluded[:, receivers]
        if not bool(chosen.any()):
            return None
        found = _plain_change(chosen & plain[:, None], edges[:, receivers] & plain[:, None], difference, written)
        for layer, first in behind_norm:
            block = chosen[first : first + heads]
            if not bool(block.any()):
                continue
            hit = block.any(0).nonzero()[:, 0]  # the receivers some of this layer's heads are excluded from
            flat = difference[first : first + heads].view(heads, -1)
            into = (block[:, hit].T.to(flat.dtype) @ flat).view(len(hit), *corrupt.shape[1:])
            o, norm = kept[("o", layer)], model.places[layer].post_attention
            found[hit] += (norm(o + into.to(o.dtype)) - norm(o)).float()
        return found

    for layer, (block, place) in enumerate(zip(model.decoder, model.places, strict=True)):

        def entering(module, args, kwargs, layer=layer):
            residual = args[0] if args else kwargs["hidden_states"]
            kept[("r", layer)] = residual
            if layer == 0:
                wrote(0, residual.detach().float()[None])

        handles.append(block.register_forward_pre_hook(entering, with_kwargs=True))

        def heads_written(module, args, layer=layer):
            wrote(sender_index[f"{layer}.0"], head_writes(args[0], model.columns[layer], heads, head_dim))

        def output_made(module, args, output, layer=layer):
            kept[("o", layer)] = output

        handles.append(place.output.register_forward_pre_hook(heads_written))
        handles.append(place.output.register_forward_hook(output_made))

        def mlp_written(module, args, output, layer=layer):
            wrote(sender_index[f"mlp{layer}"], output.detach().float()[None])

        handles.append((place.post_mlp or place.mlp).register_forward_hook(mlp_written))
        # The attention's inputs: each receiver channel of the layer reads its own changed stream.
        width = heads * head_dim
        # (channel, head or group, receiver name, where the channel's features start in a fused q|k|v output)
        fused = place.fused is not None
        channels = [("q", head, f"{layer}.{head}", 0) for head in range(heads)]
        channels += [(channel, group, f"{layer}.kv{group}", width if channel == "k" else 2 * width)
                     for channel in ("k", "v") for group in range(kv_heads)]  # fmt: skip
        by_module = {}
        for channel, unit, name, offset in channels:
            module = place.fused if fused else getattr(place, channel)
            start = (offset if fused else 0) + unit * head_dim
            read = (receiver_index[(name, channel)], slice(start, start + head_dim))
            by_module.setdefault(module, []).append(read)
        # Every channel of the layer's attention reads the stream as the layer began: their changes are one product
        # (the senders' changes read once for q, k and v together, not once per projection), kept for the others.
        attention_reads = [index for reads in by_module.values() for index, _ in reads]
        modules, first_row = len(by_module), 0
        for module, reads in by_module.items():
            rows = slice(first_row, first_row + len(reads))  # this module's reads: its run of attention_reads
            first_row = rows.stop

            def reading(module, args, output, layer=layer, reads=reads, rows=rows, every=attention_reads,
                        modules=modules):  # fmt: skip
                if ("change", layer) not in kept:
                    kept[("change", layer)] = [change(every), modules]
                held = kept[("change", layer)]
                everything = held[0]
                held[1] -= 1
                if held[1] == 0:  # the layer's last projection: the changes are not kept past it
                    del kept[("change", layer)]
                if everything is None:
                    return None
                found = everything[rows]
                live = found.flatten(1).any(1).nonzero()[:, 0].tolist()  # the channels some edge changes
                if not live:
                    return None
                residual = kept[("r", layer)]
                normed = through(model.places[layer].input_norm, residual + found[live].to(residual.dtype))
                features = [reads[index][1] for index in live]
                output = output.clone()
                for features_of, projected in zip(features, project(module, normed, features), strict=True):
                    output[..., features_of] = projected
                return output

            handles.append(module.register_forward_hook(reading))
        mlp_index = receiver_index[(f"mlp{layer}", "")]

        def mlp_reads(module, args, layer=layer, mlp_index=mlp_index):
            found = change([mlp_index])
            if found is None:
                return None
            norm = model.places[layer].mlp_norm
            h = args[0] if norm is None else kept[("h", layer)]
            return (through(norm, h + found[0].to(h.dtype)),)

        def mlp_stream(module, args, layer=layer):
            kept[("h", layer)] = args[0]

        if place.mlp_norm is not None:
            handles.append(place.mlp_norm.register_forward_pre_hook(mlp_stream))
        handles.append(place.mlp.register_forward_pre_hook(mlp_reads))

    logits_index = receiver_index[("logits", "")]

    def final_reads(module, args):
        found = change([logits_index])
        return None if found is None else (args[0] + found[0].to(args[0].dtype),)

    handles.append(model.recorder.final_norm.register_forward_pre_hook(final_reads))
    try:
        batch = collate(list(range(len(chunk))), [p.clean_ids for p in chunk]).to(model.device)
        return model.capture.run(batch).logits[:, -1]
    finally:
        for handle in handles:
            handle.remove()


def _plain_change(chosen: torch.Tensor, edges: torch.Tensor, difference: torch.Tensor, written: torch.Tensor):
    """(receivers, rows, t, hidden): the sum, into each receiver, over its `chosen` edges of (corrupt - this
    pass's) sender write, taken over the fewer of the edges it chooses and those it keeps (then as everything written
    so far, every earlier plain sender's, minus those)."""
    flat = difference.view(difference.shape[0], -1)
    kept_edges = edges & ~chosen
    if int(chosen.sum()) <= int(kept_edges.sum()):
        rows = chosen.any(1).nonzero()[:, 0]
        found = chosen[rows].T.to(flat.dtype) @ flat[rows]
    else:
        rows = kept_edges.any(1).nonzero()[:, 0]
        found = written.view(1, -1) - kept_edges[rows].T.to(flat.dtype) @ flat[rows]
    return found.view(chosen.shape[1], *difference.shape[1:])
