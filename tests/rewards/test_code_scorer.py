"""Code scorer: code extraction, test formats, output matching, and scores from real sandbox runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyflow.rewards.registry import get_scorer
from hyflow.rewards.scorers import code

ADD_TESTS = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
ADD_SOLUTION = (
    "Read both numbers and add them.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
)


def test_registered_names():
    for name in ("codecontests", "apps", "codeforces", "taco", "code"):
        assert get_scorer(name) is code.compute_score


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("```py\nprint(1)\n```\nthen\n```Python3\nprint(2)\n```", "print(2)\n"),
        ("```python\nprint(1)\n```\n```bash\nls\n```", "print(1)\n"),
        ("```cpp\nint main(){}\n```\n```\nprint(3)\n```", "print(3)\n"),
        ("print(4)", "print(4)"),
    ],
)
def test_extract_code(text, expected):
    assert code.extract_code(text) == expected


def test_correct_solution_scores_one_from_dict_or_json():
    expected = {"score": 1.0, "acc": True, "pass_rate": 1.0, "timeouts": 0, "errors": 0}
    assert code.compute_score("codecontests", ADD_SOLUTION, ADD_TESTS) == expected
    assert code.compute_score("codecontests", ADD_SOLUTION, json.dumps(ADD_TESTS)) == expected


def test_wrong_answer_all_or_nothing_stops_at_first_failure():
    wrong = ADD_SOLUTION.replace("a + b", "a * b if a > 1 else a + b")  # passes test 0, fails test 1
    assert code.compute_score("apps", wrong, ADD_TESTS) == {
        "score": 0.0,
        "acc": False,
        "pass_rate": 0.5,
        "timeouts": 0,
        "errors": 0,
    }
    reversed_tests = {"inputs": ADD_TESTS["inputs"][::-1], "outputs": ADD_TESTS["outputs"][::-1]}
    assert code.compute_score("apps", wrong, reversed_tests)["pass_rate"] == 0.0  # stopped after the first


def test_partial_credit_runs_every_test():
    wrong = ADD_SOLUTION.replace("a + b", "a * b if a > 1 else a + b")
    reversed_tests = {"inputs": ADD_TESTS["inputs"][::-1], "outputs": ADD_TESTS["outputs"][::-1]}
    result = code.compute_score("apps", wrong, reversed_tests, partial=True)
    assert result["score"] == 0.5 and result["pass_rate"] == 0.5 and result["acc"] is False


def test_timeout_scores_zero_and_is_counted():
    looping = "```python\nn = int(input())\nwhile n > 5:\n    pass\nprint(n)\n```"
    tests = {"inputs": ["1", "9"], "outputs": ["1", "9"]}
    result = code.compute_score("taco", looping, tests, partial=True, timeout_s=0.5)
    assert result == {"score": 0.5, "acc": False, "pass_rate": 0.5, "timeouts": 1, "errors": 0}


def test_crash_counts_as_error():
    crashing = "```python\nraise SystemExit(input() + ' is not handled')\n```"
    result = code.compute_score("code", crashing, ADD_TESTS, partial=True)
    assert result == {"score": 0.0, "acc": False, "pass_rate": 0.0, "timeouts": 0, "errors": 2}


def test_call_based_function():
    tests = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, [7]]}  # `[7]`: APPS-style wrapping
    solution = (
        "```python\ndef add(a, b):\n    print('debug output is ignored')\n    return a + b\n\n"
        "if __name__ == '__main__':\n    input()  # must not run: there is no stdin\n```"
    )
    assert code.compute_score("apps", solution, tests)["score"] == 1.0
    assert code.compute_score("apps", solution.replace("a + b", "a - b"), tests)["score"] == 0.0


def test_call_based_leetcode_class_tuples_sets_and_floats():
    solution = "```python\nclass Solution:\n    def f(self, x):\n        return (x, {3, 1, 2}, x / 3)\n```"
    tests = {"fn_name": "f", "inputs": [[1]], "outputs": [[1, [1, 2, 3], 0.3333333]]}
    assert code.compute_score("code", solution, tests)["acc"] is True


def test_call_based_missing_function_is_an_error():
    tests = {"fn_name": "solve", "inputs": [[1]], "outputs": [1]}
    result = code.compute_score("code", "```python\ndef other(x):\n    return x\n```", tests)
    assert result["errors"] == 1 and result["score"] == 0.0


def test_numpy_arrays_from_parquet_are_accepted():
    tests = {"inputs": np.array(["1 2\n"], dtype=object), "outputs": np.array(["3\n"], dtype=object)}
    assert code.compute_score("code", ADD_SOLUTION, tests)["score"] == 1.0


@pytest.mark.parametrize(
    ("actual", "expected", "match"),
    [
        ("3\n", "3", True),
        ("1 2\n3  4\n\n", "1 2\n3 4", True),
        ("0.3333333333", "0.333333", True),
        ("1e-7", "0.0", True),
        ("0.34", "0.333333", False),
        ("1000000000000000001", "1000000000000000000", False),  # integers are compared exactly
        ("YES", "yes", False),
        ("1 2", "1 2 3", False),
    ],
)
def test_outputs_match(actual, expected, match):
    assert code.outputs_match(actual, expected) is match


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        ("{not json", r"code ground_truth is not valid JSON .*it must be a dict or JSON string"),
        ({"inputs": ["1"]}, r"code ground_truth must be a dict or JSON string .*got \{'inputs': \['1'\]\}"),
        ({"inputs": ["1", "2"], "outputs": ["1"]}, "has 2 inputs but 1 outputs; they must pair up"),
        ({"inputs": [], "outputs": []}, "has no tests"),
        ({"inputs": "1", "outputs": "1"}, r"ground_truth\['inputs'\] must be a list, got str"),
    ],
)
def test_bad_ground_truth_is_an_error(ground_truth, message):
    with pytest.raises(ValueError, match=message):
        code.compute_score("code", ADD_SOLUTION, ground_truth)
