"""How much a circuit costs against the passes it cannot do without, on SmolLM2 and the shipped IOI pairs.

    python benchmarks/circuit.py --repeats 2

floor:  one forward and one backward pass over every pair (the clean prompts, the metric summed, its gradient with
        respect to the embeddings' output), batched as circuit batches them, under headscope's capture
eap:    every edge's score and every component's DLA (EdgeModel.scores, method eap: a corrupt pass, a clean pass with
        gradients, the receivers' vector-Jacobian products)
eap-ig: the same with --steps 5
curve:  the nine patched passes of the faithfulness curve (EdgeModel.patched)
Medians of --repeats; seconds and the ratio to the floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from headscope.config import RunConfig
from headscope.interventions.edge_graph import CURVE_SHARES, circuit_size, outside, ranked_edges
from headscope.interventions.edges import EdgeModel
from headscope.interventions.pairs import read_pairs, tokenize_pairs
from headscope.model.batch import collate
from headscope.model.capture import attached
from headscope.model.loading import load_model, quiet_transformers
from headscope.run.plan import plan_for_model

PAIRS = Path(__file__).resolve().parent.parent / "corpora" / "ioi-pairs.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device="cpu", dtype="float32", lm_head=True)
    pairs = tokenize_pairs(read_pairs(PAIRS), loaded.tokenizer, None)
    plan = plan_for_model(RunConfig(), loaded)
    seconds = {"floor": [], "eap": [], "eap-ig": [], "curve": []}
    with attached(loaded.lm) as capture:
        model = EdgeModel(capture, loaded, plan, pairs[0])
        for _ in range(args.repeats):
            started = time.perf_counter()
            for chunk in model.batches(pairs):
                batch = collate(list(range(len(chunk))), [p.clean_ids for p in chunk])
                with torch.enable_grad():
                    logits = capture.run(batch, grad=True).logits[:, -1]
                    answers = torch.tensor([p.answer_id for p in chunk])
                    distractors = torch.tensor([p.distractor_id for p in chunk])
                    metric = logits.gather(1, answers[:, None]) - logits.gather(1, distractors[:, None])
                    metric.sum().backward()
            seconds["floor"].append(time.perf_counter() - started)
            for method in ("eap", "eap-ig"):
                started = time.perf_counter()
                found = model.scores(pairs, method=method, steps=5)
                seconds[method].append(time.perf_counter() - started)
            graph = model.graph
            ranked = ranked_edges(graph, found.scores.mean(0))
            sizes = sorted({circuit_size(share, graph.edge_count) for share in CURVE_SHARES})
            started = time.perf_counter()
            model.patched(pairs, [outside(graph, ranked, size) for size in sizes])
            seconds["curve"].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"SmolLM2, {len(pairs)} pairs, {graph.edge_count:,} edges, {torch.get_num_threads()} threads")
    print("| pass | seconds (median) | x floor |")
    print("|---|---:|---:|")
    for name, value in median.items():
        print(f"| {name} | {value:.2f} | {value / median['floor']:.1f} |")
    print(f"(curve: {len(sizes)} circuits; edges scored per second by eap: {graph.edge_count / median['eap']:,.0f})")
    assert np.isfinite(found.scores).all()


if __name__ == "__main__":
    main()
