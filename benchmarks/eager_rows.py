"""Short texts: the eager path's row statistics reduced by headscope's C++ kernel against torch, on one SmolLM2 text.

    python benchmarks/eager_rows.py                      # 128 tokens, 15 interleaved repeats
    python benchmarks/eager_rows.py --tokens 64 --repeats 25

Three approaches on the same text, interleaved (this machine's speed drifts between runs; interleaving spreads the
drift over all three): the floor (the base model's sdpa forward, as in lengths.py), `headscope.analyze` as the
kernel is chosen (already built: it reduces every layer's probabilities), and the same analysis with the kernel
treated as not built yet (torch reduces them; `cpu_kernel.is_built` answered False for that run). Reported: each
one's median seconds and its ratio to the floor's median.
"""

from __future__ import annotations

import argparse
import statistics

from bench import timed_interleaved
from lengths import floor_runner, headscope_runner, sentence_of

from headscope.model.attention import cpu_kernel
from headscope.model.loading import load_model, quiet_transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device="cpu", dtype="float32")
    text, ids = sentence_of(loaded.tokenizer, args.tokens)
    if isinstance(cpu_kernel.row_state_module(), str):  # built (once per machine) before anything is timed
        raise SystemExit("the C++ kernel cannot be built here: nothing to compare")
    with_kernel = headscope_runner(loaded, text, args.tokens)
    built = cpu_kernel.is_built

    def with_torch() -> int:
        cpu_kernel.is_built = lambda isa=None: False
        try:
            return with_kernel()
        finally:
            cpu_kernel.is_built = built

    runners = {"floor": floor_runner(loaded.model, ids), "kernel": with_kernel, "torch": with_torch}
    seconds, _ = timed_interleaved(runners, args.repeats)
    floor = statistics.median(seconds["floor"])
    print(f"`python benchmarks/eager_rows.py --tokens {args.tokens} --repeats {args.repeats}`\n")
    print("| approach | median seconds | × floor |\n|---|---:|---:|")
    for name, runs in seconds.items():
        print(f"| {name} | {statistics.median(runs):.3f} | {floor / statistics.median(runs):.2f} |")


if __name__ == "__main__":
    main()
