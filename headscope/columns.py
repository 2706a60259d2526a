"""Every column of the heads table, declared once.

A column says where its number comes from (the row sums it is a ratio of, or the step that fills it), its
type, and where else it appears: the per-sentence table, a bootstrap interval, the page's selector, compare's
deltas. estimates.py (sums -> means), tables.py (schemas), report/page.py and report/compare.py derive their
lists from here. A new corpus metric is one entry here plus its per-row value in measures/row_sums.py.

No third-party imports: commands that only read reports import this.
"""

from __future__ import annotations

from dataclasses import dataclass

# Rows at positions below this are left out of `sink_rate` and the top-offset evidence: a row at position p
# sees p + 1 keys, so from position 4 on even uniform attention puts at most 1/5 on the first token.
EVIDENCE_FROM = 4
MAX_OFFSET = 8  # top-offset categories: the first token, offsets 0..MAX_OFFSET back, and anything else
OFFSET_CATEGORIES: tuple[str, ...] = ("first", *(str(k) for k in range(MAX_OFFSET + 1)), "other")
# The probe battery's patterns (headscope.measures.probes); each gives a probe_<pattern> column.
PROBE_PATTERNS: tuple[str, ...] = ("induction", "duplicate", "previous")

# Off the sink (a row's mass renormalised without the sentence's first token): where the largest weight sits, an
# offset 0..MAX_OFFSET back or anything else (the first token is not a place here).
OFFSINK_CATEGORIES: tuple[str, ...] = OFFSET_CATEGORIES[1:]

# Row sums that count rows (denominators), and how many of a sentence's n rows each leaves out in a causal
# model: the first row sees one key (no normalised entropy) and has no previous token; off the sink, the first row
# sees nothing, the second one key, and the previous token of the second is the first token.
ROWS_LEFT_OUT: dict[str, int] = {
    "n_rows": 0,
    "norm_rows": 1,
    "prev_rows": 1,
    "evidence_rows": EVIDENCE_FROM,
    "write_rows": 0,
    "ratio_rows": 0,
    "value_rows": 1,
    "offsink_rows": 1,
    "offsink_norm_rows": 2,
    "offsink_prev_rows": 2,
}


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # Arrow type name: int32, int64, float64, string
    about: str  # what the value is, in one line (the page shows it)
    sums: tuple[str, str] | None = None  # a token-weighted mean of row values: (numerator, denominator) row sums
    slots: tuple[str, ...] = ()  # other row sums it is derived from (estimates.metric_means says how)
    interval: bool = False  # with a 95% bootstrap interval: <name>_ci_low, <name>_ci_high
    per_sentence: bool = False  # also a column of sentence_heads.parquet (float32)
    shown: bool = False  # offered by the page's colour selector
    scale: str = "share"  # its colours (report.palette.SCALES): share (0-1), entropy, or diverging (signed)

    @property
    def numeric(self) -> bool:
        return self.dtype != "string"


SEED_INTERVAL = "95% t-interval over seeds"
SENTENCE_INTERVAL = "95% bootstrap interval over sentences"


def _scored_columns(name: str, about: str, chance: str, interval: str) -> tuple[Column, ...]:
    """A score the page offers, what chance gives it, and the two ends of its interval (of the kind `interval`)."""
    return (
        Column(name, "float64", about, shown=True),
        Column(f"{name}_chance", "float64", chance),
        Column(f"{name}_ci_low", "float64", f"{name}: {interval}, low end"),
        Column(f"{name}_ci_high", "float64", f"{name}: {interval}, high end"),
    )


def _probe_columns(pattern: str) -> tuple[Column, ...]:
    what = {"induction": "the token after an earlier copy", "duplicate": "earlier copies of the token"}.get(
        pattern, "the previous token"
    )
    name = f"probe_{pattern}"
    return (
        *_scored_columns(
            name,
            f"mass on {what}, on repeated random tokens (mean over seeds)",
            f"what uniform attention gives {name}",
            SEED_INTERVAL,
        ),
        Column(f"{name}_offsink", "float64", f"{name} with each row renormalised without the first token", shown=True),
    )


_IMPORTANCE = {
    "ablation_zero": "loss increase (nats) with the head's output set to 0, exact",
    "ablation_mean": "loss increase (nats) with the head's output set to its corpus mean, exact",
    "attribution_zero": "first-order term of ablation_zero (not a ranking of importance: see estimate_zero)",
    "attribution_mean": "first-order term of ablation_mean (it averages out: see estimate_mean)",
    "estimate_zero": "second-order estimate of ablation_zero: first order + curvature (empirical Fisher)",
    "estimate_mean": "second-order estimate of ablation_mean: first order + curvature (empirical Fisher)",
}

# In the heads table's order, the intervals, probes and labels spliced in by HEADS_COLUMNS below.
MEASURED: tuple[Column, ...] = (
    Column("layer", "int32", "layer number"),
    Column("head", "int32", "query head number"),
    Column("kv_head", "int32", "the key/value head it reads (grouped-query attention)"),
    Column("n_rows", "int64", "query rows averaged (tokens)", slots=("n_rows",)),
    Column("nonfinite_rows", "int64", "rows holding NaN or inf, left out of every metric", slots=("nonfinite_rows",)),
    Column("unnormalised_rows", "int64", "rows whose mass is not 1 within 1e-3", slots=("unnormalised_rows",)),
    Column(
        "entropy",
        "float64",
        "-sum A ln A per row (nats)",
        sums=("entropy", "n_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
        scale="entropy",
    ),
    Column(
        "entropy_std", "float64", "standard deviation of the row entropies", slots=("entropy_sq",), per_sentence=True
    ),
    Column(
        "norm_entropy",
        "float64",
        "row entropy / ln(visible keys): 1 uniform, 0 one-hot",
        sums=("norm_entropy", "norm_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
        scale="entropy",
    ),
    Column(
        "diagonal",
        "float64",
        "mass within +-window positions of the query",
        sums=("diagonal", "n_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
    ),
    Column(
        "diagonal_uniform",
        "float64",
        "what diagonal would be under uniform attention",
        sums=("diagonal_uniform", "n_rows"),
        per_sentence=True,
    ),
    Column(
        "sink",
        "float64",
        "mass on the sentence's first token",
        sums=("sink", "n_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
    ),
    Column(
        "prev_token",
        "float64",
        "mass on the previous token",
        sums=("prev_token", "prev_rows"),
        per_sentence=True,
        shown=True,
    ),
    Column(
        "max_weight",
        "float64",
        "largest weight of the row",
        sums=("max_weight", "n_rows"),
        per_sentence=True,
        shown=True,
    ),
    Column(
        "sink_rate",
        "float64",
        "share of rows (position >= 4) whose first-token mass exceeds --sink-threshold",
        sums=("sink_hits", "evidence_rows"),
        shown=True,
    ),
    Column(
        "top_offset",
        "string",
        "where most rows put their largest weight: first, an offset 0-8 back, or other",
        slots=("evidence_rows", *(f"top_{category}" for category in OFFSET_CATEGORIES)),
    ),
    Column("top_offset_share", "float64", "share of rows that top_offset holds", shown=True),
    Column(
        "logit_std",
        "float64",
        "standard deviation of the row's pre-softmax scores over the keys it sees (the softmax's scale)",
        sums=("logit_std", "norm_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
        scale="magnitude",
    ),
    Column(
        "write_norm",
        "float64",
        "norm of what the head writes: ||W_O^h z_h(t)||, its slice of the output projection times its output",
        sums=("write_norm", "write_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
        scale="magnitude",
    ),
    Column(
        "write_ratio",
        "float64",
        "write_norm / the norm of the residual stream entering the layer, per row",
        sums=("write_ratio", "ratio_rows"),
        interval=True,
        per_sentence=True,
        shown=True,
        scale="magnitude",
    ),
    Column(
        "sink_value_ratio",
        "float64",
        "norm of the first token's value vector / the mean value norm over the keys the row sees",
        sums=("sink_value_ratio", "value_rows"),
        per_sentence=True,
        shown=True,
        scale="magnitude",
    ),
    Column(
        "active_rows",
        "float64",
        "share of rows whose first-token mass is at most --sink-threshold (where a sink head is not sinking)",
        sums=("active_hits", "offsink_rows"),
        shown=True,
    ),
    Column(
        "offsink_prev_token",
        "float64",
        "prev_token with the row's mass renormalised without the first token",
        sums=("offsink_prev_token", "offsink_prev_rows"),
        per_sentence=True,
        shown=True,
    ),
    Column(
        "offsink_norm_entropy",
        "float64",
        "norm_entropy of the row's mass renormalised without the first token",
        sums=("offsink_norm_entropy", "offsink_norm_rows"),
        per_sentence=True,
        shown=True,
        scale="entropy",
    ),
    Column(
        "offsink_top_offset",
        "string",
        "top_offset of the rows' mass renormalised without the first token: an offset 0-8 back, or other",
        slots=("offsink_evidence_rows", *(f"offsink_top_{category}" for category in OFFSINK_CATEGORIES)),
    ),
    Column("offsink_top_offset_share", "float64", "share of rows that offsink_top_offset holds", shown=True),
)

# analyze's removal check of the dormant label (interventions.dormant): kept by classify, which re-applies the rule
DORMANT_CHECK = Column(
    "dormant_check",
    "string",
    "the dormant label's removal check: verified (removed with the other dormant heads within --dormant-tolerance), "
    "demoted (removing it with them cost more: the role rule went on to its next test), or empty",
)

# What the head's weights copy, with no data (measures.ov_circuits; Elhage et al. 2021).
OV_COPYING = Column(
    "ov_copying",
    "float64",
    "the OV circuit's copying score, from the weights: sum(eigenvalues) / sum(|eigenvalues|) of W_U W_O W_V W_E, "
    "norm gains folded in; +1 raises the attended token's logit, -1 lowers it (copy suppression)",
    shown=True,
    scale="diverging",
)

LABELS: tuple[Column, ...] = (
    Column(
        "locality", "float64", "(diagonal - diagonal_uniform) / (1 - diagonal_uniform)", shown=True, scale="diverging"
    ),
    Column("head_type", "string", "local, copy, broad or mixed"),
    Column("type_reason", "string", "the evidence that decided the head type"),
    Column(
        "role",
        "string",
        "retrieval, induction, duplicate-token, previous-token, dormant, sink, positional, streaming, broad or other",
    ),
    Column("role_reason", "string", "the evidence that decided the role"),
    Column("role_detail", "string", "for a sink head, what it does off the sink (empty for other roles)"),
)

INTERVAL_METRICS: tuple[str, ...] = tuple(c.name for c in MEASURED if c.interval)
# What schema 6 added (issue 33): what heads write, their logit scale, what they do off the sink, and the role detail.
WRITTEN_AND_OFF_SINK: tuple[str, ...] = (
    *(
        name
        for c in MEASURED[[c.name for c in MEASURED].index("logit_std") :]
        for name in (c.name, *((f"{c.name}_ci_low", f"{c.name}_ci_high") if c.interval else ()))
    ),
    "role_detail",
    *(f"probe_{pattern}_offsink" for pattern in PROBE_PATTERNS),
)
IMPORTANCE_COLUMNS: tuple[str, ...] = tuple(_IMPORTANCE)


def _interval_columns() -> tuple[Column, ...]:
    return tuple(
        Column(f"{name}_ci_{side}", "float64", f"{name}: 95% bootstrap interval over sentences, {side} end")
        for name in INTERVAL_METRICS
        for side in ("low", "high")
    )


# The retrieval probe (measures.retrieval; Wu et al. 2024), with --retrieval-length.
RETRIEVAL: tuple[Column, ...] = _scored_columns(
    "probe_retrieval",
    "share of a long sequence's repeated span where the head's strongest key is the token after the span's first copy "
    "(mean over seeds)",
    "what a key drawn uniformly gives probe_retrieval",
    SEED_INTERVAL,
)

# What a streaming KV cache of the first --stream-sink and last --stream-window keys would drop (docs/streaming.md):
# read in the corpus pass as headscope's own detector, far:S,W (measures.detectors; run.head_evidence.FAR_MASS).
STREAMING: tuple[Column, ...] = _scored_columns(
    "far_mass",
    "mass on keys outside the sentence's first --stream-sink and the row's last --stream-window (what a streaming KV "
    "cache drops), over the rows that have such keys",
    "what uniform attention gives far_mass on the same rows",
    SENTENCE_INTERVAL,
)

# Every column of heads.parquet, in order.
HEADS_COLUMNS: tuple[Column, ...] = (
    *MEASURED,
    *_interval_columns(),
    *(column for pattern in PROBE_PATTERNS for column in _probe_columns(pattern)),
    *RETRIEVAL,
    *STREAMING,
    *(Column(name, "float64", about, shown=True, scale="diverging") for name, about in _IMPORTANCE.items()),
    OV_COPYING,
    DORMANT_CHECK,
    *LABELS,
)
COLUMNS: dict[str, Column] = {column.name: column for column in HEADS_COLUMNS}
# What analyze measures (everything before the labels): classify keeps these and re-derives the rest.
MEASURED_COLUMNS: tuple[str, ...] = tuple(c.name for c in HEADS_COLUMNS if c not in LABELS)
IDS: tuple[str, ...] = ("layer", "head", "kv_head")
# The numeric columns compare gives as X_a, X_b and X_delta: not the ends of an interval nor what chance gives
# (their difference means nothing; the delta has its own interval).
DELTAS: tuple[str, ...] = tuple(
    c.name
    for c in HEADS_COLUMNS
    if c.numeric and c.name not in IDS and not c.name.endswith(("_ci_low", "_ci_high", "_chance"))
)
# Measured on the model alone (not the corpus): two reports of one model have the same, and no delta to show.
MODEL_ONLY: tuple[str, ...] = (*(f"probe_{pattern}" for pattern in PROBE_PATTERNS), "probe_retrieval")
COUNTS: tuple[str, ...] = tuple(c.name for c in MEASURED if c.dtype == "int64")  # row counts, as integers
PER_SENTENCE: tuple[str, ...] = tuple(c.name for c in MEASURED if c.per_sentence)
# metric -> (numerator, denominator) row sums
RATIOS: dict[str, tuple[str, str]] = {c.name: c.sums for c in MEASURED if c.sums is not None}
# The row sums the statistics keep per (sentence, head), in order: every numerator and denominator, then the
# other slots, each once.
STATS: tuple[str, ...] = tuple(dict.fromkeys(slot for c in MEASURED for slot in (*(c.sums or ()), *c.slots)))
STAT_INDEX: dict[str, int] = {name: i for i, name in enumerate(STATS)}
