"""Every setting (RunConfig field) and every option of `headscope analyze`, each with a check of what it does.

An entry either proves the change the docs promise (against a hand computation on the planted GPT-2, whose
layer-0 heads have attention known in closed form, or against a second computation), or proves the option
changes no number. A setting or option without an entry fails `test_every_setting_and_option_has_an_entry`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import typer

import headscope
from headscope.cli import app
from headscope.columns import IMPORTANCE_COLUMNS
from headscope.config import SETTINGS, RoleThresholds, Thresholds
from headscope.labels import assign_roles, classify_heads
from headscope.model.loading import load_for_run
from headscope.progress import NullReporter

from helpers import Interrupting, assert_same_exemplars, run_cli, tiny_model_folder
from planted import (
    COPY_LOGIT,
    COPY_VOCAB,
    FIRST,
    PREVIOUS,
    UNIFORM,
    build_planted_copier,
    build_planted_induction,
    copy_words,
    expected_attention,
    induction_words,
)

# Options of the command that are not settings: where the run reads and writes, and the label rules.
ANALYZE_OPTIONS = {p.name for p in typer.main.get_command(app).commands["analyze"].params} - {"model", "ctx"}
FAST = {"probe_seeds": 2, "bootstrap": 20}  # enough for every column to exist, cheap


@pytest.fixture(scope="module")
def texts(corpus_lines) -> list[str]:
    return corpus_lines[:16]


@pytest.fixture(scope="module")
def baseline(planted_gpt2, texts):
    return headscope.analyze(str(planted_gpt2), texts, **FAST)


def numbers(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.select_dtypes("number")


def assert_same_numbers(report, baseline, atol: float = 0.0, *, without: tuple[str, ...] = ()) -> None:
    """Every measured number of heads and sentence_heads (but `without`) equal within `atol`, labels identical."""
    for name in ("heads", "sentence_heads"):
        got, want = (numbers(getattr(r, name)).drop(columns=list(without), errors="ignore") for r in (report, baseline))
        np.testing.assert_allclose(got.to_numpy(float), want.to_numpy(float), rtol=0, atol=atol, err_msg=name)
    labels = [c for c in report.heads.columns if not pd.api.types.is_numeric_dtype(report.heads[c])]
    pd.testing.assert_frame_equal(report.heads[labels], baseline.heads[labels], obj="labels")


def layer0_hand_mean(report, head: int, row_value) -> float:
    """The token-weighted mean over every row of every sentence of row_value(A[t], t) for a planted layer-0
    head, A from its closed form at each sentence's length."""
    total, rows = 0.0, 0
    for n in report.sentences["n_tokens"]:
        attention = expected_attention(head, int(n))
        for t in range(int(n)):
            total += row_value(attention[t], t)
            rows += 1
    return total / rows


def layer0(report) -> pd.DataFrame:
    return report.heads[report.heads["layer"] == 0].set_index("head")


# ---------------------------------------------------------------- settings that change what is measured


def check_window(planted, texts, baseline, tmp_path):
    for window in (0, 5):
        report = headscope.analyze(str(planted), texts, window=window, **FAST)
        for head in (UNIFORM, PREVIOUS, FIRST):
            hand = layer0_hand_mean(report, head, lambda row, t, w=window: row[max(0, t - w) : t + 1].sum())
            assert layer0(report).at[head, "diagonal"] == pytest.approx(hand, abs=1e-6), (window, head)
    assert layer0(baseline).at[UNIFORM, "diagonal"] != layer0(report).at[UNIFORM, "diagonal"]


def check_sink_threshold(planted, texts, baseline, tmp_path):
    for threshold in (0.01, 0.15, 0.99):
        report = headscope.analyze(str(planted), texts, sink_threshold=threshold, **FAST)
        for head in (UNIFORM, PREVIOUS, FIRST):
            hits = layer0_hand_mean(report, head, lambda row, t, x=threshold: float(t >= 4 and row[0] > x))
            share = layer0_hand_mean(report, head, lambda row, t: float(t >= 4))
            assert layer0(report).at[head, "sink_rate"] == pytest.approx(hits / share, abs=1e-9), (threshold, head)
    rates = {
        t: layer0(headscope.analyze(str(planted), texts, sink_threshold=t, **FAST)).at[UNIFORM, "sink_rate"]
        for t in (0.01, 0.99)
    }
    assert rates[0.01] == 1.0 and rates[0.99] == 0.0  # uniform rows put 1/(t+1) on the first token


def check_max_length(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, max_length=5, **FAST)
    sentences = report.sentences
    assert sentences["n_tokens"].max() == 5
    assert sentences["truncated"].tolist() == (baseline.sentences["n_tokens"] > 5).tolist()
    assert report.run["corpus"]["truncated_sentences"] == int((baseline.sentences["n_tokens"] > 5).sum())
    hand = layer0_hand_mean(report, UNIFORM, lambda row, t: math.log(t + 1))  # uniform over t + 1 keys
    assert layer0(report).at[UNIFORM, "entropy"] == pytest.approx(hand, abs=1e-6)


def check_layers(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, layers=(1,), **FAST)
    assert report.heads["layer"].unique().tolist() == [1]
    mine, theirs = report.heads.set_index("head"), baseline.heads[baseline.heads["layer"] == 1].set_index("head")
    for column in ("entropy", "diagonal", "sink", "sink_rate", "probe_previous"):
        np.testing.assert_allclose(mine[column], theirs[column], rtol=0, atol=1e-6, err_msg=column)
    assert report.depth == baseline.depth == 2 and report.bands == baseline.bands  # bands of the model's depth


def check_sentence_heads(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, sentence_heads=False, **FAST)
    assert report.sentence_heads is None and baseline.sentence_heads is not None
    np.testing.assert_array_equal(numbers(report.heads).to_numpy(float), numbers(baseline.heads).to_numpy(float))


def check_probes(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, probes=False, **FAST)
    assert report.heads["probe_induction"].isna().all() and baseline.heads["probe_induction"].notna().all()
    assert report.run["probes"] is None


def check_copying(planted, texts, baseline, tmp_path):
    """--no-copying computes no ov_copying and changes no other number. (The planted GPT-2's token embeddings are
    zero, so its scores are NaN either way: test_copying.py checks the column's values on heads planted to copy.)"""
    report = headscope.analyze(str(planted), texts, copying=False, **FAST)
    assert report.run["copying"]["from"] == "--no-copying" and report.run["timings"]["copying_seconds"] < 1e-3
    assert baseline.run["copying"]["from"].startswith("the LM head")
    assert_same_numbers(report, baseline, without=("ov_copying",))


def check_probe_seeds(planted, texts, baseline, tmp_path):
    from transformers import GPT2Config, GPT2Model

    report = headscope.analyze(str(planted), texts, **{**FAST, "probe_seeds": 3})
    assert report.run["probes"]["seeds"] == 3
    # The planted model sees positions only (its token embeddings are zero): every seed scores the same, so the
    # interval collapses onto the score whatever the number of seeds.
    np.testing.assert_allclose(report.heads["probe_previous"], baseline.heads["probe_previous"], atol=1e-6)
    np.testing.assert_allclose(report.heads["probe_previous_ci_low"], report.heads["probe_previous"], atol=1e-6)
    # A model that reads its tokens scores each seed differently: a third seed moves the means, and the
    # t-interval gets 2 degrees of freedom instead of 1.
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=80)
    reading = tiny_model_folder(tmp_path / "reads-tokens", config, GPT2Model, texts)
    two, three = (headscope.analyze(str(reading), texts, probe_seeds=n, bootstrap=0) for n in (2, 3))
    assert not np.array_equal(two.heads["probe_induction"], three.heads["probe_induction"])
    width = {r: r.heads["probe_induction_ci_high"] - r.heads["probe_induction_ci_low"] for r in (two, three)}
    assert (width[two] > 0).all() and not np.allclose(width[two], width[three])


def check_probe_length(planted, texts, baseline, tmp_path):
    length = 5  # two copies of 5 random tokens; the planted tokenizer puts nothing before them
    report = headscope.analyze(str(planted), texts, **{**FAST, "probe_length": length})
    previous = np.mean([1 / (p + 1) for p in range(1, 2 * length)])  # one target of p + 1 keys, rows p >= 1
    induction = np.mean([1 / (p + 1) for p in range(length, 2 * length)])  # one target, rows in the repeat
    assert report.heads["probe_previous_chance"].iloc[0] == pytest.approx(previous, abs=1e-9)
    assert report.heads["probe_induction_chance"].iloc[0] == pytest.approx(induction, abs=1e-9)
    hand = np.mean([expected_attention(PREVIOUS, 2 * length)[p, p - 1] for p in range(1, 2 * length)])
    assert layer0(report).at[PREVIOUS, "probe_previous"] == pytest.approx(hand, abs=1e-6)


def check_bootstrap(planted, texts, baseline, tmp_path):
    none = headscope.analyze(str(planted), texts, **{**FAST, "bootstrap": 0})
    assert none.heads["entropy_ci_low"].isna().all() and none.run["bootstrap"] is None
    heads = baseline.heads
    assert (heads["entropy_ci_low"] <= heads["entropy"] + 1e-12).all()
    assert (heads["entropy"] <= heads["entropy_ci_high"] + 1e-12).all()
    assert (heads["entropy_ci_high"] > heads["entropy_ci_low"]).any()


def check_bootstrap_seed(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, bootstrap_seed=1, **FAST)
    assert report.run["bootstrap"]["seed"] == 1
    np.testing.assert_array_equal(report.heads["entropy"], baseline.heads["entropy"])
    assert not np.array_equal(report.heads["entropy_ci_low"], baseline.heads["entropy_ci_low"])


def check_importance(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, importance="fast", **FAST)
    assert report.heads["attribution_mean"].notna().all() and report.heads["ablation_mean"].isna().all()
    assert baseline.heads["attribution_mean"].isna().all() and report.run["importance"]["mode"] == "fast"
    assert_same_numbers(report, baseline, without=IMPORTANCE_COLUMNS)


ALL_CANDIDATES = RoleThresholds(dormant_max_write_ratio=1.0)  # every head without a probe role is a dormant candidate


def check_check_dormant(planted, texts, baseline, tmp_path):
    """On: the candidates removed together (verified or demoted, each one); off: no check pass, the label
    unverified, and every measured number as with it."""
    checked = headscope.analyze(str(planted), texts, roles=ALL_CANDIDATES, **FAST)
    unchecked = headscope.analyze(str(planted), texts, roles=ALL_CANDIDATES, check_dormant=False, **FAST)
    candidates = checked.heads["role"].eq("dormant") | checked.heads["dormant_check"].eq("demoted")
    assert candidates.sum() >= 2 and checked.heads.loc[candidates, "dormant_check"].notna().all()
    assert checked.run["dormant_check"]["status"] == "verified" and checked.run["timings"]["dormant_check_seconds"] > 0
    assert unchecked.run["dormant_check"] == {**unchecked.run["dormant_check"], "status": "unverified",
                                              "why": "--no-check-dormant"}  # fmt: skip
    assert unchecked.heads["dormant_check"].isna().all() and unchecked.run["timings"]["dormant_check_seconds"] == 0
    assert unchecked.run["classification"]["dormant"] == "unverified"
    measured = [c for c in numbers(checked.heads).columns]
    pd.testing.assert_frame_equal(checked.heads[measured], unchecked.heads[measured])


def check_dormant_tolerance(planted, texts, baseline, tmp_path):
    """On the quiet copier (its one head writes 0.35 of the residual stream and carries the whole loss; the rest
    write nothing): a tolerance under what zeroing it costs (ln V - the clean loss) demotes it, one above keeps it."""
    model = str(build_planted_copier(tmp_path / "model", quiet=0.1))
    repeated = [" ".join([word] * 8) for word in copy_words()]
    tight, loose = (
        headscope.analyze(model, repeated, roles=ALL_CANDIDATES, dormant_tolerance=tolerance, probes=False, bootstrap=0)
        for tolerance in (0.02, 100.0)
    )
    cost = math.log(COPY_VOCAB) - math.log1p((COPY_VOCAB - 1) * math.exp(-COPY_LOGIT))
    assert tight.run["dormant_check"]["demoted"] == ["0.0"] and loose.run["dormant_check"]["demoted"] == []
    assert loose.run["dormant_check"]["effect"]["delta"] == pytest.approx(cost, rel=1e-5)
    assert tight.run["dormant_check"]["effect"]["delta"] == 0.0  # the heads that write nothing
    assert tight.heads.set_index(["layer", "head"]).loc[(0, 0), "role"] == "positional"


def check_dtype(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, dtype="bfloat16", **FAST)
    assert report.run["dtype"] == "bfloat16" and baseline.run["dtype"] == "float32"
    difference = np.abs(report.heads["entropy"] - baseline.heads["entropy"])
    assert 0 < difference.max() < 0.05  # bfloat16 keeps ~3 significant digits


def check_text_column(planted, texts, baseline, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": i, "sentence": text}) + "\n" for i, text in enumerate(texts)))
    report = headscope.analyze(str(planted), path, text_column="sentence", **FAST)
    assert report.sentences["text"].tolist() == texts
    assert_same_numbers(report, baseline)


def check_encoding_errors(planted, texts, baseline, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(("\n".join(texts[:3]) + "\n").encode() + b"caf\xe9 au lait\n")
    replaced = headscope.analyze(str(planted), path, encoding_errors="replace", **FAST)
    skipped = headscope.analyze(str(planted), path, encoding_errors="skip", **FAST)
    assert replaced.sentences["text"].tolist()[-1] == "caf\ufffd au lait"
    assert skipped.sentences["text"].tolist() == texts[:3]
    assert replaced.run["corpus"]["invalid_utf8_lines"] == skipped.run["corpus"]["invalid_utf8_lines"] == 1
    with pytest.raises(headscope.HeadscopeError, match="invalid UTF-8"):
        headscope.analyze(str(planted), path, **FAST)


def check_exemplars(planted, texts, baseline, tmp_path):
    """--exemplars N keeps the N strongest rows per head and kind, the first N of the default's 10 (ties aside), and
    changes no number; 0 keeps none."""
    report = headscope.analyze(str(planted), texts, exemplars=3, **FAST)
    three, ten = report.exemplars, baseline.exemplars
    assert three["rank"].max() == 3 and ten["rank"].max() == 10
    np.testing.assert_allclose(three["score"], ten[ten["rank"] <= 3]["score"], rtol=0)
    assert headscope.analyze(str(planted), texts, exemplars=0, **FAST).exemplars is None
    assert_same_numbers(report, baseline)


def check_detectors(planted, texts, baseline, tmp_path):
    """A detector is a column of its own, its score the metric that measures the same thing; the rest unchanged."""
    report = headscope.analyze(str(planted), texts, detectors=["prev=offset:1"], **FAST)
    heads = report.heads
    np.testing.assert_allclose(heads["detect_prev"], heads["prev_token"], atol=1e-6)
    assert "detect_prev" not in baseline.heads and set(report.exemplars["kind"]) >= {"prev"}
    detector_columns = [name for name in heads.columns if name.startswith("detect_")]
    assert_same_numbers(report, baseline, without=tuple(detector_columns))


def check_stream_window_and_sink(planted, texts, baseline, tmp_path):
    """far_mass is each planted layer-0 head's mass on keys s >= S with t - s >= W, over the rows t >= S + W, by hand
    at two (S, W); its chance level is uniform attention's (the uniform head's own); --stream-window 0 leaves it NaN
    and every other number as it was."""
    for sink, window in ((1, 2), (0, 3)):
        report = headscope.analyze(str(planted), texts, stream_sink=sink, stream_window=window, **FAST)
        heads = layer0(report)
        far_rows = layer0_hand_mean(report, UNIFORM, lambda row, t, f=sink + window: float(t >= f))
        for head in (UNIFORM, PREVIOUS, FIRST):
            far = layer0_hand_mean(report, head, lambda row, t, s=sink, w=window: row[s : max(s, t - w + 1)].sum())
            assert heads.at[head, "far_mass"] == pytest.approx(far / far_rows, abs=1e-6), (sink, window, head)
        assert heads.at[UNIFORM, "far_mass"] > 0.2 and heads.at[PREVIOUS, "far_mass"] < 0.01
        assert (heads[["far_mass_ci_low"]].to_numpy() <= heads[["far_mass"]].to_numpy() + 1e-12).all()
        assert heads["far_mass_chance"].iloc[0] == pytest.approx(heads.at[UNIFORM, "far_mass"], abs=1e-6)
        assert report.run["settings"]["stream_window"] == window and report.run["settings"]["stream_sink"] == sink
    assert baseline.heads["far_mass"].isna().all()  # the default 4 + 64 tokens: no sentence is that long
    # A batch whose sentences are all too short for a far row is not read for far_mass at all (PatternScores): one
    # sentence a batch, so that some batches are, gives the same far_mass as the whole corpus in one batch.
    lengths = report.sentences["n_tokens"]
    assert (lengths <= 7).any() and (lengths > 7).any()
    # Without exemplars, a batch of short sentences reads no pattern at all.
    for exemplars in (10, 0):
        alone, together = (headscope.analyze(str(planted), texts, stream_sink=1, stream_window=6, batch_size=size,
                                             exemplars=exemplars, **FAST) for size in (1, len(texts)))  # fmt: skip
        np.testing.assert_allclose(alone.heads["far_mass"], together.heads["far_mass"], rtol=0, atol=1e-6)
        assert together.heads["far_mass"].notna().all()
    off = headscope.analyze(str(planted), texts, stream_sink=1, stream_window=0, **FAST)
    assert off.heads["far_mass"].isna().all()
    assert_same_numbers(off, baseline)
    pd.testing.assert_frame_equal(report.exemplars, off.exemplars)  # far_mass is scored, never an exemplar kind


def check_role_streaming_max_far_mass(planted, texts, baseline, tmp_path):
    """The streaming role follows its threshold on far_mass (measured here at S = 1, W = 2, where the corpus's
    sentences have far keys): at 1.0 every head no earlier rule names is streaming, at 0.0 only those with none."""
    roles = {}
    for value in ("0.0", "1.0"):
        out = cli(planted, tmp_path / value, "--no-charts", "--no-page", "--stream-window", "2", "--stream-sink", "1",
                  "--role-streaming-max-far-mass", value)  # fmt: skip
        heads = pd.read_parquet(out / "heads.parquet")
        expected = assign_roles(heads, RoleThresholds(streaming_max_far_mass=float(value)), Thresholds())["role"]
        assert heads["role"].tolist() == expected.tolist()
        roles[value] = heads["role"]
    assert (roles["1.0"] == "streaming").sum() > (roles["0.0"] == "streaming").sum()


def check_retrieval_length(planted, texts, baseline, tmp_path):
    """The retrieval probe runs at that length (probe_retrieval and its chance by hand), and changes no other number:
    the planted uniform head ties every key (no hit), the previous-token head never looks 60 tokens back."""
    length, span = 64, 5
    report = headscope.analyze(str(planted), texts, **FAST, probe_length=span, retrieval_length=length)
    heads = layer0(report)
    assert heads.at[UNIFORM, "probe_retrieval"] == 0.0 and heads.at[PREVIOUS, "probe_retrieval"] == 0.0
    chance = np.mean([1 / (p + 1) for p in range(length - span, length - 1)])
    assert report.heads["probe_retrieval_chance"].iloc[0] == pytest.approx(chance, abs=1e-12)
    assert report.run["settings"]["retrieval_length"] == length and baseline.heads["probe_retrieval"].isna().all()
    without = headscope.analyze(str(planted), texts, **FAST, probe_length=span)
    retrieval = report.heads["role"] == "retrieval"  # the role it may give (checked by check_role_retrieval_min)
    assert (report.heads["role"] == without.heads["role"])[~retrieval].all()
    measured = [name for name in numbers(without.heads).columns if not name.startswith("probe_retrieval")]
    np.testing.assert_array_equal(report.heads[measured].to_numpy(float), without.heads[measured].to_numpy(float))


def check_role_retrieval_min(planted, texts, baseline, tmp_path):
    """The retrieval role follows its threshold on probe_retrieval, checked on the planted induction circuit (whose
    induction head finds the span on every row): at 1.0 it is a retrieval head, at any higher score it cannot be."""
    folder = build_planted_induction(tmp_path / "induction")
    corpus = tmp_path / "words.txt"
    corpus.write_text(" ".join(induction_words()[:20]) + "\n")
    roles = {}
    for value in ("1.0", "0.0"):
        out = cli(folder, tmp_path / value, "--corpus", corpus, "--no-charts", "--no-page", "--probe-length", "4",
                  "--retrieval-length", "64", "--role-retrieval-min", value)  # fmt: skip
        heads = pd.read_parquet(out / "heads.parquet")
        expected = assign_roles(heads, RoleThresholds(retrieval_min=float(value)), Thresholds())["role"]
        assert heads["role"].tolist() == expected.tolist()
        roles[value] = heads["role"]
    assert (roles["0.0"] == "retrieval").all() and (roles["1.0"] == "retrieval").sum() == 1


def check_examples(planted, texts, baseline, tmp_path):
    """N corpus sentences spread over lengths, whole (every head, every visible pair), plus the probe sequence;
    the measured numbers unchanged."""
    report = headscope.analyze(str(planted), texts, examples=5, **FAST)
    examples = report.examples
    corpus = examples[examples["source"] == "corpus"]
    assert (
        corpus["sentence_id"].nunique() == 5
        and baseline.examples.query("source == 'corpus'")["sentence_id"].nunique() == 3
    )
    lengths = report.sentences.set_index("sentence_id")["n_tokens"]
    chosen = lengths[corpus["sentence_id"].unique()]
    assert chosen.nunique() == len(chosen)  # each a different length
    for sentence_id, part in corpus.groupby("sentence_id"):
        t = min(int(lengths[sentence_id]), 32)
        heads = report.heads[["layer", "head"]].drop_duplicates()
        assert len(part) == len(heads) * t * (t + 1) // 2  # causal: every visible (query, key) of every head
    assert set(examples["source"]) == {"corpus", "probe"}
    none = headscope.analyze(str(planted), texts, examples=0, **FAST)
    assert none.examples.empty
    assert_same_numbers(report, baseline)
    assert_same_numbers(none, baseline)


def check_device(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, device="cpu", **FAST)
    assert report.run["device"] == "cpu"
    assert baseline.run["device"] == ("cuda" if torch.cuda.is_available() else "cpu")  # auto picks CUDA
    # A device other than the default's must reach the loader: on a machine without CUDA, asking for it is refused
    # (an option dropped on the way would run on the CPU and say nothing).
    if torch.cuda.is_available():
        assert headscope.analyze(str(planted), texts, device="cuda", **FAST).run["device"].startswith("cuda")
    else:
        with pytest.raises(headscope.HeadscopeError, match="no CUDA device is available"):
            headscope.analyze(str(planted), texts, device="cuda", **FAST)
        assert_same_numbers(report, baseline)


# ---------------------------------------------------------------- settings that must change no number


def neutral(arrived, **options):
    """An option that must change no number: the numbers equal the baseline's, and `arrived(report, baseline)`
    shows the option reached the code that uses it (an option dropped on the way would pass the first half)."""

    def check(planted, texts, baseline, tmp_path):
        report = headscope.analyze(str(planted), texts, **{**FAST, **options})
        assert_same_numbers(report, baseline, atol=1e-6)  # float32 attention: batching moves the last digits
        assert arrived(report.run["batching"], baseline.run["batching"]), (report.run["batching"], options)

    return check


def one_sentence_each(batching, baseline) -> bool:
    return batching["max_sentences"] == 1 and batching["batches"] == 16 > baseline["batches"]  # the 16 texts


def budgeted(batching, baseline) -> bool:
    return batching["memory_budget_bytes"] == 2**20 and batching["max_tokens"] < baseline["max_tokens"]


def check_padding_side(planted, texts, baseline, tmp_path):
    """Left padding reaches the batches the model runs (a hook on the model sees each batch's mask) and changes no
    number."""
    masks = []

    def loader(source, settings, model_config, lm_head):
        loaded = load_for_run(source, settings, model_config, lm_head)
        loaded.model.register_forward_pre_hook(lambda module, args, kwargs: masks.append(kwargs["attention_mask"]),
                                               with_kwargs=True)  # fmt: skip
        return loaded

    report = headscope.analyze(str(planted), texts, padding_side="left", batch_size=5, loader=loader, **FAST)
    padded = [mask for mask in masks if not bool(mask.all())]  # batches of sentences of several lengths
    assert padded and all(bool(mask[:, -1].all()) and not bool(mask[:, 0].all()) for mask in padded)  # on the left
    assert_same_numbers(report, baseline, atol=1e-6)


def in_chunks_of_three(batching, baseline) -> bool:
    return batching["batches"] >= 6 > baseline["batches"]  # 16 texts in chunks of 3: a batch or more each


def check_block_bytes(planted, texts, baseline, tmp_path):
    report = headscope.analyze(str(planted), texts, block_bytes=4096, **FAST)
    assert "fused" in " ".join(report.run["attention_implementation"].values())
    # Off the sink, the planted first-token head spreads its rest evenly: its largest off-sink weight is a tie up to
    # float rounding, which the eager probabilities and the fused logits break on different rows.
    assert_same_numbers(report, baseline, atol=1e-5, without=("offsink_top_offset_share",))


class ThreadsSeen(NullReporter):
    """Reads torch's thread count each time the run reports progress: what the run itself uses."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def advance(self, sentences: int, tokens: int) -> None:
        self.seen.add(torch.get_num_threads())


def check_threads(planted, texts, baseline, tmp_path):
    started = torch.get_num_threads()
    torch.set_num_threads(2)  # a count --threads 1 differs from, whatever the process started with
    try:
        inside = ThreadsSeen()
        report = headscope.analyze(str(planted), texts, threads=1, reporter=inside, **FAST)
        assert inside.seen == {1}  # the run measured with one thread
        assert torch.get_num_threads() == 2 and report.run["settings"]["threads"] == 1  # and gave the count back
        default = ThreadsSeen()
        headscope.analyze(str(planted), texts, reporter=default, **FAST)
        assert default.seen == {2}
    finally:
        torch.set_num_threads(started)
    assert_same_numbers(report, baseline, atol=1e-6)


def reaches_the_loader(**options):
    """Options that only reach the loading of the model (a local folder ignores them): they get there, and
    change no number."""

    def check(planted, texts, baseline, tmp_path):
        seen = []

        def loader(source, settings, model_config, lm_head):
            seen.append(settings)
            return load_for_run(source, settings, model_config, lm_head)

        report = headscope.analyze(str(planted), texts, loader=loader, **{**FAST, **options})
        assert [getattr(seen[0], name) for name in options] == list(options.values())
        assert_same_numbers(report, baseline)

    return check


OFFLOADED = {"wte": "cpu", "wpe": "cpu", "h.0": "cpu", "h.1": "disk", "ln_f": "cpu"}


def check_device_map(planted, texts, baseline, tmp_path):
    report = headscope.analyze(
        str(planted), texts, device_map=OFFLOADED, offload_folder=str(tmp_path / "offload"), **FAST
    )
    assert report.run["model"]["device_map"] == OFFLOADED
    assert_same_numbers(report, baseline)


# ---------------------------------------------------------------- options of the command


def cli(planted, tmp_path, *args, **seams):
    out = tmp_path / "report"
    result = run_cli("analyze", planted, "--out", out, "--probe-seeds", "2", "--bootstrap", "20", *args, **seams)
    assert result.exit_code == 0, result.output
    return out


def check_corpus(planted, texts, baseline, tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("\n".join(texts) + "\n")
    out = cli(planted, tmp_path, "--corpus", path, "--no-charts", "--no-page")
    assert pd.read_parquet(out / "sentences.parquet")["text"].tolist() == texts


def check_out(planted, texts, baseline, tmp_path):
    out = cli(planted, tmp_path, "--no-charts", "--no-page")
    assert {"heads.parquet", "run.json"} <= {p.name for p in out.iterdir()}


def check_overwrite(planted, texts, baseline, tmp_path):
    out = cli(planted, tmp_path, "--no-charts", "--no-page")
    again = run_cli("analyze", planted, "--out", out, "--no-charts", "--no-page")
    assert again.exit_code == 1 and "pass --overwrite" in again.stderr
    cli(planted, tmp_path, "--no-charts", "--no-page", "--overwrite")


def check_resume(planted, texts, baseline, tmp_path):
    options = ("--no-charts", "--no-page", "--chunk-sentences", "50", "--resume")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(texts * 10) + "\n")  # 160 sentences: four chunks
    whole = cli(planted, tmp_path / "whole", "--corpus", corpus, "--no-charts", "--no-page")
    interrupted = run_cli(
        "analyze", planted, "--out", tmp_path / "report", "--corpus", corpus, "--probe-seeds", "2",
        "--bootstrap", "20", *options, reporter=Interrupting(after=100),
    )  # fmt: skip
    assert interrupted.exit_code == 130
    resumed = cli(planted, tmp_path, "--corpus", corpus, *options)
    for name in ("heads", "sentence_heads"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(resumed / f"{name}.parquet"), pd.read_parquet(whole / f"{name}.parquet")
        )
    # the corpus repeats its sentences: their rows tie within float32 rounding, and the batches pick among them
    assert_same_exemplars(pd.read_parquet(resumed / "exemplars.parquet"), pd.read_parquet(whole / "exemplars.parquet"))


def check_charts(planted, texts, baseline, tmp_path):
    out = cli(planted, tmp_path, "--no-page")
    assert (out / "entropy_heatmap.png").is_file()
    assert not list(cli(planted, tmp_path / "none", "--no-charts", "--no-page").glob("*.png"))


def check_page(planted, texts, baseline, tmp_path):
    assert (cli(planted, tmp_path, "--no-charts") / "report.html").is_file()
    assert not (cli(planted, tmp_path / "none", "--no-charts", "--no-page") / "report.html").exists()


def check_chart_format(planted, texts, baseline, tmp_path):
    out = cli(planted, tmp_path, "--no-page", "--format", "svg")
    assert (out / "entropy_heatmap.svg").read_text().lstrip().startswith("<?xml") and not list(out.glob("*.png"))


def labels_follow(option: str, value: str, field: str, rule: str):
    """A threshold option: the labels written are the rule's labels at that threshold, and differ from the
    default's for the planted heads."""

    def check(planted, texts, baseline, tmp_path):
        out = cli(planted, tmp_path, "--no-charts", "--no-page", f"--{option}", value)
        heads = pd.read_parquet(out / "heads.parquet")
        if rule == "type":
            expected = classify_heads(heads, Thresholds(**{field: float(value)}))["head_type"]
            column = "head_type"
        else:
            expected = assign_roles(heads, RoleThresholds(**{field: float(value)}), Thresholds())["role"]
            column = "role"
        assert heads[column].tolist() == expected.tolist()
        assert heads[column].tolist() != baseline.heads[column].tolist()

    return check


EFFECTS = {
    # settings that change what is measured, checked against hand computations or a second computation
    "window": check_window,
    "stream_window": check_stream_window_and_sink,
    "stream_sink": check_stream_window_and_sink,
    "sink_threshold": check_sink_threshold,
    "max_length": check_max_length,
    "layers": check_layers,
    "sentence_heads": check_sentence_heads,
    "probes": check_probes,
    "copying": check_copying,
    "probe_seeds": check_probe_seeds,
    "probe_length": check_probe_length,
    "retrieval_length": check_retrieval_length,
    "bootstrap": check_bootstrap,
    "bootstrap_seed": check_bootstrap_seed,
    "importance": check_importance,
    "check_dormant": check_check_dormant,
    "dormant_tolerance": check_dormant_tolerance,
    "dtype": check_dtype,
    "text_column": check_text_column,
    "encoding_errors": check_encoding_errors,
    "device": check_device,
    "examples": check_examples,
    "exemplars": check_exemplars,
    "detectors": check_detectors,
    "device_map": check_device_map,
    "offload_folder": check_device_map,
    # settings that change no number
    "batch_size": neutral(one_sentence_each, batch_size=1),
    "max_memory": neutral(budgeted, max_memory=2**20),
    "padding_side": check_padding_side,
    "chunk_sentences": neutral(in_chunks_of_three, chunk_sentences=3),
    "block_bytes": check_block_bytes,
    "threads": check_threads,
    "revision": reaches_the_loader(revision="main"),
    "trust_remote_code": reaches_the_loader(trust_remote_code=True),
    # options of the command
    "corpus": check_corpus,
    "out": check_out,
    "overwrite": check_overwrite,
    "resume": check_resume,
    "charts": check_charts,
    "page": check_page,
    "chart_format": check_chart_format,
    "local_min_locality": labels_follow("local-min-locality", "0.999", "local_min_locality", "type"),
    "copy_max_norm_entropy": labels_follow("copy-max-norm-entropy", "0.0001", "copy_max_norm_entropy", "type"),
    "broad_min_norm_entropy": labels_follow("broad-min-norm-entropy", "0.999", "broad_min_norm_entropy", "type"),
    "role_probe_min": labels_follow("role-probe-min", "0.99", "probe_min", "role"),
    "role_sink_rate_min": labels_follow("role-sink-rate-min", "0.0", "sink_rate_min", "role"),
    "role_offset_share_min": labels_follow("role-offset-share-min", "0.0", "offset_share_min", "role"),
    "role_streaming_max_far_mass": check_role_streaming_max_far_mass,
    "role_retrieval_min": check_role_retrieval_min,
    "role_dormant_max_write_ratio": labels_follow(
        "role-dormant-max-write-ratio", "1.0", "dormant_max_write_ratio", "role"
    ),
}


def test_every_setting_and_option_has_an_entry():
    missing = (set(SETTINGS) | ANALYZE_OPTIONS) - set(EFFECTS)
    assert not missing, (
        f"no entry in EFFECTS for {sorted(missing)}: prove what each changes, or that it changes nothing"
    )
    assert not set(EFFECTS) - set(SETTINGS) - ANALYZE_OPTIONS, "EFFECTS names something that is not an option"


def test_command_options_are_settings_by_name():
    """Every option of analyze that shares a RunConfig field's name reaches that field (not a look-alike)."""
    shared = ANALYZE_OPTIONS & set(SETTINGS)
    assert shared >= set(SETTINGS) - {"padding_side", "block_bytes"}  # the two left to the Python API


DRAWING = {"charts", "chart_format"}  # these two draw every chart: slow (over 2 s each), the rest stay in the fast loop


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name in DRAWING else name for name in sorted(set(EFFECTS))]
)
@pytest.mark.first_case_fast
def test_what_each_option_does(name, planted_gpt2, texts, baseline, tmp_path):
    EFFECTS[name](planted_gpt2, texts, baseline, tmp_path)
