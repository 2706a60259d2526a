"""What analyze's defaults cost on the three workloads a default meets, against a bare sdpa forward, in one run:

    long-1024   one 1,024-token text on SmolLM2 (float32, CPU)
    long-8192   one 8,192-token text on SmolLM2
    sentences   20,000 short sentences (the shipped corpus repeated) on a near-free model: GPT-2-shaped, 2 layers,
                32 wide, 2 heads, random weights (benchmarks/pipeline.py's), so that host work shows
    corpus      the shipped corpus (100 sentences) on SmolLM2 (with --each-default)

Each workload runs, interleaved --repeats times: the bare forward (the model's own sdpa forward over the same
tokens: pipeline.py's `bare` for the sentences, tokenizing, sorting and padding included), `analyze` with
`exemplars=0`, and `analyze` with its defaults (plus --extra settings to try another). Reported: median seconds and
× the bare forward (its median over analyze's). analyze runs as a new user meets it on a long text:
`headscope.analyze(loaded, [text], bootstrap=0, probes=False, sentence_heads=False, charts=None, page=False,
max_length=n)`, and on the sentences `headscope.analyze(loaded, corpus, probes=False, charts=None, page=False)`.

    python benchmarks/defaults.py                                  # all three, 3 repeats
    python benchmarks/defaults.py --workloads long-1024 --repeats 5
    python benchmarks/defaults.py --each-default --workloads corpus,long-8192,sentences   # each default's cost
    python benchmarks/defaults.py --each-default --features far_mass --threads 1          # one default's cost

With --each-default, analyze runs with every default on (`headscope.analyze(loaded, texts, max_length=n)` for a long
text: no files, so no charts or page) and with each default-on feature turned off alone (EACH_DEFAULT); a feature's
cost is how much longer the run with it takes than the run without it.

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
from headscope.run.corpus import SHIPPED_CORPUS

WORKLOADS = ("long-1024", "long-8192", "sentences")
# Every feature analyze runs by default (RunConfig), and the option that turns it off.
EACH_DEFAULT = {"exemplars": {"exemplars": 0}, "probes": {"probes": False}, "copying": {"copying": False},
                "bootstrap": {"bootstrap": 0}, "sentence_heads": {"sentence_heads": False},
                "check_dormant": {"check_dormant": False}, "far_mass": {"stream_window": 0}}  # fmt: skip


def long_text(loaded, length: int, every_default: bool = False):
    """(bare forward, analyze with options) on one `length`-token text: as the issue measured it, or (every_default)
    with every default on."""
    text, ids = sentence_of(loaded.tokenizer, length)
    common = {"charts": None, "page": False}
    if not every_default:
        common |= {"bootstrap": 0, "probes": False, "sentence_heads": False}

    def analyze(**options) -> None:
        headscope.analyze(loaded, [text], max_length=length, **common, **options)

    return floor_runner(loaded.model, ids), analyze


def shipped_corpus(loaded):
    """(bare forward, analyze with options) on the shipped corpus (100 sentences) with every default on."""

    def floor() -> None:
        loaded.model.set_attn_implementation("sdpa")
        bare(loaded.model, loaded.tokenizer, SHIPPED_CORPUS, loaded.device)

    def analyze(**options) -> None:
        headscope.analyze(loaded, SHIPPED_CORPUS, charts=None, page=False, **options)

    return floor, analyze


def sentences(scratch: Path, count: int, every_default: bool = False):
    """(bare forward, analyze with options) on `count` short sentences through the near-free model (the probes off,
    as the issue measured it, unless every_default)."""
    folder = tiny_gpt2(scratch / "tiny")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    corpus = scratch / "corpus.txt"
    corpus.write_text("\n".join((lines * (count // len(lines) + 1))[:count]) + "\n")
    loaded = load_model(str(folder), device="cpu")
    from transformers import AutoModel

    sdpa = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()

    def analyze(**options) -> None:
        common = {"charts": None, "page": False} | ({} if every_default else {"probes": False})
        headscope.analyze(loaded, corpus, **common, **options)

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
    parser.add_argument("--each-default", action="store_true", help="each default turned off alone (EACH_DEFAULT)")
    parser.add_argument(
        "--features",
        default=",".join(EACH_DEFAULT),
        help="with --each-default: only these",
    )
    args = parser.parse_args()
    unknown = set(args.features.split(",")) - set(EACH_DEFAULT)
    if unknown:
        parser.error(f"--features: no default named {', '.join(sorted(unknown))} (one of {', '.join(EACH_DEFAULT)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        smollm2 = None
        for workload in args.workloads.split(","):
            if workload == "sentences":
                floor, analyze = sentences(Path(scratch), args.sentences, args.each_default)
            elif workload == "corpus":
                smollm2 = smollm2 or load_model("smollm2", device="cpu", dtype="float32")
                floor, analyze = shipped_corpus(smollm2)
            else:
                smollm2 = smollm2 or load_model("smollm2", device="cpu", dtype="float32")
                floor, analyze = long_text(smollm2, int(workload.split("-")[1]), args.each_default)
            runs = {"sdpa forward": floor, "exemplars=0": functools.partial(analyze, exemplars=0), "defaults": analyze}
            if args.each_default:
                features = args.features.split(",")
                runs = {"sdpa forward": floor, "defaults": analyze}
                runs |= {f"without {name}": functools.partial(analyze, **EACH_DEFAULT[name]) for name in features}
            for run in runs.values():  # warm-up: first calls, checks, kernels
                run()
            seconds = {name: [] for name in runs}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    seconds[name].append(timed(run))
            floor_median = statistics.median(seconds["sdpa forward"])
            everything = statistics.median(seconds["defaults"])
            for name, values in seconds.items():
                median = statistics.median(values)
                cost = f"{everything / median - 1:+.1%}" if name.startswith("without") else ""
                rows.append((workload, name, median, floor_median / median, cost, values))
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    print("| workload | run | seconds (median) | × sdpa forward | the feature's cost | runs (s) |")
    print("|---|---|---:|---:|---:|---|")
    for workload, name, median, ratio, cost, values in rows:
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {workload} | {name} | {median:.2f} | {ratio:.2f} | {cost} | {runs} |")


if __name__ == "__main__":
    main()
