"""The Geometry3K scorer: verl's geo3k reward (format <think>...</think> then \\boxed{}, accuracy of the box, weighted
0.9 / 0.1), with the MATH scorer's box extraction and equivalence."""

from __future__ import annotations

import re
import sys

import pytest

from hyflow.rewards.registry import default_compute_score, get_scorer
from hyflow.rewards.scorers import geo3k
from hyflow.rewards.scorers import math as math_scorer

SOURCE = "hiyouga/geometry3k"
# verl/utils/reward_score/geo3k.py's format pattern, as verl writes it
VERL_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def test_registered_for_the_data_source_verl_uses():
    assert get_scorer(SOURCE) is geo3k.compute_score
    assert default_compute_score(SOURCE, "<think>x = 3</think>\\boxed{3}", "3")["score"] == 1.0


@pytest.mark.parametrize(
    ("response", "truth", "score", "acc", "formatted", "pred"),
    [
        ("<think>The sides are equal, so x = 3.</think> The answer is \\boxed{3}.", "3", 1.0, True, True, "3"),
        ("<think>\nstep 1\nstep 2\n</think>\n\\boxed{60}", "60", 1.0, True, True, "60"),
        ("The answer is \\boxed{3}.", "3", 0.9, True, False, "3"),  # right, no <think> block
        (" <think>x</think> \\boxed{3}", "3", 0.9, True, False, "3"),  # verl: the response must START with <think>
        ("<think>x = 4</think> \\boxed{4}", "3", 0.1, False, True, "4"),  # right format, wrong answer
        ("<think>no box</think> the answer is 3", "3", 0.0, False, False, None),
        ("the answer is 3", "3", 0.0, False, False, None),
        ("<think>a</think> \\boxed{1} then \\boxed{3}", "3", 1.0, True, True, "3"),  # the last box
        ("<think>a</think> \\boxed{\\frac{1}{2}}", "0.5", 1.0, True, True, "\\frac{1}{2}"),
        ("<think>a</think> \\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0, True, True, "2\\sqrt{3}"),
        ("<think>a</think> \\boxed{60^\\circ}", "60", 1.0, True, True, "60"),
        ("<think>a</think> \\boxed{\\frac{40}{3}}", "13.3", 0.1, False, True, "\\frac{40}{3}"),
        ("<think>a</think> \\boxed{3", "3", 0.0, False, False, None),  # an unclosed box: no answer, no format
    ],
)
def test_verls_weighting_of_format_and_accuracy(response, truth, score, acc, formatted, pred):
    result = geo3k.compute_score(SOURCE, response, truth, use_math_verify=False)
    assert result == {"score": pytest.approx(score), "acc": acc, "format": formatted, "pred": pred}
    assert formatted == bool(VERL_FORMAT.fullmatch(response))
    assert result["score"] == pytest.approx(0.9 * acc + 0.1 * formatted)


def test_format_weight_can_be_changed_as_in_verl():
    right_unformatted, wrong_formatted = "\\boxed{3}", "<think>a</think>\\boxed{4}"
    assert geo3k.compute_score(SOURCE, right_unformatted, "3", format_score=0.0)["score"] == 1.0
    assert geo3k.compute_score(SOURCE, wrong_formatted, "3", format_score=0.0)["score"] == 0.0
    assert geo3k.compute_score(SOURCE, wrong_formatted, "3", format_score=0.5)["score"] == 0.5
    assert geo3k.compute_score(SOURCE, "<think>a</think>\\boxed{3}", "3", format_score=0.5)["score"] == 1.0
    with pytest.raises(ValueError, match=r"format_score is the weight of the format reward, in \[0, 1\]; got 1.5"):
        geo3k.compute_score(SOURCE, right_unformatted, "3", format_score=1.5)


def test_use_boxed_false_compares_the_whole_response():
    assert geo3k.compute_score(SOURCE, " 3 ", "3", use_boxed=False) == {
        "score": pytest.approx(0.9), "acc": True, "format": False, "pred": "3"}
    assert geo3k.compute_score(SOURCE, "x is 3", "3", use_boxed=False, use_math_verify=False)["acc"] is False


def test_boxed_ground_truth_and_math_verify_second_opinion(monkeypatch):
    assert geo3k.compute_score(SOURCE, "\\boxed{3}", "\\boxed{3}")["acc"] is True
    calls = []

    class FakeMathVerify:
        @staticmethod
        def parse(text, parsing_timeout=None):
            return text

        @staticmethod
        def verify(gold, answer, timeout_seconds=None):
            calls.append((gold, answer))
            return True

    monkeypatch.setitem(sys.modules, "math_verify", FakeMathVerify)
    assert geo3k.compute_score(SOURCE, "\\boxed{\\sqrt{12}}", "2\\sqrt{3}")["acc"] is True
    assert calls == [("\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{12}}")]
    assert geo3k.compute_score(SOURCE, "\\boxed{\\sqrt{12}}", "2\\sqrt{3}", use_math_verify=False)["acc"] is False
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"use_math_verify=True but the math_verify package is not installed"):
        geo3k.compute_score(SOURCE, "\\boxed{3}", "3", use_math_verify=True)


def test_shares_the_math_scorers_extraction():
    for response in ("\\boxed{\\{1, 2\\}}", "\\fbox{5}", "a \\boxed 7 b", "\\boxed{\\boxed{8}}"):
        expected = math_scorer.extract_boxed_answer(response)
        assert geo3k.compute_score(SOURCE, response, "0", use_math_verify=False)["pred"] == (
            math_scorer.normalize_answer(expected))


@pytest.mark.parametrize("truth", [None, "", "  ", float("nan")])
def test_missing_ground_truth_is_an_error(truth):
    with pytest.raises(ValueError, match=r"no ground truth for data_source 'hiyouga/geometry3k'"):
        geo3k.compute_score(SOURCE, "<think>a</think>\\boxed{3}", truth)
