"""Long context side by side: one SmolLM2 sentence of each length, four ways, throughput and peak memory.

    python benchmarks/lengths.py                                  # 128, 1,024, 4,096, 8,192 tokens, 3 repeats
    python benchmarks/lengths.py --lengths 8192 --repeats 5

Approaches, interleaved on the same token ids (one sentence, batch of one):
    floor              the base model's plain forward pass with sdpa (no LM head, no attention weights)
    headscope          headscope.analyze through its Python API (no files, no probes, no per-sentence table)
    output_attentions  AutoModelForCausalLM(..., attn_implementation="eager")(..., output_attentions=True), then
                       the same per-head statistics from the returned tensors
    run_with_cache     what TransformerLens's run_with_cache(names_filter=hook_pattern) does, without the
                       package: a forward hook on every attention module keeps its pattern in a cache dict
                       for the whole pass, then the same statistics from the cache
Approaches that would hold every layer's (heads, t, t) probabilities are skipped, with the size they would need,
when that exceeds half of the machine's available memory.

Reported: tokens per second (median of the repeats), its ratio to the floor, peak memory above the pre-run
baseline (CPU: the kernel's peak resident set size, VmHWM, reset at each start; CUDA: torch's peak allocation),
median of the interleaved runs and, apart, of one run right after a run of the same approach. The first headscope
run of a process loads (or, the first time on a machine, builds) headscope's C++ kernel for the statistics, or
compiles the tile loop where the kernel does not apply: `first_run_seconds` says what that costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
from bench import CORPUS, PeakMemory, _causal_lm, attention_statistics, measure

import headscope
from headscope.model.batch import batches_in_order
from headscope.model.loading import load_model, quiet_transformers


def sentence_of(tokenizer, length: int) -> tuple[str, list[int]]:
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    text = " ".join(lines * (1 + length // 1000))  # ~1,300 tokens per copy of the corpus
    ids = tokenizer(text, truncation=True, max_length=length)["input_ids"]
    assert len(ids) == length, "the text is too short for this length"
    return text, ids


def floor_runner(model, ids: list[int]) -> Callable[[], int]:
    def run() -> int:
        model.set_attn_implementation("sdpa")
        with torch.inference_mode():
            for batch in batches_in_order({0: ids}, max_sentences=1, device=model.device):
                model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        return len(ids)

    return run


def headscope_runner(loaded, text: str, length: int) -> Callable[[], int]:
    def run() -> int:
        options = {"sentence_heads": False, "probes": False, "charts": None, "page": False}
        return int(headscope.analyze(loaded, [text], max_length=length, **options).run["corpus"]["tokens"])

    return run


def output_attentions_runner(causal_lm, ids: list[int]) -> Callable[[], int]:
    def run() -> int:
        with torch.inference_mode():
            for batch in batches_in_order({0: ids}, max_sentences=1, device=causal_lm.device):
                out = causal_lm(
                    input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, output_attentions=True
                )
                attention_statistics(out.attentions, batch).cpu()
        return len(ids)

    return run


def run_with_cache_runner(causal_lm, ids: list[int]) -> Callable[[], int]:
    """TransformerLens's pattern cache, re-created with forward hooks on the eager model's attention modules."""
    modules = [layer.self_attn for layer in causal_lm.model.layers]

    def run() -> int:
        cache: dict[str, torch.Tensor] = {}

        def keeper(i: int):
            return lambda module, args, out: cache.__setitem__(f"blocks.{i}.attn.hook_pattern", out[1])

        hooks = [module.register_forward_hook(keeper(i)) for i, module in enumerate(modules)]
        try:
            with torch.inference_mode():
                for batch in batches_in_order({0: ids}, max_sentences=1, device=causal_lm.device):
                    causal_lm.model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
                    patterns = [cache[f"blocks.{i}.attn.hook_pattern"] for i in range(len(modules))]
                    attention_statistics(patterns, batch).cpu()
        finally:
            for hook in hooks:
                hook.remove()
        return len(ids)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    quiet_transformers(show_progress=False)
    loaded = load_model("smollm2", device=args.device, dtype="float32" if args.device == "cpu" else "auto")
    causal_lm = _causal_lm(loaded)
    architecture = loaded.architecture
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        text, ids = sentence_of(loaded.tokenizer, length)
        started = time.perf_counter()
        headscope_runner(loaded, text, length)()  # compiles on the first long sentence; also warms the rest up
        first_run = time.perf_counter() - started
        runners = {"floor": floor_runner(loaded.model, ids), "headscope": headscope_runner(loaded, text, length)}
        held = 4 * architecture["layers"] * architecture["heads"] * length * length  # every layer's probabilities
        skipped = {}
        if held <= _available(loaded.device) / 2:
            runners["output_attentions"] = output_attentions_runner(causal_lm, ids)
            runners["run_with_cache"] = run_with_cache_runner(causal_lm, ids)
        else:
            skipped = {name: f"would hold {held / 2**30:.1f} GiB" for name in ("output_attentions", "run_with_cache")}
        measured = measure(runners, loaded.device, args.repeats, warm_up=False)
        for name, run in runners.items():
            measured[name]["peak_bytes_after_itself"] = peak_after_itself(run, loaded.device)
        rows.append({"tokens": length, "first_run_seconds": round(first_run, 1), **measured, "skipped": skipped})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    print(markdown(rows, loaded.device, args))


def peak_after_itself(run: Callable[[], int], device: torch.device) -> int:
    """Peak memory of a run right after a run of the same approach. In the interleaved runs a run's peak depends on
    what ran before it in the process (the heap the previous approach left: headscope at 4,096 tokens peaked 236 MiB
    above its baseline after itself, 348 MiB after a floor run); after itself, each approach meets its own heap."""
    run()
    with PeakMemory(device) as memory:
        run()
    return memory.peak


def _available(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo", encoding="ascii") as meminfo:  # Linux; the benchmarks' machines
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields["MemAvailable"].split()[0]) * 1024


def markdown(rows: list[dict], device: torch.device, args) -> str:
    threads = torch.get_num_threads()
    lines = [
        f"`python benchmarks/lengths.py --lengths {args.lengths} --repeats {args.repeats}` "
        f"({device.type}, torch {torch.__version__}, {threads} threads)",
        "",
        "| tokens | approach | tokens/s (median) | × floor | peak memory (MiB) | peak after itself (MiB) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        floor = row["floor"]["tokens_per_second"]
        for name in ("floor", "headscope", "output_attentions", "run_with_cache"):
            if name in row:
                rate, peak = row[name]["tokens_per_second"], row[name]["peak_bytes"] / 2**20
                alone = row[name]["peak_bytes_after_itself"] / 2**20
                lines.append(
                    f"| {row['tokens']:,} | {name} | {rate:,.0f} | {rate / floor:.2f} | {peak:,.0f} | {alone:,.0f} |"
                )
            else:
                lines.append(f"| {row['tokens']:,} | {name} | skipped: {row['skipped'][name]} | | | |")
    lines.append("")
    lines.append(
        "headscope's first run per length (compiling included): "
        + ", ".join(f"{row['tokens']:,} tokens {row['first_run_seconds']} s" for row in rows)
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
