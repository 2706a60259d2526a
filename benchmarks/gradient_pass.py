"""One gradient pass of prune's estimate (forward with heads removed, backward, the estimate's sums) on SmolLM2 and
the shipped corpus, against one ablation of the same heads (a clean pass and one replica, as `ablate` runs it),
in one process, interleaved:

    python benchmarks/gradient_pass.py --repeats 3
    PYTHONPATH=/path/to/other/checkout python benchmarks/gradient_pass.py --repeats 3   # another version

Prints the median seconds of each and their ratio, and the pass's loss (the same on every version that computes
the same numbers). A script, not a test: it reports figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from headscope.interventions.loss_model import loss_model
from headscope.model.loading import load_for_run
from headscope.run.setup import CommandRun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--removed", type=int, default=50, help="heads removed (every other one of the first 2n)")
    args = parser.parse_args()
    run = CommandRun.prepare(args.model, None, config=None, options={}, reporter=None)
    session = run.session(args.model, load_for_run, what="prune", lm_head=True)
    with session as opened, loss_model(opened, run, "prune") as lm:
        removal = lm.removal("mean")
        removed = lm.all_heads[: 2 * args.removed : 2]
        seconds: dict[str, list[float]] = {"one ablation": [], "gradient pass": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            lm.losses(removed and [removed], removal)
            seconds["one ablation"].append(time.perf_counter() - start)
            start = time.perf_counter()
            loss, _ = lm.estimated_costs(removed, removal)
            seconds["gradient pass"].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["gradient pass"] / median["one ablation"]
    times = ", ".join(f"{name} {value:.2f} s" for name, value in median.items())
    print(f"{args.model}, {len(removed)} heads removed, median of {args.repeats}: {times}; gradient pass / ablation "
          f"{ratio:.2f}; loss {loss:.7f}")  # fmt: skip


if __name__ == "__main__":
    main()
