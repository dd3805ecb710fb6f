"""Scorers of the built-in tasks: arithmetic, countdown, sorting."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.data.tasks import TASKS, get_task
from hyflow.rewards.registry import default_compute_score, get_scorer
from hyflow.rewards.scorers import arithmetic, countdown, sorting


def test_scorers_are_registered_by_data_source():
    assert get_scorer("hyflow/arithmetic") is arithmetic.compute_score
    assert get_scorer("hyflow/countdown") is countdown.compute_score
    assert get_scorer("countdown") is countdown.compute_score
    assert get_scorer("hyflow/sorting") is sorting.compute_score
    assert get_scorer("hyflow/calculator") is arithmetic.compute_score


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_worked_answer_scores_one_and_a_bare_prompt_scores_zero(name):
    rows = get_task(name).generate(seed=0, n_train=100, n_test=0)["train"]
    for row in rows:
        truth, answer = row["reward_model"]["ground_truth"], row["extra_info"]["answer"]
        assert default_compute_score(row["data_source"], answer, truth) == {
            "score": 1.0, "acc": True, "pred": answer.split("#### ")[-1],
        }
        assert default_compute_score(row["data_source"], row["prompt"][-1]["content"], truth)["score"] == 0.0


# --- arithmetic ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "score", "acc", "pred"),
    [
        ("12 + 7 * 3 = 12 + 21 = 33\n#### 33", 1.0, True, "33"),
        ("####33", 1.0, True, "33"),
        ("#### 33.", 1.0, True, "33"),
        ("#### 33.0", 1.0, True, "33"),
        ("#### 1 is a guess\n#### 33", 1.0, True, "33"),
        ("#### 34", 0.1, False, "34"),
        ("#### 33\n#### 34", 0.1, False, "34"),
        ("#### 33.5", 0.1, False, "33.5"),
        ("the answer is 33", 0.0, False, None),
        ("#### 33\n#### none", 0.0, False, None),
        ("", 0.0, False, None),
    ],
)
def test_arithmetic_strict(response, score, acc, pred):
    assert arithmetic.compute_score("hyflow/arithmetic", response, "33", format_score=0.1) == {
        "score": score, "acc": acc, "pred": pred,
    }


def test_arithmetic_negative_and_thousands():
    assert arithmetic.compute_score("hyflow/arithmetic", "#### -1,204", "-1204")["score"] == 1.0
    assert arithmetic.compute_score("hyflow/arithmetic", "#### - 5", "-5")["score"] == 1.0
    assert arithmetic.compute_score("hyflow/arithmetic", "#### 5", "-5")["acc"] is False


def test_arithmetic_flexible_falls_back_to_the_last_integer():
    assert arithmetic.compute_score("hyflow/arithmetic", "it is 12, no 33.", "33", method="flexible") == {
        "score": 1.0, "acc": True, "pred": "33",
    }
    assert arithmetic.compute_score("hyflow/arithmetic", "it is 34", "33", method="flexible", format_score=0.2)[
        "score"] == 0.2
    assert arithmetic.compute_score("hyflow/arithmetic", "#### 34 not 33", "33", method="flexible")["pred"] == "34"
    assert arithmetic.compute_score("hyflow/arithmetic", "no digits", "33", method="flexible")["pred"] is None
    with pytest.raises(ValueError, match=r"unknown arithmetic extraction method 'loose'; use one of"):
        arithmetic.compute_score("hyflow/arithmetic", "#### 1", "1", method="loose")


def test_calculator_reads_the_models_answer_in_a_multi_turn_response():
    # a decoded multi-turn rollout: the call turn, the tool's answer (rendered turn), the final answer
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "4817 + 2958"}}</tool_call>'
    response = f"{call}<|im_end|>\n<|im_start|>tool\n7775<|im_end|>\n<|im_start|>assistant\n#### 7775<|im_end|>"
    assert default_compute_score("hyflow/calculator", response, "7775") == {"score": 1.0, "acc": True, "pred": "7775"}
    wrong = response.replace("#### 7775", "#### 7765")
    assert default_compute_score("hyflow/calculator", wrong, "7775") == {"score": 0.0, "acc": False, "pred": "7765"}
    # the tool's number alone is not an answer: only the model writes ####
    unanswered = response.replace("#### 7775", "")
    assert default_compute_score("hyflow/calculator", unanswered, "7775") == {"score": 0.0, "acc": False, "pred": None}
    # a direct answer "in its head"
    assert default_compute_score("hyflow/calculator", "#### 7775", "7775")["acc"] is True


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_arithmetic_score_is_integer_equality(answer, truth):
    result = arithmetic.compute_score("hyflow/arithmetic", f"work\n#### {answer}", str(truth))
    assert result["acc"] is (answer == truth)
    assert result["score"] == float(answer == truth)
    assert result["pred"] == str(answer)


# --- countdown ----------------------------------------------------------------------------------------------

TRUTH = json.dumps({"target": 24, "numbers": [4, 6, 1]})


@pytest.mark.parametrize(
    ("response", "score", "acc"),
    [
        ("#### 4 * 6 * 1", 1.0, True),
        ("(4 * 6) / 1 = 24\n#### 4 * 6 / 1", 1.0, True),
        ("#### (1 + 6 - 1) * 4", 0.1, False),  # 1 used twice
        ("#### 4 * 6", 0.1, False),  # 1 not used
        ("#### 4 + 6 + 1", 0.1, False),  # 11
        ("#### 4 / (1 - 1) * 6", 0.1, False),  # 1 twice; would divide by zero
        ("#### -(1 - 4) * 6 + 1 - 1", 0.1, False),
        ("#### 4 * 6 * 1 = 24.", 1.0, True),
        ("#### `4*6*1`", 1.0, True),
        ("I think <answer>4 * (6 * 1)</answer>", 1.0, True),
        ("<answer>4 + 6</answer> then <answer>6 * 4 * 1</answer>", 1.0, True),
        ("#### 4.0 * 6 * 1", 0.0, False),
        ("#### 4 ** 6 * 1", 0.0, False),
        ("#### 4 // 6 * 1", 0.0, False),
        ("#### 4 % 6 * 1", 0.0, False),
        ("#### 24", 0.1, False),
        ("#### __import__('os').system('echo pwned')", 0.0, False),
        ("#### (1).__class__", 0.0, False),
        ("#### [4, 6, 1]", 0.0, False),
        ("#### lambda: 24", 0.0, False),
        ("#### 4 * 6 if True else 1", 0.0, False),
        ("#### not 4", 0.0, False),
        ("#### ~4 * 6 * 1", 0.0, False),
        ("#### True * 24", 0.0, False),
        ("#### 4 * (6 * 1", 0.0, False),
        ("#### " + "(" * 300 + "4" + ")" * 300, 0.0, False),
        ("#### " + "1 + " * 200 + "1", 0.0, False),
        ("24", 0.0, False),
        ("####", 0.0, False),
    ],
)
def test_countdown(response, score, acc):
    result = countdown.compute_score("hyflow/countdown", response, TRUTH, format_score=0.1)
    assert (result["score"], result["acc"]) == (score, acc)


def test_countdown_code_in_the_answer_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    payloads = [
        f"__import__('pathlib').Path({str(marker)!r}).touch()",
        f"open({str(marker)!r}, 'w')",
        f"[4, 6, 1, __import__('os').mkdir({str(marker)!r})]",
    ]
    for payload in payloads:
        result = countdown.compute_score("hyflow/countdown", f"#### {payload}", TRUTH, format_score=0.1)
        assert result == {"score": 0.0, "acc": False, "pred": payload}
    assert not marker.exists()


def test_countdown_exact_division_unary_minus_and_division_by_zero():
    truth = json.dumps({"target": 2, "numbers": [3, 4, 6]})
    assert countdown.compute_score("countdown", "#### 3 / 6 * 4", truth)["acc"] is True  # 1/2 * 4, exactly
    assert countdown.compute_score("countdown", "#### 4 - 6 / -(-3)", truth)["acc"] is True
    assert countdown.compute_score("countdown", "#### 4 - 6 / -3", truth, format_score=0.1)["score"] == 0.1
    zero = json.dumps({"target": 6, "numbers": [4, 4, 6]})
    assert countdown.compute_score("countdown", "#### 6 / (4 - 4)", zero, format_score=0.1) == {
        "score": 0.1, "acc": False, "pred": "6 / (4 - 4)",
    }


def test_countdown_rules_from_the_ground_truth():
    at_most_once = json.dumps({"target": 10, "numbers": [4, 6, 9], "use_all": False})
    assert countdown.compute_score("countdown", "#### 4 + 6", at_most_once)["acc"] is True
    assert countdown.compute_score("countdown", "#### 4 + 6 + 9 - 9", at_most_once)["acc"] is False
    plus_minus = json.dumps({"target": 24, "numbers": [4, 6, 1], "operators": "+-"})
    assert countdown.compute_score("countdown", "#### 4 * 6 * 1", plus_minus)["acc"] is False


def test_countdown_accepts_tinyzero_dict_ground_truth():
    truth = {"target": 24, "numbers": (4, 6, 1)}
    assert countdown.compute_score("countdown", "<answer>(6 - 1 - 1) * 4</answer>", truth)["acc"] is False
    assert countdown.compute_score("countdown", "<answer>6 * 4 / 1</answer>", truth) == {
        "score": 1.0, "acc": True, "pred": "6 * 4 / 1",
    }


def test_countdown_non_integer_intermediates_are_exact():
    truth = json.dumps({"target": 3, "numbers": [1, 3, 9]})
    assert countdown.compute_score("countdown", "#### 1 / 3 * 9", truth)["score"] == 1.0
    assert countdown.compute_score("countdown", "#### (1 + 9) / 3", truth)["score"] == 0.0  # 10/3
    sevenths = json.dumps({"target": 1, "numbers": [1, 7, 7, 49]})
    assert countdown.compute_score("countdown", "#### 1 / 7 / 7 * 49", sevenths)["score"] == 1.0


# --- sorting ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "score", "acc", "pred"),
    [
        ("#### 1 3 5", 1.0, True, "1 3 5"),
        ("#### [1, 3, 5].", 1.0, True, "1 3 5"),
        ("#### 5 3 1\n#### 1 3 5", 1.0, True, "1 3 5"),
        ("#### 1 3 5\nthat is all", 1.0, True, "1 3 5"),
        ("#### 1 5 3", 0.1, False, "1 5 3"),
        ("#### 1 3", 0.1, False, "1 3"),
        ("#### 1 3 5 5", 0.1, False, "1 3 5 5"),
        ("#### one three five", 0.0, False, None),
        ("#### 1 3 and 5", 0.0, False, None),
        ("#### ", 0.0, False, None),
        ("1 3 5", 0.0, False, None),
    ],
)
def test_sorting(response, score, acc, pred):
    assert sorting.compute_score("hyflow/sorting", response, "1 3 5", format_score=0.1) == {
        "score": score, "acc": acc, "pred": pred,
    }


def test_sorting_negative_values_and_list_ground_truth():
    assert sorting.compute_score("hyflow/sorting", "#### -3 0 2", [-3, 0, 2])["acc"] is True
    assert sorting.compute_score("hyflow/sorting", "#### -3 0 2", "-3 0 2")["acc"] is True
    assert sorting.compute_score("hyflow/sorting", "#### 3 0 2", "-3 0 2")["acc"] is False


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-50, 50), min_size=1, max_size=8))
def test_sorting_accepts_exactly_the_sorted_list(values):
    truth = " ".join(map(str, sorted(values)))
    assert sorting.compute_score("hyflow/sorting", f"#### {' '.join(map(str, values))}", truth)["acc"] is (
        values == sorted(values)
    )
