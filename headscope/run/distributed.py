"""Data-parallel runs on torch.distributed: `torchrun --nproc-per-node N -m headscope analyze ...`.

The corpus's chunks are dealt round-robin (chunk i goes to rank i % N); each rank measures its chunks on its
own device and writes their per-sentence part files into the shared staging folder; the per-head float64
sums (and the bootstrap's replicate sums, whose weights are a pure function of the sentence id) are added
with all_reduce; rank 0 merges the parts and writes the report. Ranks meet once per round of chunks: there
they add up their progress (one progress bar, on rank 0) and learn whether any rank failed, so an error on
one rank stops every rank with that rank's message.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from headscope.errors import ConfigError, HeadscopeError


class PeerError(HeadscopeError):
    """Another rank failed; its message is this error's (rank 0 prints it, the others stay quiet)."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def owns(self, chunk: int) -> bool:
        return chunk % self.world == self.rank

    def rounds(self, chunks: int) -> int:
        """Rounds of chunks: every rank meets the others this many times, whatever its share."""
        return -(-chunks // self.world)


ONE_PROCESS = Ranks()


def ranks_from_env() -> Ranks:
    """The ranks torchrun (or any launcher that sets its variables) started; one process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return ONE_PROCESS
    return Ranks(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))


def rank_device(ranks: Ranks, requested: str) -> str:
    """Each rank on its own GPU (cuda:LOCAL_RANK) when the run is on CUDA; the request unchanged otherwise."""
    if ranks.parallel and requested in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(ranks.local_rank)
        return f"cuda:{ranks.local_rank}"
    return requested


def join(ranks: Ranks, device: torch.device) -> None:
    """Join the process group (NCCL between GPUs, gloo on CPUs), unless the caller already did."""
    import torch.distributed as dist

    if ranks.parallel and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def leave(ranks: Ranks) -> None:
    import torch.distributed as dist

    if ranks.parallel and dist.is_initialized():
        dist.destroy_process_group()


def collective(call: Callable[[], object]):
    """A collective whose peer may die in the middle (killed, out of memory): gloo and NCCL then raise a
    RuntimeError with a page of C++ context on every surviving rank; here it is one line."""
    try:
        return call()
    except RuntimeError as err:
        raise PeerError(f"another rank stopped in the middle of the run ({_one_line(err)})") from None


def broadcast(ranks: Ranks, value):
    """Rank 0's `value` on every rank."""
    if not ranks.parallel:
        return value
    import torch.distributed as dist

    box = [value]
    collective(lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def gather(ranks: Ranks, value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not ranks.parallel:
        return [value]
    import torch.distributed as dist

    values = [None] * ranks.world
    collective(lambda: dist.all_gather_object(values, value))
    return values


def all_sum(ranks: Ranks, array: np.ndarray, device: torch.device) -> np.ndarray:
    """The sum over ranks of `array` (float64 stays float64), on every rank."""
    if not ranks.parallel:
        return array
    import torch.distributed as dist

    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(device)
    collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM))
    return tensor.cpu().numpy()


def agree(ranks: Ranks, facts: dict) -> None:
    """Every rank runs the same thing: `facts` (the command, its settings and request, fingerprints of its
    inputs; values that compare with ==) are rank 0's on every rank, else every rank stops with one line naming
    what differs. Ranks that disagree would add up sums of different things, or wait for each other forever."""
    if not ranks.parallel:
        return
    every = gather(ranks, facts)
    for rank, theirs in enumerate(every[1:], start=1):
        differ = sorted(key for key in every[0].keys() | theirs.keys() if theirs.get(key) != every[0].get(key))
        if differ:
            shown = "; ".join(
                f"{key} {_shown(theirs.get(key))} (rank 0: {_shown(every[0].get(key))})" for key in differ
            )
            raise ConfigError(
                f"the ranks were not started alike: rank {rank} has {shown}; start every rank with the same "
                "command, options and inputs"
            )


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def meet(ranks: Ranks, counts: tuple[int, int], error: BaseException | None = None) -> tuple[int, int]:
    """One round's meeting: every rank's (sentences, tokens) of the round added up, after checking that no
    rank failed. A failed rank passes its error; then every rank raises a PeerError naming the first failed
    rank and its message (chained, on that rank, to the original error), which rank 0 prints."""
    reports = gather(ranks, (counts, None if error is None else _one_line(error)))
    for rank, (_, message) in enumerate(reports):
        if message is not None:
            raise PeerError(f"rank {rank} of {ranks.world} failed: {message}") from error
    return tuple(int(sum(report[0][i] for report in reports)) for i in range(2))


def together(ranks: Ranks, step):
    """`step()` on every rank; if it fails on any, every rank stops, with that rank's message (no rank is left
    waiting for the others). In one process, just `step()`."""
    try:
        result = step()
    except BaseException as err:
        if ranks.parallel:
            meet(ranks, (0, 0), err)  # every rank stops, with this rank's message
        raise
    if ranks.parallel:
        meet(ranks, (0, 0))
    return result


def share_of(ranks: Ranks, items: Iterable) -> Iterator:
    """This rank's items of a sequence dealt round-robin (item i to rank i % N): all of them in one process."""
    return (item for index, item in enumerate(items) if ranks.owns(index))


def added(ranks: Ranks) -> Callable[[np.ndarray], np.ndarray]:
    """array -> its sum over every rank (float64, all-reduced on the host): the identity in one process."""
    return lambda array: all_sum(ranks, array, torch.device("cpu"))


def _one_line(error: BaseException) -> str:
    """The error as one line; headscope's own errors are already written for users, others get their type."""
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if isinstance(error, HeadscopeError) else f"{type(error).__name__}: {line}".rstrip(": ")


class Rounds:
    """A data-parallel run's meetings: one per round of chunks on every rank, the progress of the others shown
    on rank 0, and any rank's failure raised on all. Nothing in one process. Use as a context manager around
    the corpus loop: on leaving it, a rank with fewer chunks still meets the others every round."""

    def __init__(self, ranks: Ranks, reporter, chunks: int) -> None:
        self.ranks, self.reporter, self.left = ranks, reporter, ranks.rounds(chunks)

    def meet(self, sentences: int, tokens: int, error: BaseException | None = None) -> None:
        if not self.ranks.parallel:
            return
        self.left -= 1
        all_sentences, all_tokens = meet(self.ranks, (sentences, tokens), error)
        self.reporter.advance(all_sentences - sentences, all_tokens - tokens)  # this rank advanced its own

    def __enter__(self) -> Rounds:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if not self.ranks.parallel:
            return
        if error is not None:
            if not isinstance(error, PeerError):
                self.meet(0, 0, error)  # raises a PeerError naming this rank here and on the others
            return
        while self.left > 0:
            self.meet(0, 0)


def combined(ranks: Ranks, measured, device: torch.device, chunks: int):
    """Every rank's share of a corpus pass added up, on every rank: float64 sums all-reduced (in another order
    than one process would add them: equal within ~1e-15), counts summed, the best example sentence of all."""
    reduce_on = device if device.type == "cuda" else torch.device("cpu")
    bootstrap = measured.bootstrap
    if bootstrap is not None:
        bootstrap.sums = all_sum(ranks, bootstrap.sums, reduce_on)
    shares = gather(ranks, measured.progress)
    progress = dataclasses.replace(shares[0], chunks_done=chunks)
    for name in ("measured_sentences", "empty_sentences", "truncated", "capped", "tokens", "batches"):
        setattr(progress, name, sum(getattr(share, name) for share in shares))
    progress.lengths = {}
    for share in shares:
        for length, (counted, first) in share.lengths.items():
            entry = progress.lengths.setdefault(length, [0, first])
            entry[0], entry[1] = entry[0] + counted, min(entry[1], first)
    paths = {name: path for share in gather(ranks, measured.attention_paths) for name, path in share.items()}
    return dataclasses.replace(
        measured,
        sums=all_sum(ranks, measured.sums, reduce_on),
        bootstrap=bootstrap,
        progress=progress,
        attention_paths=paths,
        write_paths=max(gather(ranks, measured.write_paths), key=len),  # a rank that ran no batch learned none
    )


def one_process_only(what: str) -> None:
    """Refuse a command that does not split its work between ranks, under torchrun: every rank would run all of it
    and write the same folder."""
    if ranks_from_env().parallel:
        raise ConfigError(
            f"{what} runs in one process (it does not split its work between ranks): run it without torchrun"
        )


def check_parallel_model(settings, model_is_loaded: bool, what: str) -> None:
    """What no data-parallel run can do, refused before anything loads; what: the command."""
    if model_is_loaded:
        raise ConfigError(f"a data-parallel {what} loads the model on every rank: pass its name or path, not a model")
    if settings.device_map is not None:
        raise ConfigError("--device-map spreads one model over the devices; it cannot be combined with torchrun")
