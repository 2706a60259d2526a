"""inspect --why: which senders make a head's query match a key, for chosen rows of the inspected texts.

the request   ROW (the row's strongest key off the first token), FIRST-LAST (each row of the range), ROW:KEY,
              `all` (every row, its strongest key) or `exemplars` (with --exemplars: each exemplar row of its
              sentence); positions as inspect shows them (the tokenizer's output, BOS included where it adds one)
the heads     each explained head's contrasts summed over its rows (ContrastTotals): the means per pair and
              per side, and k_composition_prev, where a report or the probes give every head's role
the maths     interventions.qk_terms (terms, contrasts, the softmax check), interventions.qk_senders (each
              sender's part of the query and of the key, from the same pass inspect runs)
the output    qk.parquet: text_id, layer, head, row, key, query_sender, key_sender, term, contrast (every pair
              of every explained row); a summary per row for inspect.json and the printout
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from headscope.arguments import head_name
from headscope.errors import ConfigError, ResourceError
from headscope.interventions.qk_senders import HeadSenders
from headscope.interventions.qk_terms import RowTerms, block_terms, strongest_key
from headscope.model.memory import readable

QK_SCHEMA = pa.schema(
    [(name, pa.int32()) for name in ("text_id", "layer", "head", "row", "key")]
    + [("query_sender", pa.dictionary(pa.int32(), pa.string())), ("key_sender", pa.dictionary(pa.int32(), pa.string()))]
    + [("term", pa.float64()), ("contrast", pa.float64())]
)
WORDS = ("all", "exemplars")
CHECK = 1e-4  # the softmax of the summed logits against the model's attention: float32 rounding is far below
SHOWN = 3  # senders and pairs a row's summary names
ROW_BLOCK = 64  # explained rows split at once: their (rows, senders, senders) terms and contrasts in float64


@dataclass(frozen=True)
class Why:
    """One --why request: a row (or `all`, `exemplars`) and its key (None: the row's strongest)."""

    row: int | str
    key: int | None = None

    @property
    def name(self) -> str:
        return str(self.row) if self.key is None else f"{self.row}:{self.key}"


def as_why(values) -> tuple[Why, ...]:
    """--why's values (ROW, FIRST-LAST, ROW:KEY, all, exemplars; a value may list several, comma-separated), or a
    one-line refusal naming the one it cannot read."""
    if values is None:
        return ()
    if isinstance(values, str | int):
        values = [values]
    found = []
    for value in values:
        for part in str(value).split(","):
            found += _one_why(part.strip())
    return tuple(dict.fromkeys(found))


def _one_why(text: str) -> list[Why]:
    if text in WORDS:
        return [Why(text)]
    first, dash, last = text.partition("-")
    if dash:
        if not (first.isdigit() and last.isdigit() and int(first) <= int(last)):
            raise ConfigError(f"--why takes a range of rows as FIRST-LAST, the first no later; got {text!r}")
        return [Why(row) for row in range(int(first), int(last) + 1)]
    row, _, key = text.partition(":")
    if not row.isdigit() or (key and not key.isdigit()):
        raise ConfigError(f"--why takes ROW, FIRST-LAST, ROW:KEY (positions, from 0), all or exemplars; got {text!r}")
    if key and int(key) > int(row):
        raise ConfigError(f"--why {text}: key {key} comes after row {row}, and a row attends to keys up to itself")
    return [Why(int(row), int(key) if key else None)]


def check_why(why: tuple[Why, ...], *, heads, roles=(), exemplars) -> None:
    """Before anything loads: --why needs the heads it explains (--heads, --role or --exemplars), and `exemplars`
    needs --exemplars."""
    if why and not heads and not roles and exemplars is None:
        raise ConfigError("--why explains chosen heads: pass --heads L.H, --role R or --exemplars L.H REPORT")
    if any(w.row == "exemplars" for w in why) and exemplars is None:
        raise ConfigError("--why exemplars explains the exemplar rows of --exemplars L.H REPORT: pass --exemplars")


def check_rows(why: tuple[Why, ...], lengths: list[int]) -> None:
    """Once the texts are tokenized, before any pass: every asked row within every text."""
    for text_id, length in enumerate(lengths):
        for asked in why:
            if isinstance(asked.row, int) and asked.row >= length:
                raise ConfigError(f"--why {asked.name}: text {text_id} has {length} tokens (rows 0-{length - 1})")


def check_windows(why: tuple[Why, ...], heads, kinds: tuple[tuple[str, int | None], ...]) -> None:
    """Before the weights load: every ROW:KEY within what its heads' layers see (kinds: each layer's attention as
    architecture.layer_attention reads the config; a sliding window of w sees keys row - w < key, a chunk of c the
    keys of the row's chunk)."""
    for asked in why:
        if not isinstance(asked.row, int) or asked.key is None:
            continue
        for layer, head in heads:
            kind, size = kinds[layer]
            outside = (kind == "sliding" and size and asked.row - asked.key >= size) or (
                kind == "chunked" and size and asked.row // size != asked.key // size
            )
            if outside:
                span = f"a sliding window of {size}" if kind == "sliding" else f"chunks of {size}"
                raise ConfigError(f"--why {asked.name}: layer {layer} (head {head_name(layer, head)}) attends within "
                                  f"{span}, and row {asked.row} does not see key {asked.key}")  # fmt: skip


def split_bytes(heads, longest: int, architecture: dict, hidden: int, dtype_bytes: int) -> int:
    """The peak memory --why adds on a text of `longest` tokens: the pass keeps about ten (t, hidden) tensors per
    layer up to the deepest chosen head (edges.Recorder: the stream, the heads' outputs, q, k, v, the MLP's input
    and write, ...), in the model's dtype; one head's split holds its senders' query and key parts twice over in
    float64 (the parts, then the whole), and a layer's writes twice (the writes and their normed copy); a block of
    ROW_BLOCK rows holds three (rows, senders, senders) float64 arrays (terms, contrasts, the product between)."""
    deepest = max(layer for layer, _ in heads)
    senders = 2 + deepest * (architecture["heads"] + 1)
    kept = 10 * (deepest + 1) * longest * hidden * dtype_bytes
    parts = 4 * senders * longest * architecture["head_dim"] * 8
    writes = 2 * architecture["heads"] * longest * hidden * 8
    block = 3 * min(ROW_BLOCK, longest) * senders**2 * 8
    return kept + parts + writes + block


def check_memory(heads, longest: int, budget: int, architecture: dict, hidden: int, dtype_bytes: int) -> None:
    """Refuse --why in one line, before any pass, where its split of the longest text passes the budget."""
    needed = split_bytes(heads, longest, architecture, hidden, dtype_bytes)
    if needed > budget:
        raise ResourceError(
            f"--why on a text of {longest:,} tokens needs about {readable(needed)} for the split (the pass's kept "
            f"tensors up to layer {max(layer for layer, _ in heads)} and each sender's query and key parts), more "
            f"than the {readable(budget)} budget; cut the text (--max-length), choose shallower heads, or raise "
            "--max-memory"
        )


def rows_of(why: tuple[Why, ...], length: int, exemplar_rows) -> list[tuple[int, int | None]]:
    """The (row, key) pairs asked of one text, in order, each once (key None: the row's strongest)."""
    asked: list[tuple[int, int | None]] = []
    for request in why:
        if request.row == "all":
            asked += [(row, None) for row in range(length)]
        elif request.row == "exemplars":
            asked += [(int(entry["row"]), None) for entry in exemplar_rows]
        else:
            asked.append((request.row, request.key))
    return list(dict.fromkeys(asked))


def explain(
    senders: HeadSenders, attention: np.ndarray, visible: np.ndarray, asked: list[tuple[int, int | None]]
) -> Iterator[list[RowTerms]]:
    """Each asked (row, key) of one head on one text: its terms and contrasts, in blocks of ROW_BLOCK rows
    (qk_terms.block_terms), so that a caller writes each block before the next is split. attention, visible: the
    head's (t, t) weights and the layer's (t, t) visibility, as inspect captured them. Every asked key is checked
    before the first block."""
    weights, seen = torch.as_tensor(attention), torch.as_tensor(visible)
    rows, keys, done = [], [], set()
    for row, key in asked:
        positions = torch.nonzero(seen[row])[:, 0]
        if key is None:
            key = int(positions[strongest_key(weights[row, positions], positions)])
        elif key >= seen.shape[1] or not bool(seen[row, key]):
            raise ConfigError(f"--why {row}:{key}: row {row} of layer {senders.layer} does not see key {key} "
                              f"(it sees {_spans(positions)})")  # fmt: skip
        if (row, key) not in done:  # ROW and ROW:KEY naming the same key
            done.add((row, key))
            rows.append(row)
            keys.append(key)
    for start in range(0, len(rows), ROW_BLOCK):
        block = rows[start : start + ROW_BLOCK]
        yield block_terms(senders.queries[:, block], senders.keys, weights[block].nan_to_num(0.0), seen[block],
                          torch.tensor(keys[start : start + ROW_BLOCK]), scaling=senders.scaling,
                          softcap=senders.softcap, rows=block)  # fmt: skip


def _spans(positions: torch.Tensor) -> str:
    return f"keys {int(positions.min())}-{int(positions.max())}" if len(positions) else "no key"


def qk_writer(path) -> pq.ParquetWriter:
    """qk.parquet's writer: dictionary encoding for the senders' names alone (the numbers and positions hashed into
    dictionaries took longer to write than to split; measured 2.3x)."""
    return pq.ParquetWriter(path, QK_SCHEMA, use_dictionary=["query_sender", "key_sender"])


def table(text_id: int, senders: HeadSenders, terms: RowTerms) -> pa.Table:
    """qk.parquet's rows of one explained row: every (query sender, key sender) pair."""
    count = len(senders.names)
    names = pa.array(senders.names, pa.string())
    query_index = np.repeat(np.arange(count, dtype=np.int32), count)
    key_index = np.tile(np.arange(count, dtype=np.int32), count)
    pairs = count * count

    def constant(value: int) -> pa.Array:
        return pa.array(np.full(pairs, value, dtype=np.int32))

    columns = [constant(text_id), constant(senders.layer), constant(senders.head), constant(terms.row),
               constant(terms.key), pa.DictionaryArray.from_arrays(pa.array(query_index), names),
               pa.DictionaryArray.from_arrays(pa.array(key_index), names), pa.array(terms.term.ravel()),
               pa.array(terms.contrast.ravel())]  # fmt: skip
    return pa.Table.from_arrays(columns, schema=QK_SCHEMA)


def summary(text_id: int, senders: HeadSenders, terms: RowTerms) -> dict:
    """inspect.json's entry of one explained row: the logit, the checks, each side's strongest senders by contrast
    (a query sender's: its row of contrasts summed over the key senders) and the strongest pairs."""
    return {
        "text_id": text_id, "layer": senders.layer, "head": senders.head, "row": terms.row, "key": terms.key,
        "logit": terms.logit, "weight": terms.weight, "contrast": float(terms.contrast.sum()),
        **_sides(senders.names, terms.contrast), "softmax_error": terms.worst_error,
    }  # fmt: skip


PREVIOUS_ROLE = "previous-token"


class ContrastTotals:
    """Each explained head's contrasts summed over its explained rows (every text), for the means per sender pair
    and per side, and k_composition_prev (docs/why.md): one (senders, senders) float64 matrix per head, whatever
    the number of rows."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, int], np.ndarray] = {}
        self.rows: dict[tuple[int, int], int] = {}
        self.names: dict[tuple[int, int], list[str]] = {}

    def add(self, senders: HeadSenders, terms: RowTerms) -> None:
        head = (senders.layer, senders.head)
        if head not in self.sums:
            self.sums[head], self.rows[head], self.names[head] = np.zeros_like(terms.contrast), 0, senders.names
        self.sums[head] += terms.contrast
        self.rows[head] += 1

    def heads(self, roles: dict[tuple[int, int], str] | None) -> list[dict]:
        """inspect.json's entry per explained head: its rows, their mean contrast, each side's strongest senders
        and the strongest pairs by mean contrast, and k_composition_prev (None without `roles`: every head's role,
        from a report or the probes)."""
        previous = None if roles is None else {head_name(*h) for h, role in roles.items() if role == PREVIOUS_ROLE}
        entries = []
        for (layer, head), total in sorted(self.sums.items()):
            names, mean = self.names[(layer, head)], total / self.rows[(layer, head)]
            entries.append({
                "layer": layer, "head": head, "role": None if roles is None else roles.get((layer, head)),
                "rows": self.rows[(layer, head)], "contrast": float(mean.sum()),
                **_sides(names, mean),
                "k_composition_prev": None if previous is None else k_composition(mean, names, previous),
            })  # fmt: skip
        return entries


def k_composition(contrast: np.ndarray, names: list[str], previous: set[str]) -> float | None:
    """The share of what makes the key win on the key side that previous-token heads write: each key sender's
    side (its column of `contrast` summed over the query senders), positive parts only, those of the senders in
    `previous` over every sender's. In [0, 1]; None where no key sender pushes the key up. Positive parts, not
    the signed sum: the other senders' pushes against the key (on SmolLM2, later MLPs) would make a signed share
    pass 1."""
    pushes = np.clip(contrast.sum(0), 0, None)
    whole = float(pushes.sum())
    if whole <= 0:
        return None
    return float(sum(pushes[i] for i, name in enumerate(names) if name in previous) / whole)


def strongest(names: list[str], values: np.ndarray) -> list[list]:
    """The SHOWN senders with the largest `values` by size, as [name, value] (ties in the senders' order)."""
    return [[names[i], round(float(values[i]), 6)] for i in np.argsort(-np.abs(values), kind="stable")[:SHOWN]]


def _sides(names: list[str], contrast: np.ndarray) -> dict:
    """Each side's strongest senders (a query sender's: its row of `contrast` summed over the key senders) and the
    strongest pairs, by size."""
    size = np.abs(contrast).ravel()
    strongest_pairs = np.argpartition(-size, SHOWN)[:SHOWN] if size.size > SHOWN else np.arange(size.size)
    flat = strongest_pairs[np.argsort(-size[strongest_pairs], kind="stable")]
    pairs = [np.unravel_index(i, contrast.shape) for i in flat]
    return {
        "query_side": strongest(names, contrast.sum(1)), "key_side": strongest(names, contrast.sum(0)),
        "pairs": [[names[a], names[b], round(float(contrast[a, b]), 6)] for a, b in pairs],
    }  # fmt: skip


def warn_missed(explained: list[dict], reporter) -> None:
    """One line where a row's split logits miss the model's attention (each row's figures are in inspect.json)."""
    missed = [entry for entry in explained if entry["softmax_error"] > CHECK]
    if missed:
        worst = max(missed, key=lambda entry: entry["softmax_error"])
        name = head_name(worst["layer"], worst["head"])
        reporter.note(f"warning: on {len(missed)} rows the split logits' softmax is off the model's attention by up "
                      f"to {worst['softmax_error']:.2g} (row {worst['row']} of {name}): this model computes its "
                      "attention in a way headscope does not split exactly")  # fmt: skip
