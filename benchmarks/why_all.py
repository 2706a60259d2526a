"""inspect --why all on one long text: SmolLM2's head 18.6 on the first N tokens of the shipped corpus joined into
one text, every row explained (every pair of senders of every row written to qk.parquet):

    python benchmarks/why_all.py --tokens 1000

Prints the seconds (loading excluded) and qk.parquet's size. A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import headscope

CORPUS = Path(__file__).resolve().parent.parent / "corpora" / "english-100.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--head", default="18.6")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--why", default="all", help="what --why asks: all, or rows such as 10,500,999")
    args = parser.parse_args()
    loaded = headscope.load_model(args.model)
    ids = loaded.tokenizer(" ".join(CORPUS.read_text(encoding="utf-8").split("\n")))["input_ids"][: args.tokens]
    text = loaded.tokenizer.decode(ids)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        found = headscope.inspect(loaded, texts=[text], heads=[args.head], why=args.why.split(","), page=False,
                                  out=Path(folder) / "why")  # fmt: skip
        seconds = time.perf_counter() - start
        size = (Path(folder) / "why" / "qk.parquet").stat().st_size
    print(f"{args.model} {args.head}, {len(found.tokens)} tokens, --why {args.why}: {seconds:.1f} s, "
          f"{len(found.record['why']['rows'])} rows explained, qk.parquet {size / 2**20:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
