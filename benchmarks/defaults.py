"""What analyze's defaults cost on the three workloads a default meets, against a bare sdpa forward, in one run:

    long-1024   one 1,024-token text on SmolLM2 (float32, CPU)
    long-8192   one 8,192-token text on SmolLM2
    sentences   20,000 short sentences (the shipped corpus repeated) on a near-free model: GPT-2-shaped, 2 layers,
                32 wide, 2 heads, random weights (benchmarks/pipeline.py's), so that host work shows

Each workload runs, interleaved --repeats times: the bare forward (the model's own sdpa forward over the same
tokens: pipeline.py's `bare` for the sentences, tokenizing, sorting and padding included), `analyze` with
`exemplars=0`, and `analyze` with its defaults (plus --extra settings to try another). Reported: median seconds and
× the bare forward (its median over analyze's). analyze runs as a new user meets it on a long text:
`headscope.analyze(loaded, [text], bootstrap=0, probes=False, sentence_heads=False, charts=None, page=False,
max_length=n)`, and on the sentences `headscope.analyze(loaded, corpus, probes=False, charts=None, page=False)`.

    python benchmarks/defaults.py                                  # all three, 3 repeats
    python benchmarks/defaults.py --workloads long-1024 --repeats 5

A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lengths import floor_runner, sentence_of
from pipeline import CORPUS, bare, tiny_gpt2

import headscope
from headscope.model.loading import load_model, quiet_transformers

WORKLOADS = ("long-1024", "long-8192", "sentences")


def long_text(loaded, length: int):
    """(bare forward, analyze with options) on one `length`-token text."""
    text, ids = sentence_of(loaded.tokenizer, length)
    common = {"bootstrap": 0, "probes": False, "sentence_heads": False, "charts": None, "page": False}

    def analyze(**options) -> None:
        headscope.analyze(loaded, [text], max_length=length, **common, **options)

    return floor_runner(loaded.model, ids), analyze


def sentences(scratch: Path, count: int):
    """(bare forward, analyze with options) on `count` short sentences through the near-free model."""
    folder = tiny_gpt2(scratch / "tiny")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    corpus = scratch / "corpus.txt"
    corpus.write_text("\n".join((lines * (count // len(lines) + 1))[:count]) + "\n")
    loaded = load_model(str(folder), device="cpu")
    from transformers import AutoModel

    sdpa = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()

    def analyze(**options) -> None:
        headscope.analyze(loaded, corpus, probes=False, charts=None, page=False, **options)

    return (lambda: bare(sdpa, loaded.tokenizer, corpus, loaded.device)), analyze


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sentences", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        smollm2 = None
        for workload in args.workloads.split(","):
            if workload == "sentences":
                floor, analyze = sentences(Path(scratch), args.sentences)
            else:
                smollm2 = smollm2 or load_model("smollm2", device="cpu", dtype="float32")
                floor, analyze = long_text(smollm2, int(workload.split("-")[1]))
            runs = {"sdpa forward": floor, "exemplars=0": functools.partial(analyze, exemplars=0), "defaults": analyze}
            for run in runs.values():  # warm-up: first calls, checks, kernels
                run()
            seconds = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    seconds[name].append(timed(run))
            floor_median = statistics.median(seconds["sdpa forward"])
            for name, values in seconds.items():
                median = statistics.median(values)
                rows.append((workload, name, median, floor_median / median, values))
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    print("| workload | run | seconds (median) | × sdpa forward | runs (s) |")
    print("|---|---|---:|---:|---|")
    for workload, name, median, ratio, values in rows:
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {workload} | {name} | {median:.2f} | {ratio:.2f} | {runs} |")


if __name__ == "__main__":
    main()
