"""Where an analysis of the shipped corpus spends its time: cProfile over a few analyses of SmolLM2 (model loaded
once, one unmeasured warm-up), the cumulative seconds of the capture's attention calls and of the measures.

    python benchmarks/profile_measures.py                      # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/profile_measures.py --runs 3   # another version

A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import headscope
from headscope.model.loading import load_model, quiet_transformers
from headscope.run.corpus import SHIPPED_CORPUS

WATCHED = ("attend", "head_row_sums", "head_output", "run_probes", "measure_corpus", "example_views")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    quiet_transformers(show_progress=False)
    model = load_model("smollm2", device="cpu", dtype="float32")
    sentences = SHIPPED_CORPUS.read_text(encoding="utf-8").splitlines()
    headscope.analyze(model, sentences, charts=None, page=False)  # warm-up: first calls, checks, kernels
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.runs):
        headscope.analyze(model, sentences, charts=None, page=False)
    profile.disable()
    print(f"headscope from {headscope.__file__}")
    print(f"{args.runs} analyses: {time.perf_counter() - start:.2f} s (under the profiler)")
    stats = pstats.Stats(profile).stats
    for name in WATCHED:
        found = [entry[3] for (path, _, function), entry in stats.items() if function == name and "headscope" in path]
        seconds = sum(found)
        print(f"  {name:16s} {seconds:7.2f} s")


if __name__ == "__main__":
    main()
