"""How well the labels predict the verified streaming split: an analyze report's far_mass (and streaming role) and
probe_retrieval (and retrieval role) against a `prune --mode window` kv-policy.json, then the loss of windowing
exactly the labelled heads, each group through `headscope ablate --mode window` (one pass over the same texts):

    headscope analyze smollm2 --corpus corpora/long-texts.txt --max-length 1024 --stream-window 64 \\
        --retrieval-length 1024 --out reports/long
    headscope prune smollm2 --corpus corpora/long-texts.txt --max-length 1024 --mode window --budget 0.05 \\
        --out reports/long-prune
    python benchmarks/streaming_labels.py --report reports/long --policy reports/long-prune/kv-policy.json \\
        --max-length 1024

Prints: how many heads each label names, how many of them prune windowed, the share of prune's windowed heads the
label found, the area under the ROC curve of far_mass as a predictor of "windowed" (the chance a windowed head has a
lower far_mass than a full one), the retrieval heads and which prune kept full; then, with --ablate, the loss of
windowing (a) the heads far_mass labels streaming, (b) the retrieval heads, (c) as many heads drawn at random (seed 0)
from the others of their layers, (d) prune's own set. A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def windowed_heads(policy: dict) -> set[tuple[int, int]]:
    return {(layer["layer"], head) for layer in policy["layers"] for head, keys in enumerate(layer["heads"])
            if keys != "full"}  # fmt: skip


def roc_auc(score: np.ndarray, positive: np.ndarray) -> float:
    """P(score of a positive < score of a negative), ties counted half: lower far_mass should mean windowed."""
    pos, neg = score[positive], score[~positive]
    below = (pos[:, None] < neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(below / (len(pos) * len(neg)))


def ablate(model: str, corpus: Path, max_length: int, groups: dict[str, list[tuple[int, int]]], policy: dict) -> dict:
    """Each group windowed alone (sink and window as the policy's), one `headscope ablate` run: name -> delta."""
    named = {name: heads for name, heads in groups.items() if heads}
    with tempfile.TemporaryDirectory() as folder:
        args = [sys.executable, "-m", "headscope", "ablate", model, "--corpus", str(corpus), "--max-length",
                str(max_length), "--mode", "window", "--window", str(policy["window"]), "--sink", str(policy["sink"]),
                "--out", str(Path(folder) / "ablate")]  # fmt: skip
        for heads in named.values():
            args += ["--heads", ",".join(f"{layer}.{head}" for layer, head in heads)]
        subprocess.run(args, check=True, env=os.environ, stdout=subprocess.DEVNULL)
        record = json.loads((Path(folder) / "ablate" / "ablation.json").read_text())
    deltas = [group["delta"] for group in record["groups"]]
    return dict(zip(named, deltas, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--policy", type=Path, required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", type=Path, default=REPO / "corpora" / "long-texts.txt")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--ablate", action="store_true", help="also window each labelled group (one ablate run)")
    args = parser.parse_args()
    heads = pd.read_parquet(args.report / "heads.parquet")
    run = json.loads((args.report / "run.json").read_text())
    policy = json.loads(args.policy.read_text())
    thresholds = run["classification"]["role_thresholds"]
    windowed = windowed_heads(policy)
    key = list(zip(heads["layer"], heads["head"], strict=True))
    is_windowed = np.array([head in windowed for head in key])
    far = heads["far_mass"].to_numpy()
    print(f"{len(heads)} heads; prune windowed {is_windowed.sum()} (+{policy['loss']['delta']:.4f} nats); settings: "
          f"stream window {run['settings']['stream_window']}, sink {run['settings']['stream_sink']}; policy window "
          f"{policy['window']}, sink {policy['sink']}")  # fmt: skip
    print(
        f"far_mass: median {np.nanmedian(far):.4f}, range {np.nanmin(far):.4f}-{np.nanmax(far):.4f}; "
        f"AUC of far_mass for 'windowed': {roc_auc(far, is_windowed):.3f}"
    )
    print("| far_mass <= | heads | windowed by prune | precision | recall |")
    print("|---:|---:|---:|---:|---:|")
    for cut in (0.01, 0.02, 0.05, 0.1, 0.2):
        labelled = far <= cut
        hit = (labelled & is_windowed).sum()
        print(f"| {cut} | {labelled.sum()} | {hit} | {hit / max(labelled.sum(), 1):.2f} | "
              f"{hit / max(is_windowed.sum(), 1):.2f} |")  # fmt: skip
    roles = heads["role"]
    print("| role | heads | windowed by prune | kept full |")
    print("|---|---:|---:|---:|")
    for role in roles.unique():
        mine = (roles == role).to_numpy()
        print(f"| {role} | {mine.sum()} | {(mine & is_windowed).sum()} | {(mine & ~is_windowed).sum()} |")
    retrieval = heads[roles == "retrieval"].sort_values("probe_retrieval", ascending=False)
    print(
        "retrieval heads (probe_retrieval, far_mass, prune):",
        ", ".join(
            f"{row.layer}.{row.head} ({row.probe_retrieval:.2f}, {row.far_mass:.3f}, "
            f"{'windowed' if (row.layer, row.head) in windowed else 'full'})"
            for row in retrieval.itertuples()
        ),
    )
    if not args.ablate:
        return
    streaming = [head for head, f in zip(key, far, strict=True) if f <= thresholds["streaming_max_far_mass"]]
    retrieved = list(zip(retrieval["layer"], retrieval["head"], strict=True))
    rng = np.random.default_rng(0)
    others = []
    for layer, _ in retrieved:  # as many heads of the same layers, not retrieval heads
        pool = [h for h in key if h[0] == layer and h not in retrieved and h not in others]
        others.append(pool[rng.integers(len(pool))])
    groups = {"far_mass-labelled streaming": streaming, "retrieval heads": retrieved,
              "as many others of their layers": others, "prune's windowed set": sorted(windowed)}  # fmt: skip
    deltas = ablate(args.model, args.corpus, args.max_length, groups, policy)
    print("| windowed together | heads | loss change (nats) |")
    print("|---|---:|---:|")
    for name, delta in deltas.items():
        print(f"| {name} | {len(groups[name])} | {delta:+.4f} |")


if __name__ == "__main__":
    main()
