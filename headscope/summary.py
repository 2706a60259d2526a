"""Small pure summaries of the heads table shared by the CLI and the charts."""

from __future__ import annotations

import pandas as pd

from headscope.labels import dormant_status


def importance_column(heads: pd.DataFrame) -> str | None:
    """The importance column to show: exact mean ablation when measured, else its second-order estimate."""
    for column in ("ablation_mean", "estimate_mean"):
        if column in heads and heads[column].notna().any():
            return column
    return None


def most_important(heads: pd.DataFrame, count: int = 10) -> pd.DataFrame:
    """The `count` heads the loss needs most, most first: by exact mean ablation when measured, else by its
    second-order estimate (first order + curvature)."""
    column = importance_column(heads)
    if column is None:
        return heads.iloc[0:0]
    return heads.loc[heads[column].sort_values(ascending=False).index[:count]]


def least_needed(heads: pd.DataFrame, count: int = 10) -> pd.DataFrame:
    """The `count` heads whose removal alone changes the loss least in magnitude (exact, else estimated), least
    first: candidates for `headscope prune`, which verifies removing them together."""
    column = importance_column(heads)
    if column is None:
        return heads.iloc[0:0]
    return heads.loc[heads[column].abs().sort_values().index[:count]]


# The evidence that gives each role (labels.ROLE_RULES): a role's heads are ranked by it (dormant and streaming: the
# least first). previous-token falls back to the corpus's prev_token for heads the probes did not score, as its rule
# does.
ROLE_EVIDENCE: dict[str, str] = {
    "retrieval": "probe_retrieval",
    "induction": "probe_induction",
    "duplicate-token": "probe_duplicate",
    "previous-token": "probe_previous",
    "dormant": "write_ratio",
    "sink": "sink_rate",
    "positional": "top_offset_share",
    "streaming": "far_mass",
    "broad": "norm_entropy",
}
LEAST_FIRST = ("dormant", "streaming")  # roles whose evidence is small: their clearest heads have the least


def top_heads_per_role(heads: pd.DataFrame, count: int = 5) -> list[dict]:
    """Per role that some head has (in the rule's order; "other" has no evidence to rank by): how many heads,
    the evidence column, and the `count` heads with the most of it as (layer, head, score), strongest first (for
    dormant and streaming heads, the least)."""
    found = []
    for role, column in ROLE_EVIDENCE.items():
        mine = heads[heads["role"] == role]
        if mine.empty:
            continue
        score = mine[column] if column in mine else pd.Series(float("nan"), index=mine.index)
        if role == "previous-token" and score.isna().all():
            column, score = "prev_token", mine["prev_token"]
        highest = role not in LEAST_FIRST
        top = mine.assign(score=score).sort_values(["score", "layer", "head"], ascending=[not highest, True, True])
        found.append(
            {
                "role": role,
                "heads": len(mine),
                "evidence": column,
                "top": [(int(r.layer), int(r.head), float(r.score)) for r in top.head(count).itertuples()],
            }
        )
    return found


def off_sink_counts(heads: pd.DataFrame) -> dict[str, int]:
    """How many sink heads do what off the sink (labels.off_sink_behaviour, as role_detail names it), most first;
    empty for a report without role_detail."""
    if "role_detail" not in heads:
        return {}
    behaviour = heads.loc[heads["role"] == "sink", "role_detail"].str.extract(r"off the sink: ([a-z-]+)")[0]
    return {str(name): int(n) for name, n in behaviour.value_counts().items()}


def depth_bands(depth: int) -> dict[str, range]:
    """The one band rule: early, middle and late layers of a model `depth` layers deep.

    early and late are the first and last third (depth // 3 layers, at least one each), middle the layers
    between: GPT-2 small (12 layers) gives 0-3, 4-7, 8-11, the bands of the seed analysis; 13 layers give 0-3,
    4-8, 9-12. A 2-layer model has no middle band, a 1-layer model only an early one. Bands are always of the
    model's depth, whichever layers a run measured.
    """
    width = max(1, depth // 3)
    early = range(0, min(width, depth))
    late = range(max(depth - width, early.stop), depth)
    return {"early": early, "middle": range(early.stop, late.start), "late": late}


def layer_bands(depth: int) -> dict[str, range]:
    """The bands as tables of counts name them ("layers 0-9", ...), the empty ones left out, and all layers."""
    named = {_band_name(band): band for band in depth_bands(depth).values() if len(band)}
    return named | {"all layers": range(depth)}


def _band_name(band: range) -> str:
    return f"layers {band.start}-{band.stop - 1}" if len(band) > 1 else f"layer {band.start}"


def layer_entropy(heads: pd.DataFrame) -> pd.DataFrame:
    """Per layer: mean, standard deviation (over heads, population), min and max of the heads' mean entropy."""
    grouped = heads.groupby("layer")["entropy"]
    return pd.DataFrame(
        {"mean": grouped.mean(), "std": grouped.std(ddof=0), "min": grouped.min(), "max": grouped.max()}
    )


def early_late_entropy(heads: pd.DataFrame, depth: int) -> dict[str, float] | None:
    """Mean head entropy of the early and late bands of a `depth`-layer model, and late minus early (the
    depth gradient). None unless every layer of both bands was measured (a --layers subset that misses one, or
    a model too shallow for two bands).
    """
    bands = depth_bands(depth)
    early, late = bands["early"], bands["late"]
    measured = set(heads["layer"].unique())
    if not len(late) or not set(early).union(late) <= measured:
        return None
    early_mean = float(heads.loc[heads["layer"].isin(early), "entropy"].mean())
    late_mean = float(heads.loc[heads["layer"].isin(late), "entropy"].mean())
    return {
        "early_layers": f"{early.start}-{early.stop - 1}",
        "late_layers": f"{late.start}-{late.stop - 1}",
        "early_band": early,
        "late_band": late,
        "early": early_mean,
        "late": late_mean,
        "gradient": late_mean - early_mean,
    }


def strongest_positions(effects: pd.DataFrame) -> pd.DataFrame:
    """A patching's effects (patching.parquet) one row per head, largest |effect| first: with `--positions each`
    each head at its position of largest |effect|; a head whose effects are all empty (NaN) last."""
    order = effects.assign(size=effects["effect"].abs().fillna(-1)).sort_values("size", ascending=False, kind="stable")
    return order.drop_duplicates(["layer", "head"]).drop(columns="size")


def dormant_line(heads: pd.DataFrame, check: dict | None) -> str | None:
    """What backs the dormant label, in one line: the removal check analyze ran (run.json `dormant_check`), or why
    there is none; None when no head is dormant and nothing was demoted."""
    status = dormant_status(heads)
    demoted = [] if check is None else check.get("demoted", [])
    if status == "none" and not demoted:
        return None
    dormant = int(heads["role"].eq("dormant").sum())
    if status == "verified":
        effect = check.get("effect") or {}
        interval = ""
        if effect.get("delta_ci_low") is not None:
            interval = f" [{effect['delta_ci_low']:+.4f}, {effect['delta_ci_high']:+.4f}]"
        line = (
            f"dormant, checked by removal: its {dormant} heads zeroed together cost {effect['delta']:+.4f} nats"
            f"{interval} on {effect['tokens']:,} tokens (tolerance {check['tolerance']:g})"
        )
        if effect.get("delta_ci_low") is not None and effect["delta_ci_low"] > 0:
            line += ("; its interval excludes 0: within the tolerance, but not free (`headscope ablate --role dormant "
                     "--mode zero` with --corpus or --pairs checks the text or task you care about)")  # fmt: skip
    elif check is not None and check.get("status") == "verified":
        line = f"dormant: unverified, its {dormant} heads are not the ones analyze removed together (other thresholds)"
    else:
        why = "" if check is None else f" ({check.get('why', 'not checked')})"
        line = f"dormant: unverified{why}; `headscope ablate --role dormant --mode zero` checks its {dormant} heads"
    if demoted:
        shown = ", ".join(demoted[:8]) + (", ..." if len(demoted) > 8 else "")
        line += f"; {len(demoted)} demoted, removing them too cost more: {shown}"
    return line


def model_name(record: dict) -> str:
    """How a record's titles name its model: `model.name` (a hub id or alias, or a local folder's or file's own name;
    ModelSource.name), else, in a record written before it, what the user typed."""
    model = record.get("model") if isinstance(record.get("model"), dict) else {}
    return str(model.get("name") or model.get("input", "?"))
