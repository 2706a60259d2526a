"""Head labels from the per-head table: pure functions, no model, no I/O.

Two labels per head, each from an ordered rule (the first test that matches wins) with its evidence kept in
a `*_reason` column.

Types, the seed analysis's four (Thresholds):
    local  locality >= local_min_locality             attends to its neighbourhood
    copy   norm_entropy <= copy_max_norm_entropy      locks onto one or two tokens
    broad  norm_entropy >= broad_min_norm_entropy     spreads its attention widely
    mixed  anything else
Locality comes first because a previous-token head is also sharply peaked (low entropy): checking
entropy first would call it a copy head.

Roles, the finer answer the literature names (RoleThresholds; the order and why is in docs/labels.md):
    retrieval                                    from the retrieval probe (with --retrieval-length)
    induction, duplicate-token, previous-token   from the probe battery's scores
    dormant                                      write_ratio on the corpus: it writes next to nothing, and
                                                 (dormant_check) removing the dormant heads together was not
                                                 found to cost more than the tolerance
    sink                                         sink_rate on the corpus (role_detail: what it does off the sink)
    positional                                   a fixed top_offset holding most rows' largest weight
    streaming                                    far_mass: next to nothing outside what a streaming KV cache keeps
    broad                                        norm_entropy, as for the type
    other                                        anything else
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import numpy as np
import pandas as pd

from headscope.columns import OFFSET_CATEGORIES
from headscope.config import RoleThresholds, Thresholds

HeadType = Literal["local", "copy", "broad", "mixed"]
HEAD_TYPES: tuple[HeadType, ...] = ("local", "copy", "broad", "mixed")
Role = Literal[
    "retrieval",
    "induction",
    "duplicate-token",
    "previous-token",
    "dormant",
    "sink",
    "positional",
    "streaming",
    "broad",
    "other",
]
ROLES: tuple[Role, ...] = get_args(Role)  # in the role rule's order
FIXED_OFFSETS = tuple(category for category in OFFSET_CATEGORIES if category.isdigit())  # "0" (itself), "1", ...

# type -> (test on the heads table, reason shown for heads that pass it). Order is the rule's order.
Rule = tuple[Callable[[pd.DataFrame, Thresholds], pd.Series], Callable[[pd.Series, Thresholds], str]]
RULES: dict[HeadType, Rule] = {
    "local": (
        lambda h, t: h["locality"] >= t.local_min_locality,
        lambda r, t: f"locality {r.locality:.3f} >= {t.local_min_locality}",
    ),
    "copy": (
        lambda h, t: h["norm_entropy"] <= t.copy_max_norm_entropy,
        lambda r, t: f"norm_entropy {r.norm_entropy:.3f} <= {t.copy_max_norm_entropy}",
    ),
    "broad": (
        lambda h, t: h["norm_entropy"] >= t.broad_min_norm_entropy,
        lambda r, t: f"norm_entropy {r.norm_entropy:.3f} >= {t.broad_min_norm_entropy}",
    ),
}


def locality(diagonal: pd.Series, diagonal_uniform: pd.Series) -> pd.Series:
    """(diagonal - diagonal_uniform) / (1 - diagonal_uniform); NaN where uniform already fills the band."""
    room = 1.0 - diagonal_uniform
    return (diagonal - diagonal_uniform) / room.where(room > 1e-12)


def _previous_evidence(heads: pd.DataFrame) -> pd.Series:
    """probe_previous, or the corpus's prev_token for heads the probes did not score."""
    return heads["probe_previous"].fillna(heads["prev_token"])


def _column(heads: pd.DataFrame, name: str) -> pd.Series:
    """A column schema 10 added (far_mass, probe_retrieval), NaN where a table has none (a table of its own making)."""
    return heads[name] if name in heads else pd.Series(np.nan, index=heads.index)


def _demoted(heads: pd.DataFrame) -> pd.Series:
    """Heads that analyze's removal check took the dormant label from (interventions.dormant)."""
    if "dormant_check" not in heads:
        return pd.Series(False, index=heads.index)
    return heads["dormant_check"].eq("demoted").fillna(False).astype(bool)


def dormant_status(labelled: pd.DataFrame) -> str:
    """Is the dormant label checked? "verified": its heads are exactly those analyze removed together within the
    tolerance; "unverified": no check, or the heads differ (other thresholds since); "none": no head is dormant."""
    dormant = labelled["role"].eq("dormant")
    if not dormant.any():
        return "none"
    if "dormant_check" not in labelled:
        return "unverified"
    return "verified" if dormant.equals(labelled["dormant_check"].eq("verified")) else "unverified"


def _probe_reason(column: str):
    def reason(row, r: RoleThresholds, t: Thresholds) -> str:
        score, chance = getattr(row, column), getattr(row, f"{column}_chance")
        return f"{column} {score:.3f} >= {r.probe_min} (chance {chance:.3f})"

    return reason


def _previous_reason(row, r: RoleThresholds, t: Thresholds) -> str:
    if pd.notna(row.probe_previous):
        return _probe_reason("probe_previous")(row, r, t)
    return f"prev_token {row.prev_token:.3f} >= {r.probe_min} (no probes)"


# The roles the probes name -> the probe pattern (and exemplar kind) that shows each; they show on the probe sequence.
PROBE_ROLES: dict[str, str] = {"induction": "induction", "duplicate-token": "duplicate", "previous-token": "previous"}

# role -> (test on the heads table, reason for heads that pass it). Order is the rule's order.
RoleRule = tuple[
    Callable[[pd.DataFrame, RoleThresholds, Thresholds], pd.Series],
    Callable[[pd.Series, RoleThresholds, Thresholds], str],
]
ROLE_RULES: dict[Role, RoleRule] = {
    "retrieval": (
        lambda h, r, t: _column(h, "probe_retrieval") >= r.retrieval_min,
        lambda row, r, t: (
            f"probe_retrieval {row.probe_retrieval:.3f} >= {r.retrieval_min} (chance {row.probe_retrieval_chance:.3f})"
        ),
    ),
    "induction": (lambda h, r, t: h["probe_induction"] >= r.probe_min, _probe_reason("probe_induction")),
    "duplicate-token": (lambda h, r, t: h["probe_duplicate"] >= r.probe_min, _probe_reason("probe_duplicate")),
    "previous-token": (lambda h, r, t: _previous_evidence(h) >= r.probe_min, _previous_reason),
    "dormant": (
        lambda h, r, t: (h["write_ratio"] < r.dormant_max_write_ratio) & ~_demoted(h),
        lambda row, r, t: f"write_ratio {row.write_ratio:.4f} < {r.dormant_max_write_ratio}",
    ),
    "sink": (
        lambda h, r, t: h["sink_rate"] >= r.sink_rate_min,
        lambda row, r, t: f"sink_rate {row.sink_rate:.3f} >= {r.sink_rate_min}",
    ),
    "positional": (
        lambda h, r, t: h["top_offset"].isin(FIXED_OFFSETS) & (h["top_offset_share"] >= r.offset_share_min),
        lambda row, r, t: f"top_offset {row.top_offset} in {row.top_offset_share:.3f} of rows >= {r.offset_share_min}",
    ),
    "streaming": (
        lambda h, r, t: _column(h, "far_mass") <= r.streaming_max_far_mass,
        lambda row, r, t: f"far_mass {row.far_mass:.3f} <= {r.streaming_max_far_mass}",
    ),
    "broad": (
        lambda h, r, t: h["norm_entropy"] >= t.broad_min_norm_entropy,
        lambda row, r, t: f"norm_entropy {row.norm_entropy:.3f} >= {t.broad_min_norm_entropy}",
    ),
}


def _first_match(tests: list[pd.Series], names: list[str], default: str) -> pd.Series:
    """Per row, the name of the first test it passes (NaN evidence passes nothing), else `default`."""
    index = tests[0].index if tests else None
    passed = [test.to_numpy(dtype=bool, na_value=False) for test in tests]
    return pd.Series(np.select(passed, names, default) if tests else default, index=index, dtype=object)


def classify_heads(heads: pd.DataFrame, thresholds: Thresholds) -> pd.DataFrame:
    """A copy of `heads` with `locality`, `head_type` and `type_reason` (the evidence) set."""
    out = _typed(heads, thresholds)
    out["type_reason"] = [_reason(row, thresholds) for row in out.itertuples()]
    return out


def _typed(heads: pd.DataFrame, thresholds: Thresholds) -> pd.DataFrame:
    """A copy of `heads` with `locality` and `head_type` set (no reasons yet)."""
    out = heads.copy()
    out["locality"] = locality(out["diagonal"], out["diagonal_uniform"])
    out["head_type"] = _first_match([test(out, thresholds) for test, _ in RULES.values()], list(RULES), "mixed")
    return out


def _reason(row, thresholds: Thresholds) -> str:
    if row.head_type in RULES:
        return RULES[row.head_type][1](row, thresholds)
    return (
        f"locality {row.locality:.3f} < {thresholds.local_min_locality}, norm_entropy {row.norm_entropy:.3f} "
        f"between {thresholds.copy_max_norm_entropy} and {thresholds.broad_min_norm_entropy}"
    )


def assign_roles(heads: pd.DataFrame, roles: RoleThresholds, thresholds: Thresholds) -> pd.DataFrame:
    """A copy of `heads` with `role` and `role_reason` set."""
    out = heads.copy()
    role = _role(out, roles, thresholds)
    _set_roles(out, role, list(out.assign(role=role).itertuples()), roles, thresholds)
    return out


def _role(heads: pd.DataFrame, roles: RoleThresholds, thresholds: Thresholds) -> pd.Series:
    return _first_match([test(heads, roles, thresholds) for test, _ in ROLE_RULES.values()], list(ROLE_RULES), "other")


def _set_roles(out: pd.DataFrame, role: pd.Series, rows: list, roles: RoleThresholds, thresholds: Thresholds) -> None:
    """`role`, `role_reason` and `role_detail` into `out`, the reasons from its rows read once (a row of some eighty
    columns costs more to build than to read) with `role` among them."""
    out["role"] = role
    reasons = [_role_reason(row, roles, thresholds) for row in rows]
    # the dormant label says whether removal backed it; a demoted head says why it is not dormant
    checked = {"verified": "removal verified", "unverified": "removal not verified"}.get(dormant_status(out))
    demoted = _demoted(out).to_numpy()
    for index, row in enumerate(rows):
        if row.role == "dormant":
            reasons[index] += f"; {checked}"
        elif demoted[index]:
            reasons[index] += (
                f"; not dormant: write_ratio {row.write_ratio:.4f}, but removing it with the quieter heads cost more "
                "than the tolerance"
            )
    out["role_reason"] = reasons
    out["role_detail"] = [off_sink_detail(row, roles, thresholds) if row.role == "sink" else None for row in rows]


def off_sink_behaviour(row, roles: RoleThresholds, thresholds: Thresholds) -> tuple[str, str]:
    """What a head does with the mass it keeps off the sink (its rows renormalised without the first token), by the
    role rule's own tests in its order on the off-sink evidence: (behaviour, the number that decided it).

    induction, duplicate-token  probe_<pattern>_offsink >= probe_min
    previous-token  probe_previous_offsink >= probe_min (offsink_prev_token on the corpus without probes)
    positional      offsink_top_offset a fixed offset holding >= offset_share_min of rows
    broad           offsink_norm_entropy >= broad_min_norm_entropy
    mixed           anything else (its off-sink norm entropy given)
    """
    probes = {"induction": "probe_induction_offsink", "duplicate-token": "probe_duplicate_offsink"}
    for behaviour, column in probes.items():
        score = getattr(row, column, float("nan"))
        if pd.notna(score) and score >= roles.probe_min:
            return behaviour, f"{score:.2f}"
    previous = getattr(row, "probe_previous_offsink", float("nan"))
    previous = row.offsink_prev_token if pd.isna(previous) else previous
    if pd.notna(previous) and previous >= roles.probe_min:
        return "previous-token", f"{previous:.2f}"
    offset, share = row.offsink_top_offset, row.offsink_top_offset_share
    if offset in FIXED_OFFSETS and pd.notna(share) and share >= roles.offset_share_min:
        where = "itself" if offset == "0" else f"{offset} back"
        return "positional", f"{where} in {share:.2f} of rows"
    entropy = row.offsink_norm_entropy
    if pd.notna(entropy) and entropy >= thresholds.broad_min_norm_entropy:
        return "broad", f"norm entropy {entropy:.2f}"
    return "mixed", f"norm entropy {entropy:.2f}"


def off_sink_detail(row, roles: RoleThresholds, thresholds: Thresholds) -> str | None:
    """role_detail of a sink head: "sink; off the sink: previous-token (0.71)", with the share of rows where it
    is not sinking; None for a report from before headscope measured it (schema < 6)."""
    if pd.isna(row.active_rows):
        return None
    behaviour, evidence = off_sink_behaviour(row, roles, thresholds)
    return f"sink; off the sink: {behaviour} ({evidence}); active in {row.active_rows:.2f} of rows"


def full_label(labelled: pd.DataFrame) -> pd.Series:
    """Each head's role with what its detail names: "sink: previous-token" for a sink head that is a previous-token
    head off the sink, the role alone otherwise."""
    behaviour = labelled["role_detail"].str.extract(r"off the sink: ([a-z-]+)", expand=False)
    return labelled["role"].where(behaviour.isna(), labelled["role"] + ": " + behaviour)


def label_heads(heads: pd.DataFrame, thresholds: Thresholds, roles: RoleThresholds) -> pd.DataFrame:
    """Both labels: the head type (with locality) and the role, each with its reason. The same columns as
    assign_roles(classify_heads(...)), with the table's rows read once for both reasons (each reading of some
    eighty columns costs about 10 ms for 270 heads)."""
    out = _typed(heads, thresholds)
    role = _role(out, roles, thresholds)
    rows = list(out.assign(role=role).itertuples())
    out["type_reason"] = [_reason(row, thresholds) for row in rows]
    _set_roles(out, role, rows, roles, thresholds)
    return out


def _role_reason(row, roles: RoleThresholds, thresholds: Thresholds) -> str:
    if row.role in ROLE_RULES:
        return ROLE_RULES[row.role][1](row, roles, thresholds)
    probes = [getattr(row, f"probe_{p}") for p in ("induction", "duplicate", "previous")]
    best = max((p for p in probes if pd.notna(p)), default=float("nan"))
    return (
        f"no rule matched: best probe {best:.3f}, sink_rate {row.sink_rate:.3f}, top_offset {row.top_offset} "
        f"in {row.top_offset_share:.3f} of rows, norm_entropy {row.norm_entropy:.3f}"
    )


def label_counts(
    labelled: pd.DataFrame, column: str, names: tuple[str, ...], bands: dict[str, range] | None = None
) -> pd.DataFrame:
    """Heads per label of `column` (head_type or role): overall, or per named band of layers."""
    bands = bands or {"all layers": range(int(labelled["layer"].max()) + 1)}
    rows = {}
    for name, layers in bands.items():
        in_band = labelled[labelled["layer"].isin(layers)]
        rows[name] = in_band[column].value_counts().reindex(names, fill_value=0)
    return pd.DataFrame(rows).T


def most_typical(classified: pd.DataFrame, thresholds: Thresholds) -> dict[str, tuple[int, int]]:
    """For each type present, the (layer, head) deepest inside its type's region."""
    middle = (thresholds.copy_max_norm_entropy + thresholds.broad_min_norm_entropy) / 2
    score = {
        "local": classified["locality"],
        "copy": -classified["norm_entropy"],
        "broad": classified["norm_entropy"],
        "mixed": -(classified["norm_entropy"] - middle).abs(),
    }
    chosen = {}
    for name in HEAD_TYPES:
        members = classified["head_type"] == name
        if members.any():
            best = score[name][members].astype(float).fillna(-np.inf).idxmax()
            chosen[name] = (int(classified.at[best, "layer"]), int(classified.at[best, "head"]))
    return chosen


def classification_record(labelled: pd.DataFrame, thresholds: Thresholds, roles: RoleThresholds) -> dict:
    """What run.json and the Parquet metadata say about the labels: both rules and their counts."""
    types = labelled["head_type"].value_counts().reindex(HEAD_TYPES, fill_value=0)
    role_counts = labelled["role"].value_counts().reindex(ROLES, fill_value=0)
    return {
        "thresholds": thresholds.to_dict(),
        "counts": {name: int(n) for name, n in types.items()},
        "role_thresholds": roles.to_dict(),
        "role_counts": {name: int(n) for name, n in role_counts.items()},
        "dormant": dormant_status(labelled),  # is the dormant label backed by analyze's removal check?
    }
