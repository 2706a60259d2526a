"""Peak working memory of head importance against its budget (--max-memory).

    python benchmarks/importance_memory.py                       # SmolLM2: every case below
    python benchmarks/importance_memory.py --budgets 2GiB --cases long

Each case runs `headscope.analyze(..., importance=MODE, max_memory=BUDGET)` on SmolLM2 loaded once with its LM
head, and reports the peak memory above the loaded model (CPU: resident set size sampled every 2 ms; CUDA:
torch's peak allocation), against the budget. Exact ablation is run on one layer (--layers 17): the memory of
one ablation forward does not depend on how many layers are ablated, only the time does.

Cases: `shipped`, the 100 shipped sentences (5-30 tokens); `long`, one sentence of 1,548 tokens.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF de-quantizer's progress bar
import sys
from pathlib import Path

import torch

import headscope
from headscope.arguments import parse_bytes
from headscope.model.loading import load_model, quiet_transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import PeakMemory

CORPUS = Path(__file__).resolve().parent.parent / "corpora" / "english-100.txt"


def cases(tokenizer) -> dict[str, list[str]]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    text, words = "", " ".join(lines).split()
    while len(tokenizer(text)["input_ids"]) < 1548:
        text += " ".join(words[:50]) + " "
        words = words[50:] + words[:50]
    ids = tokenizer(text)["input_ids"][:1548]
    return {"shipped": lines, "long": [tokenizer.decode(ids, skip_special_tokens=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="1GiB,2GiB,4GiB", help="--max-memory values, comma-separated")
    parser.add_argument("--cases", default="shipped,long")
    parser.add_argument("--modes", default="fast,exact")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device=args.device, dtype="float32", lm_head=True)
    texts = cases(loaded.tokenizer)
    print("| case | tokens | mode | budget (MiB) | peak above the model (MiB) | within budget |")
    print("|---|---:|---|---:|---:|---|")
    for case in args.cases.split(","):
        for mode in args.modes.split(","):
            for budget in args.budgets.split(","):
                options = {"layers": (17,)} if mode == "exact" else {}
                try:
                    with PeakMemory(loaded.device) as memory:
                        report = headscope.analyze(
                            loaded, texts[case], importance=mode, max_memory=parse_bytes(budget), probes=False,
                            bootstrap=0, sentence_heads=False, charts=None, **options,
                        )  # fmt: skip
                    tokens = report.run["corpus"]["tokens"]
                    peak = memory.peak
                    print(
                        f"| {case} | {tokens:,} | {mode} | {parse_bytes(budget) / 2**20:,.0f} | {peak / 2**20:,.0f} | "
                        f"{'yes' if peak <= parse_bytes(budget) else 'NO'} |",
                        flush=True,
                    )
                except headscope.HeadscopeError as err:
                    size = parse_bytes(budget) / 2**20
                    print(f"| {case} | - | {mode} | {size:,.0f} | refused: {err} | - |", flush=True)
                if loaded.device.type == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
