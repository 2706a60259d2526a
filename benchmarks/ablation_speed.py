"""Exact per-head ablation throughput on SmolLM2 and the shipped corpus: head-token ablations per second.

    python benchmarks/ablation_speed.py --layers 0,15,29 --threads 2 --repeats 3

Runs `analyze --importance exact` on the chosen layers (probes, intervals and per-sentence tables off) and reports
the importance phase's seconds, and (corpus tokens x heads ablated x 2 modes) / seconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

import headscope
from headscope.loading import load_model, quiet_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="0,15,29")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device="cpu", dtype="float32", lm_head=True)
    layers = tuple(int(x) for x in args.layers.split(","))
    seconds = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            report = headscope.analyze(
                loaded, out=f"{folder}/r", importance="exact", layers=layers, probes=False, bootstrap=0,
                sentence_heads=False, examples=0, charts=None, page=False,
            )  # fmt: skip
            total = time.perf_counter() - started
            seconds.append(report.run["timings"]["importance_seconds"])
    tokens = report.run["corpus"]["tokens"]
    heads = len(layers) * report.run["model"]["architecture"]["heads"]
    best = min(seconds)
    print(
        json.dumps(
            {
                "layers": layers,
                "threads": args.threads,
                "importance_seconds": [round(s, 2) for s in seconds],
                "head_token_ablations_per_s": round(tokens * heads * 2 / best),
                "corpus_tokens": tokens,
                "last_run_seconds": round(total, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
