"""Exact per-head ablation throughput on SmolLM2 and the shipped corpus: head-token ablations per second.

    python benchmarks/ablation_speed.py --layers 0,29 --threads 2 --repeats 2

Times `measures.importance.measure_importance` on the chosen layers with exact=False (the gradient pass) and
exact=True (the gradient pass, then every head zero- and mean-ablated); the ablation's seconds are the
difference, and its rate is corpus tokens x heads x 2 modes / those seconds. Run it against another checkout with
PYTHONPATH=that/checkout to compare versions.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headscope.config import RunConfig
from headscope.interventions.importance import measure_importance
from headscope.model.capture import attached
from headscope.model.loading import load_model, quiet_transformers
from headscope.model.memory import default_budget
from headscope.progress import NullReporter
from headscope.run.corpus import default_corpus_path, read_corpus
from headscope.run.feed import CorpusFeed
from headscope.run.plan import resolve_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,29")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device="cpu", dtype="float32", lm_head=True)
    layers = tuple(int(x) for x in args.layers.split(","))
    settings = RunConfig(importance="exact", layers=layers)
    budget = default_budget(loaded.device)
    plan = resolve_plan(settings, loaded.model.config, dtype=loaded.dtype, device_type="cpu", budget=budget)
    feed = CorpusFeed(
        read_corpus(default_corpus_path()), loaded.tokenizer, max_length=None, chunk_sentences=4096, keep=True
    )

    def batches():
        return plan.batches(feed, "importance", loaded.device)

    seconds = {False: [], True: []}
    with attached(loaded.lm) as capture:
        for _ in range(args.repeats):
            for exact in (False, True):
                started = time.perf_counter()
                measure_importance(
                    capture, batches, layer_ids=layers, heads=plan.heads, head_dim=plan.architecture["head_dim"],
                    exact=exact, replicas_per_forward=lambda b: plan.replica_tokens // b.input_ids.numel(),
                    reporter=NullReporter(),
                )  # fmt: skip
                seconds[exact].append(time.perf_counter() - started)
    ablation = min(seconds[True]) - min(seconds[False])
    tokens = sum(len(ids) for ids in feed.chunk(0).ids)
    heads = len(layers) * plan.heads
    print(
        json.dumps(
            {
                "layers": layers,
                "threads": args.threads,
                "gradient_pass_s": round(min(seconds[False]), 2),
                "with_ablation_s": round(min(seconds[True]), 2),
                "ablation_s": round(ablation, 2),
                "head_token_ablations_per_s": round(tokens * heads * 2 / ablation),
                "corpus_tokens": tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
