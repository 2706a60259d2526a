"""How much of a run is host work: headscope against a bare pipeline on a model that costs almost nothing.

The model is GPT-2-shaped but tiny (2 layers, 32 wide, 2 heads, random weights, a word-level tokenizer from
the shipped corpus), so the forward pass is cheap and whatever else a run does (reading, tokenizing,
batching, collating, statistics, tables) shows. The corpus is the 100 shipped sentences repeated to --sentences.

bare:      read the lines, one tokenizer call, sort by length, pad batches of 256 with torch, sdpa forward
           under inference_mode; no headscope code at all.
headscope: headscope.analyze on the same file with the model already loaded (eager attention, every
           statistic, the bootstrap, the per-sentence tables built in a temporary folder), no probes, no
           charts: corpus in, numbers out.

Both run interleaved, --repeats times each; the medians are reported. Usage:

    python benchmarks/pipeline.py --sentences 20000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import headscope
from headscope.model.loading import load_model

CORPUS = Path(__file__).resolve().parent.parent / "corpora" / "english-100.txt"
BATCH = 256


def tiny_gpt2(folder: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GPT2Config, GPT2Model, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0}
    for word in CORPUS.read_text(encoding="utf-8").split():
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    torch.manual_seed(0)
    GPT2Model(GPT2Config(vocab_size=len(vocab), n_layer=2, n_embd=32, n_head=2)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bare(model, tokenizer, path: Path, device: torch.device) -> int:
    """The least a run must do: tokenize, sort, pad, forward."""
    texts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    tokens = 0
    with torch.inference_mode():
        for first in range(0, len(order), BATCH):
            rows = [ids[i] for i in order[first : first + BATCH]]
            width = max(len(r) for r in rows)
            input_ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for row, r in enumerate(rows):
                input_ids[row, : len(r)] = torch.tensor(r)
                mask[row, : len(r)] = 1
            model(input_ids=input_ids.to(device), attention_mask=mask.to(device))
            tokens += sum(len(r) for r in rows)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        folder = tiny_gpt2(Path(scratch) / "tiny")
        lines = CORPUS.read_text(encoding="utf-8").splitlines()
        corpus = Path(scratch) / "corpus.txt"
        corpus.write_text("\n".join((lines * (args.sentences // len(lines) + 1))[: args.sentences]) + "\n")

        loaded = load_model(str(folder), device=args.device)
        from transformers import AutoModel

        sdpa = AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval().to(loaded.device)
        seconds = {"bare": [], "headscope": []}
        tokens = {}
        for _ in range(args.repeats):
            started = time.perf_counter()
            tokens["bare"] = bare(sdpa, loaded.tokenizer, corpus, loaded.device)
            seconds["bare"].append(time.perf_counter() - started)
            started = time.perf_counter()
            result = headscope.analyze(loaded, corpus, probes=False, charts=None, batch_size=BATCH)
            seconds["headscope"].append(time.perf_counter() - started)
            tokens["headscope"] = int(result.run["corpus"]["tokens"])
        assert tokens["bare"] == tokens["headscope"], tokens

    median = {name: statistics.median(values) for name, values in seconds.items()}
    threads = torch.get_num_threads()
    print(f"{args.sentences:,} sentences, {tokens['bare']:,} tokens, {loaded.device}, {threads} threads")
    print("| pipeline | seconds (median) | tokens/s | × bare |")
    print("|---|---:|---:|---:|")
    for name in ("bare", "headscope"):
        rate = tokens[name] / median[name]
        print(f"| {name} | {median[name]:.2f} | {rate:,.0f} | {median['bare'] / median[name]:.2f} |")


if __name__ == "__main__":
    main()
