"""headscope patch: every kind of patch against an independent computation (tests/support/reference_patching.py), on a
grouped-KV Llama and on GPT-2 (Conv1D), any batch size and padding side; the effect's formula and interval."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from headscope.commands.patch import patch
from headscope.interventions.patching import patch_effects

from helpers import tiny_model_folder
from planted import write_reader_pairs
from reference_patching import Reference

WORDS = [chr(ord("a") + i) for i in range(16)]


def _pairs(path: Path, reference: Reference, count: int, lengths: tuple[int, int], seed: int) -> Path:
    """Random prompt pairs (two words changed) whose answer and distractor are the words the change moves most
    either way on `reference`'s model: a clear behaviour to explain."""
    import torch

    rng = random.Random(seed)
    tok = reference.tokenizer
    word_ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in WORDS]
    with path.open("w") as f:
        for _ in range(count):
            n = rng.randint(*lengths)
            clean = [rng.choice(WORDS) for _ in range(n)]
            corrupt = list(clean)
            for index in rng.sample(range(n), 2):
                corrupt[index] = rng.choice([w for w in WORDS if w != clean[index]])
            with torch.no_grad():
                logits = [reference.model(torch.tensor([tok(" ".join(p))["input_ids"]])).logits[0, -1, word_ids]
                          for p in (clean, corrupt)]  # fmt: skip
            moved = (logits[0] - logits[1]).tolist()
            answer, distractor = WORDS[int(np.argmax(moved))], WORDS[int(np.argmin(moved))]
            f.write(json.dumps({"clean": " ".join(clean), "corrupt": " ".join(corrupt), "answer": answer,
                                "distractor": distractor}) + "\n")  # fmt: skip
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A grouped-KV Llama (8 query heads on 4 KV heads) and a GPT-2, random weights scaled up for clear metrics."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("patch_models")
    lines = [" ".join(WORDS)]
    llama = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                        num_key_value_heads=4, max_position_embeddings=128, initializer_range=0.2)  # fmt: skip
    gpt2 = GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=64, initializer_range=0.2)
    return {
        "llama": tiny_model_folder(root / "llama", llama, LlamaForCausalLM, lines),
        "gpt2": tiny_model_folder(root / "gpt2", gpt2, GPT2LMHeadModel, lines),
    }


@pytest.fixture(scope="module")
def references(models) -> dict[str, Reference]:
    return {name: Reference(folder) for name, folder in models.items()}


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory, references) -> dict[tuple[str, str], Path]:
    """(model, "mixed"): five pairs of 4 to 9 words; (model, "one"): four pairs of 6 words."""
    root = tmp_path_factory.mktemp("pairs")
    files = {}
    for name, reference in references.items():
        files[name, "mixed"] = _pairs(root / f"{name}-mixed.jsonl", reference, 5, (4, 9), 1)
        files[name, "one"] = _pairs(root / f"{name}-one.jsonl", reference, 4, (6, 6), 2)
    return files


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check(found, reference: Reference, pairs: list[dict], what: str, direction: str) -> None:
    """Every per-pair patched metric and every effect equal the reference's within 1e-4."""
    clean, corrupt = np.array([reference.baseline(p) for p in pairs]).T
    got = {(r.pair, r.layer, r.head, getattr(r, "position", None)): r.m_patched for r in found.per_pair.itertuples()}
    expected = {key: reference.patched(pairs[key[0]], what, direction, *key[1:]) for key in got}
    worst = max(abs(got[key] - expected[key]) for key in got)
    assert worst < 1e-4, worst
    assert np.allclose([p["m_clean"] for p in found.record["per_pair"]], clean, atol=1e-4)
    assert np.allclose([p["m_corrupt"] for p in found.record["per_pair"]], corrupt, atol=1e-4)
    keys = list(got)
    patched = np.array([expected[key] for key in keys])
    by_unit: dict = {}
    for key, value in zip(keys, patched, strict=True):
        by_unit.setdefault(key[1:], []).append(value)
    gap = clean.mean() - corrupt.mean()
    assert abs(gap) > 0.5, gap  # the pairs show a behaviour, so effects are well defined
    for row in found.effects.itertuples():
        unit = (row.layer, row.head, getattr(row, "position", None))
        mean = np.mean(by_unit[unit])
        effect = (mean - corrupt.mean()) / gap if direction == "denoise" else (clean.mean() - mean) / gap
        assert abs(row.effect - effect) < 1e-4, (unit, row.effect, effect)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("what", ["output", "pattern", "values", "q", "k"])
@pytest.mark.parametrize("direction", ["denoise", "noise"])
@pytest.mark.first_case_fast
def test_every_head_equals_the_reference(models, references, pair_files, model, what, direction):
    pairs = pair_files[model, "mixed"]
    found = patch(models[model], pairs, what=what, direction=direction, device="cpu", bootstrap=0)
    _check(found, references[model], _records(pairs), what, direction)


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("what", ["output", "pattern", "values", "q", "k"])
@pytest.mark.first_case_fast
def test_each_position_equals_the_reference(models, references, pair_files, model, what):
    heads = [(1, 3), (2, 1)]
    pairs = pair_files[model, "one"]
    found = patch(models[model], pairs, what=what, positions="each", heads=heads, device="cpu", bootstrap=0)
    assert sorted(set(found.effects["position"])) == list(range(6))
    _check(found, references[model], _records(pairs), what, "denoise")


def test_positions_before_the_first_difference_are_not_run_and_change_nothing(models, pair_files, tmp_path):
    """Before the first token where a pair's prompts differ, the two runs' activations are the same: a patch there
    is not run, its effect is exactly 0 (the target's own metric), and the run says how many it skipped."""
    from transformers import AutoTokenizer

    from headscope.commands.patch import first_difference
    from headscope.interventions.pairs import as_pairs, tokenize_pairs

    records = _records(pair_files["llama", "one"])
    for record in records:  # the corrupt prompt shares the clean one's first three words
        record["corrupt"] = " ".join(record["clean"].split()[:3] + record["corrupt"].split()[3:])
    pairs = tmp_path / "late.jsonl"
    pairs.write_text("".join(json.dumps(record) + "\n" for record in records))
    tokenized = tokenize_pairs(as_pairs(pairs), AutoTokenizer.from_pretrained(models["llama"]), None)
    first = min(first_difference(pair) for pair in tokenized)
    assert 0 < first < tokenized[0].length  # the case shows both kinds of position
    found = patch(models["llama"], pairs, positions="each", heads=[(1, 3), (2, 1)], device="cpu", bootstrap=0)
    before = found.effects[found.effects["position"] < first]
    assert len(before) == 2 * first and (before["effect"] == 0.0).all()
    assert found.record["timing"]["skipped_runs"] == 2 * first * len(tokenized)
    assert any("not run" in note for note in found.notes)
    after = found.effects[found.effects["position"] >= first]
    assert (after["effect"] != 0.0).any()


def _marked(record: dict, roles: dict[str, int]) -> dict:
    """The pair with words of its clean prompt marked as roles ({role: word index}, counted from the end if
    negative)."""
    words = record["clean"].split()
    for role, index in roles.items():
        words[index] = f"[[{role}:{words[index]}]]"
    return {**record, "clean": " ".join(words)}


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("what", ["output", "values", "k"])
def test_positions_by_role_patch_each_pairs_own_position(models, references, pair_files, tmp_path, model, what):
    """Pairs of 4 to 9 words, each marking its second word A and its word before last B: --positions roles patches
    A, B and END (the last token) at each pair's own token, as the plain computation does at that position."""
    records = _records(pair_files[model, "mixed"])
    assert len({len(r["clean"].split()) for r in records}) > 1  # several templates' lengths
    marked = tmp_path / "marked.jsonl"
    marked.write_text("".join(json.dumps(_marked(r, {"A": 1, "B": -2})) + "\n" for r in records))
    heads = [(1, 3), (2, 1)]
    found = patch(models[model], marked, what=what, positions="roles", heads=heads, device="cpu", bootstrap=0)
    assert found.record["roles"] == ["A", "B", "END"]
    assert list(found.effects["position_role"].unique()) == ["A", "B", "END"]
    reference, tokenizer = references[model], references[model].tokenizer
    for row in found.per_pair.itertuples():
        record = records[row.pair]
        words = record["clean"].split()
        index = {0: 1, 1: len(words) - 2, 2: len(words) - 1}[row.position]
        position = len(tokenizer(" ".join(words[: index + 1]))["input_ids"]) - 1
        want = reference.patched(record, what, "denoise", row.layer, row.head, position)
        assert abs(row.m_patched - want) < 1e-4, (row, want)


def test_roles_that_differ_between_pairs_or_are_marked_wrong_are_one_line(models, pair_files, tmp_path):
    from headscope.errors import HeadscopeError

    records = _records(pair_files["gpt2", "mixed"])
    cases = [
        ([_marked(records[0], {"A": 1}), _marked(records[1], {"B": 1})], "marks no 'A'"),
        ([_marked(records[0], {"A": 1, "END": 2})], "END is every pair's last token"),
        ([{**records[0], "clean": records[0]["clean"].replace(" ", " [[A:]]", 1)}], "role 'A' marks no text"),
        ([_marked(_marked(records[0], {"A": 1}), {"A": 2})], "role 'A' is marked twice"),
    ]
    for pairs, message in cases:
        with pytest.raises(HeadscopeError, match=message):
            patch(models["gpt2"], pairs, positions="roles", heads=[(0, 0)], device="cpu", bootstrap=0)
    with pytest.raises(HeadscopeError, match="--fast estimates output, pattern and values"):
        patch(models["gpt2"], records, what="q", fast=True)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_parts_are_the_pattern_and_values_runs_and_beyond_is_what_they_leave(models, pair_files, direction):
    """--parts: each head's pattern and values effects equal their own runs', and beyond_parts is output - pattern -
    values, its interval drawn as every effect's (the same replicates)."""
    pairs, model = pair_files["llama", "mixed"], models["llama"]
    settings = dict(direction=direction, device="cpu", bootstrap=200, bootstrap_seed=3)
    found = patch(model, pairs, parts=True, **settings)
    apart = {what: patch(model, pairs, what=what, **settings).effects["effect"].to_numpy()
             for what in ("pattern", "values")}  # fmt: skip
    effects = found.effects
    # two runs of one patch may round m apart in float32 (m ~ 5: 6e-7), over a gap above 0.5
    np.testing.assert_allclose(effects["pattern_effect"], apart["pattern"], atol=2e-6)
    np.testing.assert_allclose(effects["values_effect"], apart["values"], atol=2e-6)
    beyond = effects["effect"] - effects["pattern_effect"] - effects["values_effect"]
    np.testing.assert_allclose(effects["beyond_parts"], beyond, atol=1e-9)
    assert (effects["beyond_ci_low"] <= effects["beyond_parts"] + 1e-12).all()
    assert (effects["beyond_parts"] <= effects["beyond_ci_high"] + 1e-12).all()
    assert np.abs(beyond).max() > 0.01  # random heads: pattern and values interact
    assert found.record["parts"] and {"m_patched_pattern", "m_patched_values"} <= set(found.per_pair.columns)


def test_a_planted_head_that_moves_its_values_alone_goes_nowhere_beyond_its_parts(reader, tmp_path):
    """The reader's head 0.0 looks at position 1 in both prompts and moves what is there: output 1 = values 1 +
    pattern 0, nothing beyond."""
    pairs = write_reader_pairs(tmp_path / "pairs.jsonl")
    found = patch(reader, pairs, parts=True, heads=[(0, 0)], device="cpu", bootstrap=0)
    row = found.effects.iloc[0]
    assert abs(row["effect"] - 1) < 1e-3 and abs(row["values_effect"] - 1) < 1e-3 and abs(row["beyond_parts"]) < 1e-3
    with pytest.raises(Exception, match="--parts compares output patching"):
        patch(reader, pairs, what="values", parts=True)


@pytest.mark.parametrize("options", [{"batch_size": 1}, {"batch_size": 3, "padding_side": "left"},
                                     {"padding_side": "left", "max_memory": "2MB"}])  # fmt: skip
def test_batching_and_padding_change_no_number(models, pair_files, options):
    """One pair per batch, three prompts per batch padded left, few replicas per forward: the same numbers."""
    base = patch(models["llama"], pair_files["llama", "mixed"], what="values", device="cpu", bootstrap=50)
    other = patch(models["llama"], pair_files["llama", "mixed"], what="values", device="cpu", bootstrap=50, **options)
    assert other.record["settings"]["padding_side"] == options.get("padding_side", "right")
    columns = ["effect", "effect_ci_low", "effect_ci_high", "mean_patched"]
    assert np.allclose(base.effects[columns], other.effects[columns], atol=1e-5)


def test_the_bootstrap_seed_draws_the_intervals(models, pair_files):
    """The interval is a pure function of the seed: the same seed the same bounds, another seed other bounds."""
    pairs = pair_files["llama", "mixed"]
    runs = [patch(models["llama"], pairs, device="cpu", bootstrap=50, bootstrap_seed=seed) for seed in (1, 1, 2)]
    low = [run.effects["effect_ci_low"].to_numpy() for run in runs]
    assert np.array_equal(low[0], low[1]) and not np.allclose(low[0], low[2])


def test_fewer_replicas_take_more_forwards(models, pair_files):
    """--max-memory reaches the replica count: a small budget patches fewer heads per forward."""
    roomy = patch(models["llama"], pair_files["llama", "mixed"], device="cpu", bootstrap=0)
    tight = patch(models["llama"], pair_files["llama", "mixed"], device="cpu", bootstrap=0, max_memory="1MB")
    assert tight.record["timing"]["forwards"] > roomy.record["timing"]["forwards"]
    assert np.allclose(roomy.effects["effect"], tight.effects["effect"], atol=1e-5)


@pytest.mark.first_case_fast  # the Llama case takes 2.7 s
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fast_equals_the_first_order_estimate(models, references, pair_files, model):
    """--fast: m + (z' - z) . dm/dz per pair, against torch autograd through a hook on the output projection; two
    passes per batch of pairs where exact patching takes one per forward of replicas."""
    pairs = pair_files[model, "mixed"]
    fast = patch(models[model], pairs, device="cpu", bootstrap=0, fast=True)
    assert set(fast.effects["method"]) == {"attribution"} and fast.record["method"] == "attribution"
    assert fast.record["timing"]["forwards"] == 2 * fast.record["timing"]["batches"]
    records = _records(pairs)
    got = {(r.pair, r.layer, r.head): r.m_patched for r in fast.per_pair.itertuples()}
    worst = max(abs(value - references[model].attributed(records[key[0]], "denoise", *key[1:]))
                for key, value in got.items())  # fmt: skip
    assert worst < 1e-4, worst
    exact = patch(models[model], pairs, device="cpu", bootstrap=0)
    assert exact.record["timing"]["forwards"] > fast.record["timing"]["forwards"]


def test_effects_formula_and_interval():
    """Hand-made metrics: the effect is the share of the gap, and the interval brackets it."""
    clean, corrupt = np.array([4.0, 6.0, 5.0]), np.array([0.0, 2.0, 1.0])  # gap 4
    patched = np.array([[4.0, 6.0, 5.0], [1.0, 3.0, 2.0], [0.0, 2.0, 1.0]])
    found = patch_effects(patched, clean, corrupt, "denoise", np.arange(3), replicates=200, seed=0)
    assert np.allclose(found["effect"], [1.0, 0.25, 0.0])
    assert np.all(found["effect_ci_low"] <= found["effect"] + 1e-12)
    assert np.all(found["effect_ci_high"] >= found["effect"] - 1e-12)
    noised = patch_effects(patched, clean, corrupt, "noise", np.arange(3), replicates=0, seed=0)
    assert np.allclose(noised["effect"], [0.0, 0.75, 1.0])
    assert np.isnan(noised["effect_ci_low"]).all()
    same = patch_effects(patched, clean, clean, "denoise", np.arange(3), replicates=10, seed=0)
    assert np.isnan(same["effect"]).all()
    # A zero mean gap whose pairs differ (+1, -1, 0): a replicate's gap is not 0, yet there is no effect to bracket.
    zero_gap = patch_effects(patched, clean, clean - np.array([1.0, -1.0, 0.0]), "denoise", np.arange(3),
                             replicates=200, seed=0)  # fmt: skip
    assert np.isnan(zero_gap["effect"]).all() and np.isnan(zero_gap["effect_ci_low"]).all()
    assert np.isnan(zero_gap["effect_ci_high"]).all()


@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> Path:
    """The planted copier with its one copying head (0.0) reading position 1 from every later query."""
    from planted import build_planted_copier

    return build_planted_copier(tmp_path_factory.mktemp("reader"), reads_from=1)


def test_planted_head_carries_the_whole_behaviour(reader, tmp_path):
    """Only head 0.0 moves the answer: its effect is 1 in both directions, through its values and not its pattern
    (it looks at position 1 in either prompt), and every other head's effect is 0."""
    pairs = write_reader_pairs(tmp_path / "pairs.jsonl")
    for what, expected in (("output", 1.0), ("values", 1.0), ("pattern", 0.0)):
        for direction in ("denoise", "noise"):
            found = patch(reader, pairs, what=what, direction=direction, device="cpu", bootstrap=100)
            effects = found.effects.set_index(["layer", "head"])["effect"]
            assert found.record["gap"] > 7.0  # about +4 clean, -4 corrupt
            assert abs(effects[0, 0] - expected) < 1e-3, (what, direction, effects[0, 0])
            assert effects.drop((0, 0)).abs().max() < 1e-4


def test_planted_each_position_finds_where_the_head_reads_and_writes(reader, tmp_path):
    """Values, by key position: the effect is at position 1, where the head reads. Output, by query position: at
    the last position, the only row whose output reaches the metric."""
    pairs = write_reader_pairs(tmp_path / "pairs.jsonl")
    for what, position in (("values", 1), ("output", 4)):
        found = patch(reader, pairs, what=what, positions="each", heads=[(0, 0), (1, 2)], device="cpu", bootstrap=0)
        mine = found.effects[(found.effects["layer"] == 0) & (found.effects["head"] == 0)].set_index("position")
        assert abs(mine["effect"][position] - 1.0) < 1e-3
        assert mine["effect"].drop(position).abs().max() < 1e-4
        assert found.effects[found.effects["layer"] == 1]["effect"].abs().max() < 1e-4
        assert list(mine["clean_token"]) == ["w2", "w3", "w5", "w6", "w7"]


@pytest.mark.parametrize("what", ["output", "pattern", "values"])
def test_fast_by_position_sums_to_fast_over_every_position(models, pair_files, what):
    """The first-order estimate is linear in the change: its terms per position (query rows for output and pattern,
    key positions for values) add up to the estimate of patching every position at once."""
    pairs = pair_files["gpt2", "one"]
    whole = patch(models["gpt2"], pairs, what=what, fast=True, bootstrap=0)
    each = patch(models["gpt2"], pairs, what=what, positions="each", fast=True, bootstrap=0)
    base = np.array([p["m_corrupt"] for p in each.record["per_pair"]])
    moved = each.per_pair.assign(change=each.per_pair["m_patched"] - base[each.per_pair["pair"]])
    summed = moved.groupby(["pair", "layer", "head"])["change"].sum()
    expected = whole.per_pair.set_index(["pair", "layer", "head"])["m_patched"] - base[whole.per_pair["pair"]]
    assert np.allclose(summed.sort_index().to_numpy(), expected.sort_index().to_numpy(), atol=1e-4)


def test_the_metric_reads_each_rows_last_token_however_the_logits_were_kept():
    """Right-padded rows of lengths 3 and 5: the logits of every position, of the last k positions, or of one
    position per row give the same metric."""
    import torch

    from headscope.interventions.patching import METRICS, metric_of
    from headscope.model.batch import collate

    batch = collate([0, 1], [[5, 6, 7], [5, 6, 7, 8, 9]])
    logits = torch.randn(2, 5, 10)
    answer, distractor = torch.tensor([1, 2]), torch.tensor([3, 4])
    expected = torch.stack([logits[0, 2, 1] - logits[0, 2, 3], logits[1, 4, 2] - logits[1, 4, 4]])
    metric = METRICS["logit_diff"]
    every = metric_of(metric, logits, batch, 0, answer, distractor)
    last_three = metric_of(metric, logits[:, 2:], batch, 3, answer, distractor)
    rows = metric_of(metric, logits[[0, 1], [2, 4]][:, None], batch, torch.tensor([[2], [4]]), answer, distractor)
    for found in (every, last_three, rows):
        assert torch.allclose(found, expected)


@pytest.mark.parametrize("what", ["pattern", "values"])
def test_probabilities_read_in_blocks_of_rows_give_the_same_patch(models, pair_files, what):
    """A layer's attention larger than block_bytes is read block of query rows by block (the long-context path):
    the recorder puts the blocks together into the same probabilities."""
    pairs = pair_files["llama", "mixed"]
    whole = patch(models["llama"], pairs, what=what, bootstrap=0)
    blocks = patch(models["llama"], pairs, what=what, bootstrap=0, block_bytes=1024)
    assert np.allclose(whole.effects["effect"], blocks.effects["effect"], atol=1e-5)
