"""copying(): what each head's weights copy, with no data: the OV copying score (measures/ov_copying.py) of every
head, the norms' gains folded in.

    the map    K_h = W_V^h G_in (W_E^T W_U G_f) G_post W_O^h, (head_dim, head_dim): W_E the token embeddings, G_in
               the gain of the norm the attention reads, G_post a post-attention norm's (Gemma 2 and 3, OLMo 2),
               G_f the final norm's, W_U the LM head (the embeddings where they are tied); W_V^h the value rows of
               the head's KV head, W_O^h its output columns
    the score  sum(lambda) / sum(|lambda|) over K_h's eigenvalues (M = W_U ... W_E's non-zero ones)

Left out, as Elhage et al. leave them: each norm's 1/rms (a positive scale per token), LayerNorm's centring,
biases and position embeddings. A positive scale of the whole circuit (Gemma's sqrt(hidden) on the embeddings)
changes no score: the ratio is the same for M and s M. Where the pieces sit is found as `circuit` finds them
(interventions/edge_layers.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from headscope.config import RunConfig
from headscope.errors import ConfigError
from headscope.interventions.edge_layers import FrozenNorm, find_places, head_columns
from headscope.measures.ov_copying import copying_scores, token_map
from headscope.model.capture import attached
from headscope.model.loading import LoadedModel, Loader, load_for_run
from headscope.model.write_path import dry_ids
from headscope.progress import Reporter
from headscope.run.setup import CommandRun, record_header

DEFINITION = "sum(eigenvalues) / sum(|eigenvalues|) of W_U G_f G_post W_O^h W_V^h G_in W_E^T (Elhage et al. 2021)"


@dataclass
class Copying:
    """What `copying` found: `heads` (layer, head, kv_head, ov_copying) and `record`."""

    heads: pd.DataFrame
    record: dict

    def __repr__(self) -> str:
        return f"Copying(model={self.record['model']['input']!r}, {len(self.heads)} heads)"

    def _repr_html_(self) -> str:
        """In a notebook: the heads that copy most and those that suppress most."""
        from headscope.report.notebook import block, facts, table

        ordered = self.heads.sort_values("ov_copying", ascending=False)
        rows = [(r.layer, r.head, f"{r.ov_copying:+.3f}") for r in (*ordered.head(8).itertuples(),
                                                                     *ordered.tail(8).itertuples())]  # fmt: skip
        return block(
            f"headscope copying: {self.record['model']['input']}",
            facts(
                [
                    ("score", DEFINITION),
                    ("unembedding", self.record["unembedding"]),
                    ("embedding scale", self.record["embedding_scale"]),
                ]
            ),
            table(["layer", "head", "ov_copying"], rows, caption="the most copying and the most suppressing heads"),
        )

    def to_html(self) -> str:
        return self._repr_html_()


def copying(
    model: str | LoadedModel,
    *,
    tokens: Sequence[int] | None = None,
    config: RunConfig | None = None,
    reporter: Reporter | None = None,
    loader: Loader = load_for_run,
    **options: object,
) -> Copying:
    """Every head's OV copying score, from the weights alone.

    Args:
        model: hub id, local folder, .gguf path, alias, or an already loaded model (its LM head, where the
            embeddings are not tied).
        tokens: the token ids the OV circuit maps between (default: the whole vocabulary).
        config: the settings as a RunConfig (device, dtype...).
        reporter: progress and notes.
        loader: loads the model.
        **options: RunConfig fields by name.

    Returns:
        A Copying: heads (layer, head, kv_head, ov_copying) and the record.
    """
    run = CommandRun.prepare(model, config=config, options=options, reporter=reporter, reads_corpus=False)
    with run.session(model, loader, what="copying", lm_head="if-present") as opened:
        loaded, plan = opened.loaded, opened.plan
        architecture = plan.architecture
        heads, kv_heads, head_dim = (architecture[key] for key in ("heads", "kv_heads", "head_dim"))
        with attached(loaded.lm or loaded.model) as capture, torch.no_grad():
            network = loaded.lm or loaded.model
            probe = dry_ids(network.get_input_embeddings().num_embeddings).tolist()
            places, final_norm = find_places(capture, network, capture.decoder, heads, kv_heads, head_dim, probe,
                                             loaded.device)  # fmt: skip
            embed, unembed, where = _token_matrices(loaded, tokens)
            hidden = embed.shape[1]
            tokens_map = token_map(embed, unembed) * _gain(final_norm, hidden, embed)[None, :]
            scores = []
            for place in places:
                gain_in = _gain(place.input_norm, hidden, embed)
                gain_post = _gain(place.post_attention, hidden, embed)
                values = _value_rows(place, heads, kv_heads, head_dim)  # (heads, head_dim, hidden)
                outputs = head_columns(place.output).double().view(hidden, heads, head_dim).permute(1, 0, 2)
                scores.append(copying_scores(values * gain_in, tokens_map, gain_post[:, None] * outputs))
    found = np.stack(scores)  # (layers, heads)
    layers = len(places)
    frame = pd.DataFrame({"layer": np.repeat(np.arange(layers), heads), "head": np.tile(np.arange(heads), layers),
                          "kv_head": np.tile(np.arange(heads) // (heads // kv_heads), layers),
                          "ov_copying": found.reshape(-1)})  # fmt: skip
    record = record_header(loaded, run.settings, ("device", "dtype"), None) | {
        "definition": DEFINITION,
        "unembedding": where,
        "tokens": "every token" if tokens is None else len(embed),
    }
    run.done(opened)
    return Copying(frame, record)


def _token_matrices(loaded, tokens) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(W_E, W_U, where W_U came from), restricted to `tokens`."""
    network = loaded.lm or loaded.model
    embed = network.get_input_embeddings().weight.detach()
    head = loaded.lm.get_output_embeddings() if loaded.lm is not None else None
    if head is not None:
        unembed, where = head.weight.detach(), "the LM head"
    elif getattr(network.config, "tie_word_embeddings", False):
        unembed, where = embed, "the token embeddings (tied)"
    else:
        raise ConfigError(f"{loaded.source.display} has no LM head loaded and untied embeddings: the OV circuit needs "
                          "the unembedding")  # fmt: skip
    if tokens is not None:
        chosen = torch.as_tensor(list(tokens), dtype=torch.long, device=embed.device)
        if len(chosen) == 0 or int(chosen.min()) < 0 or int(chosen.max()) >= len(embed):
            raise ConfigError(f"tokens must be ids in [0, {len(embed)}); got {len(chosen)} ids")
        embed, unembed = embed[chosen], unembed[chosen]
    return embed, unembed, where


def _gain(norm, hidden: int, like: torch.Tensor) -> torch.Tensor:
    """(hidden,) float64: a norm's gain g (LayerNorm's or an RMS norm's, g or 1 + w), read by fitting it on a probe;
    ones where there is no norm."""
    if norm is None:
        return torch.ones(hidden, dtype=torch.float64, device=like.device)
    probe = torch.randn(1, 1, hidden, generator=torch.Generator().manual_seed(0)).to(like.device)
    parameter = next(norm.parameters(), None)
    probe = probe.to(parameter.dtype) if parameter is not None else probe
    return FrozenNorm(norm, probe, norm(probe)).gain.double()


def _value_rows(place, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """(heads, head_dim, hidden) float64: each query head's KV head's rows of the value projection."""
    if place.fused is not None:  # GPT-2's c_attn: q | k | v, weight (in, out)
        weight = place.fused.weight.detach().T[2 * heads * head_dim :]
    else:
        weight = place.v.weight.detach()
    per_kv = weight.double().view(kv_heads, head_dim, -1)
    return per_kv[torch.arange(heads, device=per_kv.device) // (heads // kv_heads)]
