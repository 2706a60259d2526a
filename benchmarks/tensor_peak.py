"""Live-tensor peak against resident peak: what the floor and headscope hold in tensors on one SmolLM2 text.

    python benchmarks/tensor_peak.py --tokens 1024

For each approach of lengths.py (floor, headscope), after a warm-up run: one run under torch's profiler
(`profile_memory=True`), its tensor allocations and frees replayed in time order for the largest amount live at
once, and three runs' resident peaks (VmHWM above the run's start, as lengths.py measures). Where the two peaks
differ by much more than the live tensors do, the difference is memory the allocator kept, not memory in use.
"""

from __future__ import annotations

import argparse

from bench import PeakMemory
from lengths import floor_runner, headscope_runner, sentence_of
from torch.profiler import ProfilerActivity, profile

from headscope.model.loading import load_model, quiet_transformers


def live_tensor_peak(run) -> int:
    """The largest number of bytes torch's CPU tensors held at once during `run()`."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        run()
    changes = sorted(
        (event.time_range.start, event.self_cpu_memory_usage)
        for event in profiler.events()
        if event.self_cpu_memory_usage != 0
    )
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device="cpu", dtype="float32")
    text, ids = sentence_of(loaded.tokenizer, args.tokens)
    runners = {"floor": floor_runner(loaded.model, ids), "headscope": headscope_runner(loaded, text, args.tokens)}
    print(f"`python benchmarks/tensor_peak.py --tokens {args.tokens}`\n")
    print("| approach | live-tensor peak (MiB) | resident peaks, three runs (MiB) |\n|---|---:|---|")
    for name, run in runners.items():
        run()
        tensors = live_tensor_peak(run)
        resident = []
        for _ in range(3):
            with PeakMemory(loaded.device) as memory:
                run()
            resident.append(f"{memory.peak / 2**20:.0f}")
        print(f"| {name} | {tensors / 2**20:.1f} | {', '.join(resident)} |")


if __name__ == "__main__":
    main()
