"""One attention layer: sdpa against headscope's C++ kernel (output and row statistics, and statistics alone).

    python benchmarks/kernel_layer.py                          # 1,024, 4,096 and 8,192 tokens, 11 repeats
    python benchmarks/kernel_layer.py --lengths 8192 --repeats 21

SmolLM2-135M's attention shape (9 query heads reading 3 KV heads of 64 dimensions), one sentence of random float32
queries, keys and values, causal, on the CPU; the kernel folds the key points of headscope's default band (window
2) and, with values, writes the finished output into a (batch, t, heads, head_dim) tensor it is given, scaling the
logits itself, as in a run; the three approaches interleaved, each run once unmeasured first.
Reported per approach: the median and the minimum of the repeats' wall-clock seconds and of the process's CPU
seconds (both threads), and the ratio of the kernel's median and minimum to sdpa's. On a shared machine the
minimum is the steadier figure: interference only ever adds time.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench import timed_interleaved

from headscope.model.attention import cpu_kernel

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
WINDOW = 2  # headscope's default --window


def approaches(module, length: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, HEADS, length, HEAD_DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=generator) for _ in range(2))
    positions, first_key = torch.arange(length), torch.zeros(1, dtype=torch.long)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    common = {"window": WINDOW, "scaling": HEAD_DIM**-0.5}

    def kernel():  # the output allocated per call, as sdpa's is
        out = torch.empty(1, length, HEADS, HEAD_DIM)
        return module.row_state(query, key, value, positions, first_key, None, 0.0, out=out, **common)

    return {
        "sdpa": lambda: sdpa(query, key, value, is_causal=True, enable_gqa=True),
        "kernel": kernel,
        "kernel, statistics only": lambda: module.row_state(
            query, key, None, positions, first_key, None, 0.0, **common
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    module = cpu_kernel.row_state_module()
    if isinstance(module, str):
        raise SystemExit(f"the kernel could not be built: {module}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cpu_kernel.host_isa()}")
    for length in map(int, args.lengths.split(",")):
        runs = approaches(module, length)
        wall, cpu = timed_interleaved(runs, args.repeats)
        print(f"\n{length:,} tokens, {args.repeats} repeats (seconds: median / minimum)")
        floor = wall["sdpa"]
        for name in runs:
            ratio = statistics.median(wall[name]) / statistics.median(floor), min(wall[name]) / min(floor)
            print(
                f"  {name:24} wall {statistics.median(wall[name]):.4f} / {min(wall[name]):.4f}"
                f"  cpu {statistics.median(cpu[name]):.4f} / {min(cpu[name]):.4f}"
                f"  x sdpa {ratio[0]:.2f} / {ratio[1]:.2f}"
            )


if __name__ == "__main__":
    main()
