"""Activation patching throughput: patched runs (one head patched on one pair) per second, and heads per second.

    python benchmarks/patching.py --layers 20-23 --threads 2                 # exact, output, 4 layers
    python benchmarks/patching.py --what values --layers 20-23 --threads 2
    python benchmarks/patching.py --fast --threads 2                         # attribution patching, every head
    python benchmarks/patching.py --layers 20-23 --baseline --threads 2      # one plain forward per head

--baseline times what a hook-based tool does for `output` patching: the clean prompts' head outputs recorded once,
then one whole forward of the corrupt prompts per head (all pairs batched, transformers' own attention, logits at
every position) with a pre-hook on the output projection putting the head's clean slice in.

Loads SmolLM2 once (outside the timing), then times `headscope.patch` on the shipped IOI pairs
(corpora/ioi-pairs.jsonl) with bootstrap 0 and no output folder. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import headscope
from headscope.arguments import parse_layers
from headscope.model.loading import load_model, quiet_transformers

PAIRS = Path(__file__).resolve().parents[1] / "corpora" / "ioi-pairs.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--pairs", default=str(PAIRS))
    parser.add_argument("--layers", default=None, help="default: every layer")
    parser.add_argument("--what", default="output")
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers(show_progress=False)
    loaded = load_model(args.model, device=args.device, dtype="float32", lm_head=True)
    layers = parse_layers(args.layers) if args.layers else None
    if args.baseline:
        return baseline(loaded, args.pairs, layers or tuple(range(loaded.architecture["layers"])))
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        found = headscope.patch(loaded, args.pairs, what=args.what, fast=args.fast, layers=layers, bootstrap=0,
                                charts=None)  # fmt: skip
        seconds.append(time.perf_counter() - started)
    best = min(seconds)
    record = found.record
    runs = record["units"] * record["pairs"]["count"]
    print(json.dumps({
        "model": args.model, "device": str(loaded.device), "what": args.what, "method": record["method"],
        "heads": record["heads_patched"], "pairs": record["pairs"]["count"], "seconds": round(best, 2),
        "forwards": record["timing"]["forwards"], "patched_runs_per_second": round(runs / best, 1),
        "heads_per_second": round(record["heads_patched"] / best, 3),
    }))  # fmt: skip


def baseline(loaded, pairs_path: str, layers) -> None:
    from headscope.interventions.pairs import read_pairs, tokenize_pairs
    from headscope.model.batch import collate

    pairs = tokenize_pairs(read_pairs(pairs_path), loaded.tokenizer, None)
    clean = collate([0] * len(pairs), [p.clean_ids for p in pairs], padding_side="left")
    corrupt = collate([0] * len(pairs), [p.corrupt_ids for p in pairs], padding_side="left")
    heads, dim = loaded.architecture["heads"], loaded.architecture["head_dim"]
    decoder = loaded.lm.model.layers
    kept = {}
    started = time.perf_counter()
    with torch.inference_mode():
        hooks = [
            decoder[layer].self_attn.o_proj.register_forward_pre_hook(
                lambda module, args, layer=layer: kept.__setitem__(layer, args[0].clone())
            )
            for layer in layers
        ]
        loaded.lm(input_ids=clean.input_ids, attention_mask=clean.attention_mask, position_ids=clean.position_ids)
        for hook in hooks:
            hook.remove()
        for layer in layers:
            for head in range(heads):
                columns = slice(head * dim, (head + 1) * dim)

                def put(module, args, layer=layer, columns=columns):
                    patched = args[0].clone()
                    patched[..., columns] = kept[layer][..., columns]
                    return (patched,)

                hook = decoder[layer].self_attn.o_proj.register_forward_pre_hook(put)
                loaded.lm(input_ids=corrupt.input_ids, attention_mask=corrupt.attention_mask,
                          position_ids=corrupt.position_ids)  # fmt: skip
                hook.remove()
    seconds = time.perf_counter() - started
    count = len(layers) * heads
    print(json.dumps({"baseline": "one plain forward per head", "heads": count, "pairs": len(pairs),
                      "seconds": round(seconds, 2), "heads_per_second": round(count / seconds, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
