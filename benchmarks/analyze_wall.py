"""Wall-clock seconds of `headscope.analyze` on SmolLM2 (CPU, float32), model loaded once, one unmeasured warm-up:
on one text of --tokens tokens (as benchmarks/lengths.py builds it) or on the shipped corpus. To compare two
versions, run it once per checkout, interleaved, in fresh processes:

    python benchmarks/analyze_wall.py --tokens 8192 --runs 2
    PYTHONPATH=/tmp/before python benchmarks/analyze_wall.py --tokens 8192 --runs 2     # another checkout
    python benchmarks/analyze_wall.py --corpus --runs 5 --threads 1   # one thread: far less noise on a shared VM
    python benchmarks/analyze_wall.py --corpus --runs 5 --threads 1 --exemplars 0   # what the exemplars cost

A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lengths import sentence_of

import headscope
from headscope.model.loading import load_model, quiet_transformers
from headscope.run.corpus import SHIPPED_CORPUS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="length of the one text")
    parser.add_argument("--corpus", action="store_true", help="the shipped corpus instead of one text")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--exemplars", type=int, default=None, help="analyze's --exemplars (default: its own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    model = load_model("smollm2", device="cpu", dtype="float32")
    if args.corpus:
        texts, options = SHIPPED_CORPUS.read_text(encoding="utf-8").splitlines(), {}
    else:
        texts = [sentence_of(model.tokenizer, args.tokens)[0]]
        options = {"max_length": args.tokens, "sentence_heads": False, "probes": False}
    if args.exemplars is not None:
        options["exemplars"] = args.exemplars

    def run() -> float:
        start = time.perf_counter()
        headscope.analyze(model, texts, charts=None, page=False, **options)
        return time.perf_counter() - start

    run()  # warm-up: first calls, checks, kernels
    seconds = [run() for _ in range(args.runs)]
    print(f"headscope from {headscope.__file__}")
    print("seconds:", ", ".join(f"{s:.2f}" for s in seconds))
    print(
        f"min {min(seconds):.2f}  median {statistics.median(seconds):.2f}  ({torch.get_num_threads()} threads, "
        f"exemplars {options.get('exemplars', 'default')})"
    )


if __name__ == "__main__":
    main()
