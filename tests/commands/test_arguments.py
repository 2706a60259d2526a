"""Heads, layers and ids as users name them, from the command line or from Python: validated once
(headscope.arguments for their form, Plan.check_heads for the model's range), with the same one-line messages,
before anything wraps or silently names another head."""

from __future__ import annotations

import re
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import headscope
from headscope.arguments import as_head_groups, as_heads, as_ids, as_texts, parse_heads, parse_ids, parse_layers
from headscope.commands.prune import check_request as check_prune_request
from headscope.config import RoleThresholds, RunConfig
from headscope.errors import ConfigError

from helpers import assert_one_line_error, refuse_to_load, run_cli
from planted import copy_words


@pytest.mark.parametrize(
    "value, message",
    [
        ([(0, -1)], "layers and heads count from 0"),  # Python would wrap it to the last head
        ([(-1, 0)], "layers and heads count from 0"),
        ([(True, True)], "pairs of whole numbers"),  # True is not head 1
        ([(0.0, 1.5)], "pairs of whole numbers"),
        ([(0, 1, 2)], "pairs of whole numbers"),
        ([(0, 10**6)], "numbers stop at"),
        (5, "takes (layer, head) pairs"),
        (["1.-1"], "LAYER.HEAD"),
    ],
)
def test_heads_that_python_would_wrap_or_cast_are_refused(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        as_heads(value)


def test_heads_in_any_accepted_form_are_the_same_sorted_pairs():
    import numpy as np

    expected = ((17, 4), (18, 6))
    assert as_heads([(18, 6), (17, 4), (18, 6)]) == expected
    assert as_heads([[18, 6], (np.int64(17), np.int64(4))]) == expected
    assert as_heads("18.6,17.4") == as_heads(["18.6", "17.4"]) == parse_heads(" 18.6 , 17.4") == expected


def test_groups_of_heads_must_be_groups():
    assert as_head_groups([[(0, 1), (0, 2)], [(1, 0)]]) == [((0, 1), (0, 2)), ((1, 0),)]
    with pytest.raises(ConfigError, match="removes them together"):  # one group, or one per head? say which
        as_head_groups([(0, 1), (0, 2)])
    with pytest.raises(ConfigError, match="a group with no head"):
        as_head_groups([[]])
    with pytest.raises(ConfigError, match="a list of groups"):
        as_head_groups("0.1")


@pytest.mark.parametrize("text", ["²", "٣", "1_0", "0-²", "+1", "-1", "0x10", ""])
def test_numbers_are_ascii_digits_only(text):
    """'²' and '٣' pass str.isdigit, '1_0' and '+1' pass int(): none is a sentence id or a layer."""
    with pytest.raises(ConfigError):
        parse_ids(text, "--sentences")
    with pytest.raises(ConfigError):
        parse_layers(text)


def test_many_ranges_are_refused_at_once():
    """60 ranges of 10,000 ids: refused before any range is expanded (once quadratic: minutes)."""
    text = ",".join(f"{i * 10_000}-{i * 10_000 + 9_999}" for i in range(60))
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="more than 1,000 ids"):
        parse_ids(text, "--sentences")
    many = ",".join(str(i) for i in range(1_001))
    with pytest.raises(ConfigError, match="more than 1,000 ids"):
        parse_ids(many, "--sentences")
    assert time.perf_counter() - started < 1
    assert parse_ids("5,0-2,1", "--sentences") == (5, 0, 1, 2)


def test_texts_and_ids_from_python():
    assert as_texts("The cat", "--text") == ("The cat",)  # one text, never its characters
    assert as_texts(["a", "b"], "--text") == ("a", "b")
    with pytest.raises(ConfigError, match="got 3 in it"):
        as_texts(["a", 3], "--text")
    assert as_ids([3, 1, 3], "--sentences") == (3, 1)
    with pytest.raises(ConfigError, match="got True"):
        as_ids([True], "--sentences")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["inspect", "--sentences", "²"], "--sentences takes ids and ranges"),
        (["inspect", "--text", "a", "--heads", "0.-1"], "LAYER.HEAD"),
        (["ablate", "--heads", "1.x"], "LAYER.HEAD"),
        (["analyze", "--layers", "0-²"], "--layers takes numbers"),
    ],
)
def test_the_cli_refuses_the_same_forms_as_usage_errors(args, fragment, tmp_path):
    command, *rest = args
    result = run_cli(command, "gpt2", *rest, "--out", tmp_path / "o", loader=refuse_to_load)
    assert_one_line_error(result, fragment, code=2)


# ---------------------------------------------------------------- the Python API validates like the CLI


@pytest.fixture(scope="module")
def copier(planted_copier):
    words = copy_words()
    loaded = headscope.load_model(str(planted_copier), device="cpu", lm_head=True)
    return loaded, [" ".join(words[:4]), " ".join(words[2:7])]


@pytest.mark.parametrize(
    "heads, message",
    [
        ([[(0, -1)]], "count from 0"),
        ([[(-1, 0)]], "count from 0"),
        ([[(True, True)]], "whole numbers"),
        ([[(0.0, 1.5)]], "whole numbers"),
        ([(0, 1)], "groups of heads"),
        ([[(9, 0)]], "the model has layers 0-1"),
    ],
)
def test_ablate_refuses_heads_it_would_wrap_or_misname(copier, heads, message):
    loaded, sentences = copier
    with pytest.raises(ConfigError, match=message):
        headscope.ablate(loaded, sentences, heads=heads, bootstrap=0)


def test_inspect_takes_one_text_as_one_text_and_refuses_wrapped_heads(copier):
    loaded, _ = copier
    found = headscope.inspect(loaded, texts="the cat", heads=[(0, 1)], page=False)
    assert [t["label"] for t in found.record["texts"]] == ["text 0"] and found.record["heads"] == ["0.1"]
    for heads in ([(0, -1)], [(True, 0)], [(9, 0)]):
        with pytest.raises(ConfigError):
            headscope.inspect(loaded, texts=["the cat"], heads=heads, page=False)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, s: headscope.analyze(m, [None, 3]), "holds strings"),
        (lambda m, s: headscope.analyze(m, 42), "corpus takes a file path"),
        (lambda m, s: headscope.analyze(m, s, layers=[True]), "--layers takes whole numbers"),
        (lambda m, s: headscope.analyze(m, s, bootstrap=True), "--bootstrap takes a whole number"),
        (lambda m, s: headscope.analyze(m, s, window=2.5), "--window takes a whole number"),
        (lambda m, s: headscope.prune(m, s, budget=True), "--budget takes a number; got True"),
        (lambda m, s: headscope.ablate(m, s, each_role=1), "each_role takes True or False"),
        (lambda m, s: headscope.Report.open(None), "a report is opened from its folder"),
        (lambda m, s: headscope.analyze(5, s), "model takes a hub id"),
        (lambda m, s: headscope.analyze(m, s, out=5), "out takes a path"),
        (lambda m, s: headscope.analyze(m, s, thresholds=5), "thresholds takes a headscope.Thresholds"),
        (lambda m, s: headscope.analyze(m, s, charts="gif"), "--format must be one of png, svg, pdf"),
        (lambda m, s: headscope.analyze(m, s, config=5), "config takes a headscope.RunConfig"),
        (lambda m, s: headscope.load_model(None), "model takes a hub id"),
        (lambda m, s: headscope.load_model("gpt2", device="x"), "--device must be one of"),
        (lambda m, s: headscope.prune(m, s, budget=1, save_model=3), "save_model takes a path"),
        (lambda m, s: headscope.inspect(m, texts="a", probes=5), "--probe takes a string or a list of strings"),
    ],
)
def test_the_api_raises_headscope_errors_with_the_clis_messages(copier, call, message):
    loaded, sentences = copier
    with pytest.raises(ConfigError, match=message):
        call(loaded, sentences)


def test_layers_as_text_from_python_are_parsed_as_the_cli_parses_them(copier):
    loaded, sentences = copier
    report = headscope.analyze(loaded, sentences, layers="1", probes=False, bootstrap=0, sentence_heads=False)
    assert sorted(report.heads["layer"].unique()) == [1]


NUMBER_TYPES = {
    "numpy float32": lambda x: np.float32(x),
    "numpy float64": lambda x: np.float64(x),
    "Decimal": lambda x: Decimal(str(x)),
    "Fraction": lambda x: Fraction(str(x)),
    "text": lambda x: str(x),
}


@pytest.mark.parametrize("kind", sorted(NUMBER_TYPES))
def test_numbers_of_any_type_are_numbers(kind):
    """A number is a number whatever its type: numpy's (a float32 at the decimal it shows), Decimal, Fraction, or text
    writing one as the CLI reads it; the settings and rules hold plain floats and ints."""
    made = NUMBER_TYPES[kind]
    whole = made(3) if kind == "text" else 3  # a float, Decimal or Fraction is no whole number, even 3.0
    settings = RunConfig(sink_threshold=made(0.3), dormant_tolerance=made(0.02), window=whole)
    assert settings.sink_threshold == 0.3 and type(settings.sink_threshold) is float
    assert settings.dormant_tolerance == 0.02 and settings.window == 3 and type(settings.window) is int
    roles = RoleThresholds(probe_min=made(0.3))
    assert roles.probe_min == 0.3 and type(roles.probe_min) is float
    assert check_prune_request(made(0.05), "zero", None) == (0.05, None, 2)


def test_whole_numbers_of_any_integer_type_and_refusals_that_name_the_value():
    assert RunConfig(bootstrap=np.int64(10), window=np.int32(1)).bootstrap == 10
    for value, fragment in [(True, "got True (bool)"), (3.0, "got 3.0"), ("three", "got 'three' (str)")]:
        with pytest.raises(ConfigError, match=re.escape(f"--window takes a whole number; {fragment}")):
            RunConfig(window=value)
    with pytest.raises(ConfigError, match=re.escape("--budget must be a positive number of nats; got -0.5")):
        check_prune_request(np.float32(-0.5), "zero", None)


def test_heads_as_a_numpy_array_or_a_heads_table():
    import pandas as pd

    assert as_heads(np.array([[2, 1], [1, 0]])) == ((1, 0), (2, 1))
    assert as_heads(pd.DataFrame({"layer": [2, 1], "head": [1, 0], "role": ["x", "y"]})) == ((1, 0), (2, 1))
    assert as_head_groups(np.array([[[1, 0], [2, 1]]])) == [((1, 0), (2, 1))]
