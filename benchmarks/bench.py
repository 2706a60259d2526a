"""Throughput and peak memory of headscope against the plain forward pass and the usual alternatives.

    python benchmarks/bench.py                      # everything, 3 interleaved repeats, CPU or CUDA
    python benchmarks/bench.py --models gpt2 --workloads long --repeats 5
    python benchmarks/bench.py --only-lengths --lengths 1024,4096,8192   # peak memory of one long sentence
    python benchmarks/bench.py --only-costs --cost-sizes 100,10000       # what probes and intervals cost

Approaches, run interleaved in one process on the same texts (each tokenizes them itself):
    floor             the base model's plain forward pass, no attention weights, with the faster of
                      sdpa and eager on this machine (both are measured; the table names the winner)
    headscope         headscope.analyze through its Python API (no files written; same batch size as the rest)
    output_attentions the seed's approach: AutoModelForCausalLM(..., output_attentions=True), then the
                      same per-head statistics from the returned tensors
    transformerlens   HookedTransformer.run_with_cache(names_filter=hook_pattern) on the GPT-2 model,
                      then the same statistics (skipped, with the reason, if transformer_lens is missing)
Reported: tokens per second (median), its ratio to the floor, and peak memory above the pre-run
baseline (CPU: the kernel's peak resident set size, VmHWM, reset at each start; CUDA: torch's peak allocation).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import headscope
from headscope.measures.row_sums import head_row_sums
from headscope.model.architecture import model_max_length
from headscope.model.batch import batches_in_order
from headscope.model.loading import load_model, quiet_transformers
from headscope.model.masks import causal_visible_keys

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "corpora" / "english-100.txt"


# ---------------------------------------------------------------- memory


class PeakMemory:
    """Peak memory of the block above what was in use when it started.

    CPU: the kernel's own high-water mark of the resident set (VmHWM), reset to the current size at the start by
    writing 5 to /proc/self/clear_refs (Linux 4.0+): exact, and no thread runs beside the work. Where that is not
    allowed, the resident set sampled every 2 ms by a thread (which misses spikes shorter than that; it slowed
    128-token runs of the floor and of headscope alike, by 2-3%).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        _trim_heap()
        self._base = _rss()
        if _reset_high_water_mark():
            return self
        self._stop = threading.Event()
        self._max = self._base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._max = max(self._max, _rss())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        if self._thread is None:
            self.peak = _high_water_mark() - self._base
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self._max, _rss()) - self._base


def _reset_high_water_mark() -> bool:
    """Reset the kernel's peak resident set size (VmHWM) to the current one; False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _high_water_mark() > 0


def _high_water_mark() -> int:
    """The peak resident set size since the last reset (VmHWM), in bytes; 0 where /proc does not say."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _trim_heap() -> None:
    """Give freed memory back to the OS so each run starts from a comparable baseline (glibc only)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---------------------------------------------------------------- models and workloads


def word_tokenizer(words: list[str]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0}
    for word in words:
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")


def gpt2_folder(folder: Path, n_layer: int, words: list[str]) -> Path:
    """GPT-2 small's shape (768 wide, 12 heads), random weights, an LM head, a word-level tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = word_tokenizer(words)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_layer=n_layer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def workloads(tokenizer, names: list[str]) -> dict[str, list[str]]:
    """name -> texts; `long` texts are cut to exactly 1,024 tokens by max_length."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    words = [w for line in lines for w in line.split()]
    rng = np.random.default_rng(0)
    out = {}
    if "shipped" in names:
        out["shipped"] = lines
    if "sentences" in names:
        out["sentences"] = [" ".join(rng.choice(words, size=rng.integers(4, 46))) for _ in range(2000)]
    for name, count, length in (("long", 16, 1024), ("long4096", 4, 4096)):
        if name in names:
            long_texts = []
            for _ in range(count):
                text = ""
                while len(tokenizer(text)["input_ids"]) < length + 76:
                    text += " " + " ".join(rng.permutation(lines)[:20])
                long_texts.append(text.strip())
            out[name] = long_texts
    return out


MAX_LENGTH = {"long4096": 4096}  # tokens per text; every other workload is cut at 1,024
BATCH = {"long": 4, "long4096": 1}  # sentences per forward pass; 16 for the short workloads


# ---------------------------------------------------------------- approaches


def token_ids(tokenizer, texts: list[str], max_length: int) -> dict[int, list[int]]:
    ids = tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
    return dict(enumerate(ids))


def forward_kwargs(batch) -> dict:
    """A plain forward pass's arguments, with explicit positions (as headscope passes them)."""
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "use_cache": False,
    }


def floor_runner(model, implementation: str, tokenize, batch_size: int) -> Callable[[], int]:
    def run() -> int:
        model.set_attn_implementation(implementation)
        ids = tokenize()
        tokens = 0
        with torch.inference_mode():
            for batch in batches_in_order(ids, max_sentences=batch_size, device=model.device):
                model(**forward_kwargs(batch))
                tokens += batch.n_tokens
        return tokens

    return run


def headscope_runner(loaded, texts, max_length: int, batch_size: int) -> Callable[[], int]:
    # The same batch size as the other approaches, so that memory is compared for the same work per forward.
    def run() -> int:
        result = headscope.analyze(loaded, texts, max_length=max_length, batch_size=batch_size, charts=None)
        return int(result.run["corpus"]["tokens"])

    return run


def attention_statistics(attentions, batch) -> torch.Tensor:
    """The same per-head sums headscope keeps, from a tuple of (batch, heads, t, t) tensors."""
    valid = batch.attention_mask.bool()
    visible = causal_visible_keys(valid)
    return torch.stack(
        [
            head_row_sums(attn, key_visible=visible, query_valid=valid, seq_start=batch.seq_start, window=2)
            for attn in attentions
        ]
    )


def output_attentions_runner(causal_lm, tokenize, batch_size: int) -> Callable[[], int]:
    def run() -> int:
        causal_lm.set_attn_implementation("eager")
        ids = tokenize()
        tokens = 0
        with torch.inference_mode():
            for batch in batches_in_order(ids, max_sentences=batch_size, device=causal_lm.device):
                out = causal_lm(**forward_kwargs(batch), output_attentions=True)
                attention_statistics(out.attentions, batch).cpu()
                tokens += batch.n_tokens
        return tokens

    return run


def transformerlens_runner(loaded, tokenize, batch_size: int) -> tuple[Callable[[], int] | None, str]:
    """TransformerLens 4's TransformerBridge around its own copy of the causal LM (it hooks the model it wraps)."""
    try:
        from transformer_lens import TransformerBridge
    except ImportError as err:
        return None, f"transformer_lens not importable ({err})"
    bridge = TransformerBridge.boot_transformers(
        loaded.source.location, hf_model=_causal_lm(loaded), tokenizer=loaded.tokenizer, device=loaded.device
    )
    n_layers = loaded.architecture["layers"]

    def run() -> int:
        ids = tokenize()
        tokens = 0
        with torch.inference_mode():
            for batch in batches_in_order(ids, max_sentences=batch_size, device=loaded.device):
                _, cache = bridge.run_with_cache(
                    batch.input_ids,
                    attention_mask=batch.attention_mask,
                    names_filter=lambda name: name.endswith("hook_pattern"),
                )
                patterns = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(n_layers)]
                attention_statistics(patterns, batch).cpu()
                tokens += batch.n_tokens
        return tokens

    return run, ""


# ---------------------------------------------------------------- driver


def timed_interleaved(
    runners: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each runner once unmeasured, then all interleaved `repeats` times: every run's wall-clock seconds and the
    process's CPU seconds (all threads), per runner. No memory sampler: timings of short runs alone."""
    for run in runners.values():
        run()
    wall: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    return wall, cpu


def measure(
    runners: dict[str, Callable[[], int]], device: torch.device, repeats: int, *, warm_up: bool = False
) -> dict[str, dict]:
    """Interleave the runners `repeats` times; medians of tokens/s and of peak memory.

    The median of three or more runs drops the first run's one-off costs; with fewer, `warm_up` runs each
    runner once unmeasured first (the first forward pass pages in memory-mapped weights, which would
    otherwise be charged to whichever approach runs first).
    """
    if warm_up:
        for run in runners.values():
            run()
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            with PeakMemory(device) as memory:
                start = time.perf_counter()
                tokens = run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            samples[name].append((tokens / seconds, memory.peak))
    return {
        name: {
            "tokens_per_second": statistics.median(rate for rate, _ in values),
            "peak_bytes": statistics.median(peak for _, peak in values),
            "runs": [round(rate, 1) for rate, _ in values],
        }
        for name, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,smollm2")
    parser.add_argument("--workloads", default="shipped,sentences,long", help="also: long4096 (SmolLM2; for CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--depths", default="6,12,24", help="GPT-2 depths for the memory-vs-depth check ('' skips)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--only-depths", action="store_true", help="run only the memory-vs-depth check")
    parser.add_argument("--lengths", default="", help="SmolLM2 peak memory on one sentence of each length ('' skips)")
    parser.add_argument("--only-lengths", action="store_true", help="run only the memory-vs-length check")
    parser.add_argument("--cost-sizes", default="100,10000", help="corpus sizes for --only-costs (shipped, repeated)")
    parser.add_argument("--only-costs", action="store_true", help="run only what probes and intervals cost")
    args = parser.parse_args()
    quiet_transformers(show_progress=False)
    torch.manual_seed(0)
    results = []
    words = [w for line in CORPUS.read_text(encoding="utf-8").splitlines() for w in line.split()]
    with tempfile.TemporaryDirectory() as scratch:
        only = args.only_depths or args.only_lengths or args.only_costs
        for model_name in [] if only else args.models.split(","):
            source = str(gpt2_folder(Path(scratch) / "gpt2", 12, words)) if model_name == "gpt2" else model_name
            loaded = load_model(source, device=args.device, dtype="float32" if args.device == "cpu" else "auto")
            causal_lm = _causal_lm(loaded)
            for workload, texts in workloads(loaded.tokenizer, args.workloads.split(",")).items():
                # Every approach starts from the text: tokenizing is part of the work.
                max_length = MAX_LENGTH.get(workload, 1024)
                if max_length > (model_max_length(loaded.model.config) or max_length):
                    print(f"# {model_name} / {workload}: skipped, longer than the model's positions", file=sys.stderr)
                    continue

                def tokenize(texts=texts, tokenizer=loaded.tokenizer, max_length=max_length):
                    return token_ids(tokenizer, texts, max_length)

                n_tokens = sum(map(len, tokenize().values()))
                batch_size = BATCH.get(workload, 16)
                runners = {
                    "floor (sdpa)": floor_runner(loaded.model, "sdpa", tokenize, batch_size),
                    "floor (eager)": floor_runner(loaded.model, "eager", tokenize, batch_size),
                    "headscope": headscope_runner(loaded, texts, max_length, batch_size),
                    "output_attentions": output_attentions_runner(causal_lm, tokenize, batch_size),
                }
                if loaded.device.type == "cuda" and _flash_attention_available():
                    runners["floor (flash)"] = floor_runner(loaded.model, "flash_attention_2", tokenize, batch_size)
                if workload == "long4096" and loaded.device.type != "cuda":
                    del runners["output_attentions"]  # 30 layers of (9, 4096, 4096) float32: ~18 GB of host memory
                note = ""
                if model_name == "gpt2":
                    tl_run, note = transformerlens_runner(loaded, tokenize, batch_size)
                    if tl_run is not None:
                        runners["transformerlens"] = tl_run
                print(f"# {model_name} / {workload}: {n_tokens} tokens", file=sys.stderr)
                measured = measure(runners, loaded.device, args.repeats)
                results.append({"model": model_name, "workload": workload, "results": measured, "note": note})
                print(json.dumps(results[-1]), file=sys.stderr)
            del causal_lm, loaded
        if args.only_costs:
            results.append({"costs": _costs(args)})
        if args.depths and not (args.only_lengths or args.only_costs):
            results.append({"depths": _memory_by_depth(Path(scratch), words, args)})
        if args.lengths:
            results.append({"lengths": _memory_by_length(args)})
    print(_markdown(results, args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def _flash_attention_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def _causal_lm(loaded):
    from transformers import AutoModelForCausalLM

    source = loaded.source
    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        source.location, dtype=loaded.dtype, attn_implementation="eager", **extra
    )
    return model.eval().to(loaded.device)


def _memory_by_depth(scratch: Path, words: list[str], args) -> list[dict]:
    """Peak memory of headscope and the floor on four 1,024-token sequences, for several depths."""
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        loaded = load_model(str(gpt2_folder(scratch / f"gpt2-{depth}", depth, words)), device=args.device)
        texts = workloads(loaded.tokenizer, ["long"])["long"][:4]
        runners = {
            "floor (sdpa)": floor_runner(
                loaded.model, "sdpa", lambda tok=loaded.tokenizer, texts=texts: token_ids(tok, texts, 1024), 4
            ),
            "headscope": headscope_runner(loaded, texts, 1024, 4),
        }
        measured = measure(runners, loaded.device, 1, warm_up=True)
        rows.append({"layers": depth, **{name: value["peak_bytes"] for name, value in measured.items()}})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _memory_by_length(args) -> list[dict]:
    """Peak memory and speed of headscope and the sdpa floor on one SmolLM2 sentence of each length.

    One sentence per length, no per-sentence table: what is left is the model's activations and whatever
    headscope holds to reduce a layer's attention, which must not grow with the square of the length.
    """
    loaded = load_model("smollm2", device=args.device, dtype="float32" if args.device == "cpu" else "auto")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        text = " ".join(lines * (1 + length // 1000))  # ~1,300 tokens per copy of the corpus: cut to `length`

        def tokenize(text=text, length=length):
            return token_ids(loaded.tokenizer, [text], length)

        assert len(tokenize()[0]) == length, "the text is too short for this length"
        runners = {
            "floor (sdpa)": floor_runner(loaded.model, "sdpa", tokenize, 1),
            "headscope": lambda text=text, length=length: int(
                headscope.analyze(loaded, [text], max_length=length, sentence_heads=False, charts=None).run["corpus"][
                    "tokens"
                ]
            ),
        }
        measured = measure(runners, loaded.device, 1, warm_up=length <= 1024)
        rows.append({"tokens": length, **measured})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _costs(args) -> list[dict]:
    """What the probe battery and the bootstrap intervals add to analyze: SmolLM2 on the shipped sentences
    repeated to each size, each setting run interleaved after one warm-up, timings from run.json."""
    loaded = load_model("smollm2", device=args.device, dtype="float32" if args.device == "cpu" else "auto")
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    settings = {"neither": {"probes": False, "bootstrap": 0}, "both": {}}
    headscope.analyze(loaded, lines[:10], sentence_heads=False, charts=None)  # warm-up: imports, first checks
    rows = []
    for size in (int(n) for n in args.cost_sizes.split(",")):
        texts = (lines * (size // len(lines) + 1))[:size]
        for name, options in settings.items():
            run = headscope.analyze(loaded, texts, sentence_heads=False, charts=None, **options).run
            timings = run["timings"]
            rows.append(
                {
                    "sentences": size,
                    "setting": name,
                    **{k: timings[k] for k in ("measure_seconds", "probe_seconds", "write_seconds", "peak_rss_bytes")},
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _markdown(results: list[dict], args) -> str:
    lines = [
        f"Command: `python benchmarks/bench.py --models {args.models} --workloads {args.workloads} "
        f"--repeats {args.repeats} --device {args.device}` (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads)",
        "",
        "| model | workload | approach | tokens/s (median) | × floor | peak memory (MiB) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for entry in results:
        if "depths" in entry or "lengths" in entry or "costs" in entry:
            continue
        floors = {k: v for k, v in entry["results"].items() if k.startswith("floor")}
        best = max(floors, key=lambda k: floors[k]["tokens_per_second"])
        floor = floors[best]
        for name, value in entry["results"].items():
            if name.startswith("floor") and name != best:
                continue
            label = f"floor = {best[7:-1]}" if name == best else name
            lines.append(
                f"| {entry['model']} | {entry['workload']} | {label} | {value['tokens_per_second']:,.0f} | "
                f"{value['tokens_per_second'] / floor['tokens_per_second']:.2f} | {value['peak_bytes'] / 2**20:,.0f} |"
            )
        if entry["note"]:
            lines.append(f"| {entry['model']} | {entry['workload']} | transformerlens | skipped: {entry['note']} | | |")
    costs = next((entry["costs"] for entry in results if "costs" in entry), None)
    if costs:
        lines += [
            "",
            "| sentences | probes and intervals | measuring (s) | probes (s) | writing (s) | peak RSS (MiB) |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        for row in costs:
            lines.append(
                f"| {row['sentences']:,} | {'on' if row['setting'] == 'both' else 'off'} | "
                f"{row['measure_seconds']:.2f} | {row['probe_seconds']:.2f} | {row['write_seconds']:.2f} | "
                f"{row['peak_rss_bytes'] / 2**20:,.0f} |"
            )
    lengths = next((entry["lengths"] for entry in results if "lengths" in entry), None)
    if lengths:
        lines += [
            "",
            "| SmolLM2, one sentence of | floor peak (MiB) | headscope peak (MiB) | floor tok/s | headscope tok/s |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in lengths:
            floor, ours = row["floor (sdpa)"], row["headscope"]
            lines.append(
                f"| {row['tokens']:,} tokens | {floor['peak_bytes'] / 2**20:,.0f} | {ours['peak_bytes'] / 2**20:,.0f} "
                f"| {floor['tokens_per_second']:,.0f} | {ours['tokens_per_second']:,.0f} |"
            )
    depths = next((entry["depths"] for entry in results if "depths" in entry), None)
    if depths:
        lines += ["", "| GPT-2 layers | floor peak (MiB) | headscope peak (MiB) |", "|---:|---:|---:|"]
        for row in depths:
            lines.append(f"| {row['layers']} | {row['floor (sdpa)'] / 2**20:,.0f} | {row['headscope'] / 2**20:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
