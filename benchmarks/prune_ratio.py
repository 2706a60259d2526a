"""prune's wall time as a multiple of one ablation's, both through the CLI on SmolLM2 and the shipped corpus, in
fresh processes one after the other (loading included in both: the ratio is what a user waits, and these machines
are too noisy for absolute seconds to compare across sessions):

    python benchmarks/prune_ratio.py --budget 0.05
    PYTHONPATH=/path/to/other/checkout python benchmarks/prune_ratio.py --budget 0.05   # another version

Prints each command's seconds, the ratio, the heads prune removed and its search's counts (from prune.json).
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


def timed(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "headscope", *args], check=True, env=os.environ, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="0.05")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prune-args", default="", help="more options for prune, e.g. '--patience 0'")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        ablate = timed(["ablate", args.model, "--heads", "0.0", "--out", str(out / "ablate")])
        prune = timed(["prune", args.model, "--budget", args.budget, "--out", str(out / "prune"), "--no-charts",
                       *args.prune_args.split()])  # fmt: skip
        record = json.loads((out / "prune" / "prune.json").read_text())
    search = record["search"]
    ratio = prune / ablate
    print(f"ablate --heads 0.0: {ablate:.1f} s; prune --budget {args.budget}: {prune:.1f} s; ratio {ratio:.1f}")
    print(f"removed {len(record['heads'])} of {record['total_heads']} heads, {record['delta']:+.4f} nats; search: "
          + ", ".join(f"{key} {search.get(key)}" for key in ("rounds", "verified_sets", "verify_calls",
                      "gradient_passes", "forward_passes", "token_forwards", "stopped") if key in search))  # fmt: skip
    print("curve:", ", ".join(f"{step['heads_removed']} {step['loss'] - record['clean_loss']:+.4f}"
                              for step in record["curve"][1:]))  # fmt: skip


if __name__ == "__main__":
    main()
