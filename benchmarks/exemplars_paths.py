"""Exemplars and detector scores on every attention path of one device: the eager weights (block budget 1 GiB), the
fused pass (block budget 4 KiB: headscope's Triton kernel on CUDA, its C++ kernel or the tile loop on the CPU), on
the planted GPT-2 and the shipped corpus. Prints the largest score difference and how many kept rows differ where
scores are not tied within 1e-5. A script, not a test: run it where there is a GPU.

    python benchmarks/exemplars_paths.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import headscope

from planted import build_planted_gpt2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--join", type=int, default=1, help="sentences joined into one text (long texts reach the kernels)"
    )
    parser.add_argument("--copies", type=int, default=1, help="the texts this many times over (more work: the kernels)")
    args = parser.parse_args()
    lines = (Path(__file__).resolve().parents[1] / "corpora" / "english-100.txt").read_text().splitlines()
    texts = [" ".join(lines[i : i + args.join]) for i in range(0, len(lines), args.join)]
    folder = build_planted_gpt2(Path(tempfile.mkdtemp()) / "planted", lines)
    model = headscope.load_model(str(folder), device=args.device, dtype="float32")
    common = {"probes": False, "check_dormant": False, "bootstrap": 0, "detectors": {"prev": "offset:1"}}
    runs = {
        name: headscope.analyze(model, texts * args.copies, block_bytes=budget, **common)
        for name, budget in (("eager", 2**30), ("fused", 4096))
    }
    for name, report in runs.items():
        print(name, sorted(set(report.run["attention_implementation"].values())))
    a, b = runs["eager"].exemplars, runs["fused"].exemplars
    print("rows kept", len(a), len(b), "largest score difference", float(np.abs(a["score"] - b["score"]).max()))
    separated = a.groupby(["layer", "head", "kind"], observed=True)["score"].transform(
        lambda s: s.diff().abs().fillna(1).gt(1e-5) & s.diff(-1).abs().fillna(1).gt(1e-5)
    )
    columns = ["sentence", "row", "key"]
    differing = (a.loc[separated, columns].to_numpy() != b.loc[separated, columns].to_numpy()).any(axis=1).sum()
    print("rows differing where scores are separated:", int(differing), "of", int(separated.sum()))
    same_place = (a[["row", "key"]].to_numpy() == b[["row", "key"]].to_numpy()).all(axis=1)
    print("rows whose query and key differ (copies tie, so sentences may):", int((~same_place).sum()), "of", len(a))
    detect = np.abs(runs["eager"].heads["detect_prev"] - runs["fused"].heads["detect_prev"]).max()
    print("detect_prev largest difference", float(detect))


if __name__ == "__main__":
    main()
