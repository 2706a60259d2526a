"""Streaming heads on SmolLM2 and the shipped long texts: prune --mode window against one ablate --mode window, both
through the CLI in fresh processes one after the other (loading included in both), then the pruning's verified
loss recomputed independently (tests/support/reference_window.py: float64 attention with transformers' eager mask
and the window, one text at a time, no headscope):

    python benchmarks/streaming.py --max-length 2048
    python benchmarks/streaming.py --max-length 512 --layers 24-29

Prints each command's seconds and their ratio, the heads windowed and the KV heads freed (kv-policy.json), the
KV memory at the longest text and at the context length, and the independent loss beside prune's.
A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "headscope", *args], check=True, env=os.environ, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def independent_loss(model: str, corpus: Path, max_length: int, heads, sink: int, window: int) -> float:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    import headscope

    from reference_window import windowed_loss

    loaded = headscope.load_model(model, device="cpu", lm_head=True)
    texts = [line for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [loaded.tokenizer(text, truncation=True, max_length=max_length)["input_ids"] for text in texts]
    return windowed_loss(loaded.lm, ids, heads, sink=sink, window=window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", type=Path, default=REPO / "corpora" / "long-texts.txt")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--budget", default="0.05")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--layers", default=None, help="prune's --layers (default: every layer)")
    args = parser.parse_args()
    common = ["--corpus", str(args.corpus), "--max-length", str(args.max_length), "--mode", "window",
              "--window", str(args.window), "--sink", str(args.sink)]  # fmt: skip
    layers = ["--layers", args.layers] if args.layers else []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        ablate = timed(["ablate", args.model, "--heads", "0.0", *common, "--bootstrap", "0", "--out",
                        str(out / "ablate")])  # fmt: skip
        prune = timed(["prune", args.model, "--budget", args.budget, *common, *layers, "--out", str(out / "prune"),
                       "--no-charts"])  # fmt: skip
        record = json.loads((out / "prune" / "prune.json").read_text())
        policy = json.loads((out / "prune" / "kv-policy.json").read_text())
    heads = [tuple(int(part) for part in name.split(".")) for name in record["heads"]]
    ratio = prune / ablate
    print(f"ablate --heads 0.0: {ablate:.1f} s; prune --budget {args.budget}: {prune:.1f} s; ratio {ratio:.1f}")
    query, kv = policy["query_heads"], policy["kv_heads"]
    print(f"windowed {query['windowed']} of {query['total']} query heads ({query['share']:.1%}); KV heads whose cache "
          f"can shrink: {kv['windowed']} of {kv['total']} ({kv['share']:.1%})")  # fmt: skip
    for name, memory in policy["memory"].items():
        print(f"KV cache at {name} ({memory['tokens']} tokens): {memory['full_bytes'] / 2**20:.1f} MiB -> "
              f"{memory['policy_bytes'] / 2**20:.1f} MiB ({memory['freed_share']:.1%} freed)")  # fmt: skip
    search = record["search"]
    print(f"loss {record['clean_loss']:.6f} -> {record['pruned_loss']:.6f} ({record['delta']:+.4f}); rounds "
          f"{search['rounds']}, gradient passes {search['gradient_passes']}, stopped: {search['stopped']}")  # fmt: skip
    reference = independent_loss(args.model, args.corpus, args.max_length, heads, args.sink, args.window)
    print(
        f"independent loss with the {len(heads)} heads windowed: {reference:.6f} "
        f"(prune's {record['pruned_loss']:.6f}, difference {abs(reference - record['pruned_loss']):.2e})"
    )


if __name__ == "__main__":
    main()
