"""GSM8K scorer: strict/flexible extraction, numeric normalisation, verl's reward rule and tail window."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyflow.rewards.registry import default_compute_score, get_scorer
from hyflow.rewards.scorers import gsm8k


def test_registered_for_both_names():
    assert get_scorer("openai/gsm8k") is gsm8k.compute_score
    assert get_scorer("gsm8k") is gsm8k.compute_score


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
        ("#### $1,000.50", "1000.5", "1000.5"),
        ("so the answer is\n#### 72.", "72", "72"),
        ("####-5", "-5", "-5"),
        ("#### -$5", "-5", "-5"),
        ("#### 3.0", "3", "3"),
        ("first #### 1 then #### 2", "2", "2"),
        ("The answer is 42 apples.", None, "42"),
        ("pages 10-20 cost $1,234,567.5 in total", None, "1234567.5"),
        ("-0 degrees", None, "0"),
        ("no digits at all", None, None),
    ],
)
def test_extract_answer(text, strict, flexible):
    assert gsm8k.extract_answer(text, "strict") == strict
    assert gsm8k.extract_answer(text, "flexible") == flexible


@pytest.mark.parametrize(
    ("a", "b"), [("1,000", "1000"), ("3.0", "3"), ("$5", "5"), ("0.50", ".5"), ("-0", "0")]
)
def test_normalize_number_equates_formats(a, b):
    assert gsm8k.normalize_number(a) == gsm8k.normalize_number(b)


def test_normalize_number_rejects_non_numbers():
    assert gsm8k.normalize_number("1.2.3") is None
    assert gsm8k.normalize_number("abc") is None
    assert gsm8k.normalize_number("inf") is None


def test_reward_rule_correct_wrong_and_missing():
    assert gsm8k.compute_score("openai/gsm8k", "#### 1,000", "1000") == {
        "score": 1.0,
        "acc": True,
        "pred": "1000",
    }
    assert gsm8k.compute_score("openai/gsm8k", "#### 7", "8", format_score=0.1) == {
        "score": 0.1,
        "acc": False,
        "pred": "7",
    }
    assert gsm8k.compute_score("openai/gsm8k", "I think 8", "8") == {"score": 0.0, "acc": False, "pred": None}
    assert gsm8k.compute_score("openai/gsm8k", "I think 8", "8", method="flexible")["acc"] is True
    assert gsm8k.compute_score("gsm8k", "#### 8", "8", score=2.0)["score"] == 2.0


def test_ground_truth_may_be_a_full_gsm8k_solution():
    truth = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,200"
    assert gsm8k.compute_score("gsm8k", "#### 1200", truth)["acc"] is True


def test_whole_response_scanned_by_default_but_tail_chars_reproduces_verl():
    text = "#### 18\n" + "I double-checked everything and I am confident in this result. " * 8
    assert len(text) > 300
    assert gsm8k.compute_score("gsm8k", text, "18")["acc"] is True
    assert gsm8k.compute_score("gsm8k", text, "18", tail_chars=300) == {
        "score": 0.0,
        "acc": False,
        "pred": None,
    }


def test_unknown_method_is_an_error():
    with pytest.raises(
        ValueError, match=r"unknown GSM8K extraction method 'loose'; use one of \('strict', 'flexible'\)"
    ):
        gsm8k.compute_score("gsm8k", "#### 1", "1", method="loose")


def test_default_compute_score_dispatches_and_ignores_extra_kwargs():
    assert (
        default_compute_score("openai/gsm8k", "#### 4", "4", extra_info={"index": 0}, foo=1)["score"] == 1.0
    )


@given(st.integers(-(10**12), 10**12), st.booleans(), st.booleans())
def test_any_integer_in_any_format_matches_its_plain_value(n, commas, dollar):
    written = f"{abs(n):,}" if commas else str(abs(n))
    written = ("-" if n < 0 else "") + ("$" if dollar else "") + written
    result = gsm8k.compute_score("gsm8k", f"work...\n#### {written}", str(n))
    assert result == {"score": 1.0, "acc": True, "pred": str(n)}
    assert gsm8k.compute_score("gsm8k", f"#### {written}", str(n + 1))["acc"] is False
