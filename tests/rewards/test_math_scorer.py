"""MATH scorer: boxed extraction with brace matching, Hendrycks normalisation, optional Math-Verify."""

from __future__ import annotations

import sys
import threading
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyflow.rewards.registry import get_scorer
from hyflow.rewards.scorers import math as math_scorer


def test_registered_names():
    for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"):
        assert get_scorer(name) is math_scorer.compute_score


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"first \boxed{1}, finally \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\sqrt{\frac{a}{b}} + {c}}", r"\sqrt{\frac{a}{b}} + {c}"),
        (r"\fbox{3}", "3"),
        (r"answer $\boxed 5$", "5"),
        (r"\boxed{\boxed{7}}", r"\boxed{7}"),
        (r"\boxed{2} and then a truncated \boxed{\frac{1", None),
        ("no box here", None),
        (r"\boxedx{3} is not a box", None),
    ],
)
def test_extract_boxed_answer(text, expected):
    assert math_scorer.extract_boxed_answer(text) == expected


@pytest.mark.parametrize(
    ("pred", "reference"),
    [
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"10\!000", "10000"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"\$18.90", "18.90"),
        (r"5\text{ cm}", "5"),
        (r"12 \mbox{ inches}^2", "12"),
        (r"\text{Monday}", "Monday"),
        (r"\dfrac{3}{4}", r"\frac{3}{4}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{72}", r"\frac{1}{72}"),
        ("0.5", r"\frac{1}{2}"),
        (".25", r"\frac14"),
        ("3/4", r"\frac{3}{4}"),
        (r"-\frac{1}{2}", "-0.5"),
        ("7.", "7"),
        ("x = 3", "3"),
        (r"y=\frac{1}{2}", "0.5"),
        ("50\\%", "50"),
        (r"\sqrt2", r"\sqrt{2}"),
        ("1,000", "1000"),
        (r"\displaystyle \frac{1}{3}", r"\frac13"),
    ],
)
def test_equivalent_answers(pred, reference):
    assert math_scorer.is_equiv(pred, reference)
    assert math_scorer.is_equiv(reference, pred)


@pytest.mark.parametrize(
    ("pred", "reference"),
    [
        ("2", "3"),
        (r"\frac{1}{3}", "0.33"),
        ("x+1", "x-1"),
        (r"\sqrt{2}", r"\sqrt{3}"),
        ("(1,2)", "[1,2]"),
        (r"\frac{1}{0}", "1"),
        (r"\rightarrow", r"\arrow"),
        ("f(x) = 3", "3"),
    ],
)
def test_different_answers(pred, reference):
    assert not math_scorer.is_equiv(pred, reference)


def test_none_is_never_equivalent():
    assert not math_scorer.is_equiv(None, None)
    assert not math_scorer.is_equiv("1", None)


def test_reward_rule(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # string equivalence only
    assert math_scorer.compute_score("math", r"so \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}") == {
        "score": 1.0,
        "acc": True,
        "pred": r"\frac{1}{2}",
    }
    assert math_scorer.compute_score("math", r"\boxed{3}", "4", format_score=0.1) == {
        "score": 0.1,
        "acc": False,
        "pred": "3",
    }
    assert math_scorer.compute_score("math", "the answer is 4", "4") == {
        "score": 0.0,
        "acc": False,
        "pred": None,
    }


def test_boxed_ground_truth_is_unwrapped(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    solution = r"Adding gives $2+2=\boxed{4}$."
    assert math_scorer.compute_score("lighteval/MATH", r"\boxed{4}", solution)["acc"] is True


def _fake_math_verify(equal_pairs, calls):
    """A stand-in `math_verify` module: parse returns the text, verify says equal for the listed pairs."""
    module = types.ModuleType("math_verify")

    def parse(text, parsing_timeout=None):
        calls.append(("parse", text, parsing_timeout))
        return text

    def verify(gold, answer, timeout_seconds=None):
        calls.append(("verify", gold, answer, timeout_seconds))
        return (gold, answer) in equal_pairs

    module.parse, module.verify = parse, verify
    return module


def test_math_verify_is_a_second_opinion(monkeypatch):
    calls = []
    fake = _fake_math_verify({(r"\boxed{2\sqrt{2}}", r"\boxed{\sqrt{8}}")}, calls)
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert math_scorer.compute_score("math", r"\boxed{\sqrt{8}}", r"2\sqrt{2}")["acc"] is True
    assert ("verify", r"\boxed{2\sqrt{2}}", r"\boxed{\sqrt{8}}", math_scorer.MATH_VERIFY_TIMEOUT_S) in calls
    assert (
        math_scorer.compute_score("math", r"\boxed{\sqrt{8}}", r"2\sqrt{2}", use_math_verify=False)["acc"]
        is False
    )
    assert math_scorer.compute_score("math", r"\boxed{3}", r"2\sqrt{2}")["acc"] is False
    calls.clear()
    assert math_scorer.compute_score("math", r"\boxed{0.5}", r"\frac12")["acc"] is True
    assert calls == []  # string equivalence already decided


def test_math_verify_runs_without_timeout_off_the_main_thread(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "math_verify", _fake_math_verify(set(), calls))
    thread = threading.Thread(target=math_scorer.compute_score, args=("math", r"\boxed{1}", "2"))
    thread.start()
    thread.join()
    assert calls and all(call[-1] is None for call in calls)


def test_math_verify_failure_warns_once_and_counts_as_not_equal(monkeypatch):
    module = types.ModuleType("math_verify")

    def broken_parse(text, parsing_timeout=None):
        raise RuntimeError("parser exploded")

    module.parse, module.verify = broken_parse, lambda *a, **k: True
    monkeypatch.setitem(sys.modules, "math_verify", module)
    monkeypatch.setattr(math_scorer, "_MATH_VERIFY_WARNED", False)
    with pytest.warns(UserWarning, match=r"math_verify failed \(RuntimeError: parser exploded\)"):
        assert math_scorer.compute_score("math", r"\boxed{1}", "2")["acc"] is False
    assert math_scorer.compute_score("math", r"\boxed{1}", "2")["acc"] is False  # no second warning


def test_requiring_math_verify_without_it_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(
        ImportError,
        match=r"use_math_verify=True but the math_verify package is not installed.*pip install math-verify",
    ):
        math_scorer.compute_score("math", r"\boxed{1}", "1", use_math_verify=True)


def test_real_math_verify_when_installed(monkeypatch):
    pytest.importorskip("math_verify")
    assert (
        math_scorer.compute_score("math", r"\boxed{\sqrt{8}}", r"2\sqrt{2}", use_math_verify=True)["acc"]
        is True
    )
    assert math_scorer.compute_score("math", r"\boxed{3}", r"2\sqrt{2}", use_math_verify=True)["acc"] is False


@given(st.integers(-1000, 1000), st.integers(1, 1000))
def test_fraction_spellings_are_equivalent(a, b):
    assert math_scorer.is_equiv(rf"\frac{{{a}}}{{{b}}}", f"{a}/{b}")
    assert math_scorer.is_equiv(rf"\dfrac{{{2 * a}}}{{{2 * b}}}", rf"\frac{{{a}}}{{{b}}}")
    assert not math_scorer.is_equiv(rf"\frac{{{a}}}{{{b}}}", rf"\frac{{{a + b}}}{{{b}}}")
