"""How well prune's estimate ranks heads by their exact cost: a seeded sample of SmolLM2's heads, each removed
alone (mean removal, the shipped corpus) and its exact loss increase measured, against the first-order term alone,
the curvature term alone and their sum (what prune ranks by), on the clean model:

    python benchmarks/prune_estimate.py --heads 64

Prints Spearman's rank correlation and the median absolute error of each. A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
from scipy.stats import spearmanr

from headscope.interventions.loss_model import loss_model
from headscope.model.loading import load_for_run
from headscope.run.setup import CommandRun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--heads", type=int, default=64, help="heads sampled (each costs one replica)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run = CommandRun.prepare(args.model, None, config=None, options={}, reporter=None)
    session = run.session(args.model, load_for_run, what="prune", lm_head=True)
    with session as opened, loss_model(opened, run, "prune") as lm:
        removal = lm.removal("mean")
        sample = sorted(random.Random(args.seed).sample(lm.all_heads, min(args.heads, len(lm.all_heads))))
        tokens, clean, ablated = lm.losses([[head] for head in sample], removal).arrays("all")
        exact = (ablated.sum(1) - clean.sum()) / tokens.sum()
        _, first = lm.estimated_costs([], removal, curvature=False)
        _, both = lm.estimated_costs([], removal)
    terms = {"first order": [first[h] for h in sample], "curvature": [both[h] - first[h] for h in sample],
             "first order + curvature (prune's)": [both[h] for h in sample]}  # fmt: skip
    print(f"{args.model}: {len(sample)} heads (seed {args.seed}), exact costs {exact.min():+.4f} to {exact.max():+.4f}")
    for name, values in terms.items():
        error = np.median(np.abs(np.asarray(values) - exact))
        print(f"  {name:34s} Spearman {spearmanr(values, exact).statistic:.3f}, median |error| {error:.5f} nats")


if __name__ == "__main__":
    main()
