"""A search that survives an interruption: every answer the model gave it, saved as it came.

prune's search (interventions/search.py) is a pure function of what `estimate` and `verify` return. The journal
wraps both: each call's question and answer are appended to a JSON file (rewritten atomically after every call,
with the search's state so far for a reader), and a resumed search replays the saved answers in order, each
checked against the question it is asked again, then goes on live. A resumed search therefore takes exactly the
decisions the interrupted one took and ends where an uninterrupted one would: floats survive JSON unchanged
(Python writes the shortest text that reads back as the same double).

The journal opens with a fingerprint of everything the answers depend on (model, corpus, settings, budget,
mode): a journal from another search is refused in one line, not replayed. Its calls carry a checksum (sha256 of
the fingerprint and every call), and each replayed answer is checked for its form (an estimate: every head not
removed, with a finite number; a verification: one finite loss per set asked): a journal edited by hand or
damaged is refused in one line, never replayed as what the model said.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

from headscope.arguments import head_name
from headscope.errors import OutputError
from headscope.files import atomic_path
from headscope.interventions.search import Estimate, Head, PruneResult


class SearchJournal:
    """Wrap `estimate` and `verify` (`.estimate(f)`, `.verify(f)`) so that every answer is saved in `path` and,
    with `resume`, the answers saved there by an interrupted search are replayed first. writes: False for the
    ranks of a data-parallel run other than rank 0 (they replay the same journal, and rank 0 keeps it)."""

    def __init__(self, path: Path, fingerprint: dict, *, resume: bool, writes: bool = True, candidates=None) -> None:
        """candidates: the heads the search may remove (an estimate answers for every one not removed)."""
        self.path, self.fingerprint, self.writes = path, fingerprint, writes
        self.candidates = None if candidates is None else {tuple(head) for head in candidates}
        self.calls: list[dict] = []
        self.replayed = 0  # calls answered from the journal
        self._state: dict = {}
        if resume and path.is_file():
            saved = _read(path)
            if saved.get("fingerprint") != fingerprint:
                changed = sorted(k for k in {*fingerprint, *saved.get("fingerprint", {})}
                                 if fingerprint.get(k) != saved.get("fingerprint", {}).get(k))  # fmt: skip
                raise OutputError(
                    f"{path} was saved by a prune with other inputs ({', '.join(changed)} differ); run the same "
                    f"command as the interrupted one, or delete {path.parent} to start over"
                )
            if saved.get("checksum") != _checksum(fingerprint, saved["calls"]):
                raise OutputError(
                    f"{path} was changed after the search wrote it (its checksum does not match): its answers are "
                    f"not the model's; delete {path.parent} to start over"
                )
            self.calls = saved["calls"]
        self._saved = list(self.calls)  # what a resumed search must be asked again, in order

    def estimate(self, function: Callable[[list[Head]], Estimate]) -> Callable:
        def journalled(removed: list[Head]) -> Estimate:
            def live() -> dict:
                found = function(removed)
                return {"loss": float(found.loss), "costs": [[*h, float(v)] for h, v in found.costs.items()]}

            answer = self._answer("estimate", [list(head) for head in removed], live)
            return Estimate(answer["loss"], {(layer, head): value for layer, head, value in answer["costs"]})

        return journalled

    def verify(self, function: Callable[[list[list[Head]]], list[float]]) -> Callable:
        def journalled(sets: list[list[Head]]) -> list[float]:
            question = [[list(head) for head in group] for group in sets]
            return self._answer("verify", question, lambda: [float(loss) for loss in function(sets)])

        return journalled

    def step(self, result: PruneResult) -> None:
        """Record the search's state after an accepted step (for a reader of the file; replay does not need it)."""
        self._state = {"heads": [head_name(*h) for h in result.heads], "loss": result.loss, "curve": result.curve}
        self._write()

    def _answer(self, kind: str, question: list, live: Callable[[], list]) -> list:
        if self.replayed < len(self._saved):
            saved = self._saved[self.replayed]
            if saved["call"] != kind or saved["question"] != question:
                raise OutputError(
                    f"{self.path} does not match this search (call {self.replayed + 1} asked something else); "
                    f"delete {self.path.parent} to start over"
                )
            self.replayed += 1
            return _checked(self.path, kind, question, saved.get("answer"), self.replayed, self.candidates)
        self.calls.append({"call": kind, "question": question, "answer": live()})
        self._write()
        return self.calls[-1]["answer"]

    def _write(self) -> None:
        if not self.writes:
            return
        record = {"fingerprint": self.fingerprint, "state": self._state, "calls": self.calls,
                  "checksum": _checksum(self.fingerprint, self.calls)}  # fmt: skip
        with atomic_path(self.path) as tmp:
            tmp.write_text(json.dumps(record), encoding="utf-8")


def _read(path: Path) -> dict:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or not isinstance(saved.get("calls"), list):
            raise ValueError("no list of calls")
        return saved
    except (OSError, ValueError) as err:
        raise OutputError(
            f"{path}: cannot read the interrupted search's journal ({err}); delete it to start over"
        ) from None


def _checksum(fingerprint: dict, calls: list) -> str:
    text = json.dumps({"fingerprint": fingerprint, "calls": calls}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _checked(path: Path, kind: str, question: list, answer, call: int, candidates: set | None) -> list:
    """A replayed answer of the form the live call gives, else one line refusing the journal."""

    def finite(value) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)

    if kind == "verify":
        good = isinstance(answer, list) and len(answer) == len(question) and all(map(finite, answer))
    else:  # estimate: the loss, and [layer, head, cost] for heads, none of them among the removed, each once
        removed = {tuple(head) for head in question}
        costs = answer.get("costs") if isinstance(answer, dict) else None
        heads = [tuple(entry[:2]) for entry in costs] if isinstance(costs, list) else []
        good = (
            isinstance(costs, list)
            and finite(answer.get("loss"))
            and all(isinstance(e, list) and len(e) == 3 and all(isinstance(x, int) for x in e[:2]) for e in costs)
            and all(finite(entry[2]) for entry in costs)
            and len(set(heads)) == len(heads)
            and not removed & set(heads)
            and (candidates is None or set(heads) == candidates - removed)
        )
    if not good:
        raise OutputError(
            f"{path}: answer {call} ({kind}) is not one the search gives (damaged or edited); delete {path.parent} "
            "to start over"
        )
    return answer
