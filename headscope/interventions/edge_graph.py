"""The graph `circuit` scores and the maths of its circuits (docs/circuit.md has the definitions).

The graph. Senders write into the residual stream: `embed`, each head `L.H` and each MLP `mlpL`. Receivers read it:
each query head's query input (`L.H`, channel q), each key-value head's key and value inputs (`L.kvG`, channels k and
v), each MLP's input (`mlpL`) and the logits. An edge joins a sender to every receiver that reads after it: layer L's
heads and MLP read every sender of the layers before; layer L's MLP also reads layer L's heads; the logits read every
sender.

A circuit is a set of edges; every edge outside it carries the corrupt prompt's sender. Its faithfulness is
(m with the circuit - m corrupt) / (m clean - m corrupt); the curve runs over circuits of the strongest edges, and CPR
and CMD are its areas (MIB, Mueller et al. 2025).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The faithfulness curve's circuits, as shares of the edges (MIB's sizes from 0.1%; the empty circuit and the full one
# are 0 and 1 by definition, and cost no pass): nine patched passes.
CURVE_SHARES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


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


def ranked_edges(graph: Graph, mean_scores: np.ndarray) -> np.ndarray:
    """(edges, 2) sender and receiver indices of every edge, strongest |mean score| first (ties in graph order)."""
    senders, receivers = np.nonzero(graph.edges)
    order = np.argsort(-np.abs(mean_scores[senders, receivers]), kind="stable")
    return np.stack([senders[order], receivers[order]], axis=1)


def greedy_edges(graph: Graph, mean_scores: np.ndarray) -> np.ndarray:
    """(edges, 2) sender and receiver indices in the order MIB's greedy growth adds them (Mueller et al. 2025; the
    EAP-IG code's `apply_greedy`): from the logits up, the strongest |mean score| edge into a node already in the
    circuit, each edge's sender joining the circuit and its inputs' edges joining the candidates (a head's query, and
    its KV head's key and value; an MLP's input). The circuit of n edges is the first n: connected to the logits by
    construction. Edges no node of the circuit reads come last, strongest first."""
    senders, receivers = graph.senders, graph.receivers
    receiver_index = {receiver: index for index, receiver in enumerate(receivers)}
    group = graph.heads // graph.kv_heads
    inputs = {}  # sender -> the receivers where it reads (none for embed)
    for sender, name in enumerate(senders):
        if name.startswith("mlp"):
            inputs[sender] = [receiver_index[(name, "")]]
        elif name != "embed":
            layer, head = (int(part) for part in name.split("."))
            kv = f"{layer}.kv{head // group}"
            inputs[sender] = [receiver_index[(name, "q")], receiver_index[(kv, "k")], receiver_index[(kv, "v")]]
    strength = np.abs(mean_scores)
    candidates, opened, joined, order = [], set(), set(), []

    def open_receiver(receiver: int) -> None:
        if receiver in opened:
            return
        opened.add(receiver)
        for sender in np.nonzero(graph.edges[:, receiver])[0]:
            heapq.heappush(candidates, (-strength[sender, receiver], int(sender), receiver))

    open_receiver(len(receivers) - 1)  # the logits
    while candidates:
        _, sender, receiver = heapq.heappop(candidates)
        order.append((sender, receiver))
        if sender not in joined:
            joined.add(sender)
            for reads in inputs.get(sender, []):
                open_receiver(reads)
    taken = set(order)
    rest = [tuple(edge) for edge in ranked_edges(graph, mean_scores) if tuple(edge) not in taken]
    return np.array(order + rest, dtype=np.int64).reshape(-1, 2)


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
