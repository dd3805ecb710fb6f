"""Custom reward functions from user files, and normalising what a reward function returns."""

from __future__ import annotations

import functools
import inspect
import math
import re

import numpy as np
import pytest

from hyflow.rewards.custom import load_custom_reward_function, normalize_score

REWARD_FILE = """
from dataclasses import dataclass

@dataclass
class Verdict:
    score: float

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": Verdict(float(solution_str == ground_truth)).score + bonus, "source": data_source}

def length_penalty(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return -len(solution_str) * kwargs.get("scale", 1.0)

THRESHOLD = 0.5
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_loads_the_named_function(reward_file):
    fn = load_custom_reward_function(reward_file)
    assert fn.__name__ == "compute_score"
    assert fn("my_task", "42", "42") == {"score": 1.0, "source": "my_task"}
    other = load_custom_reward_function(str(reward_file), "length_penalty")
    assert other("t", "abc", "x") == -3.0


def test_reward_kwargs_are_bound_with_partial(reward_file):
    fn = load_custom_reward_function(reward_file, reward_kwargs={"bonus": 0.25})
    assert isinstance(fn, functools.partial) and fn.keywords == {"bonus": 0.25}
    assert fn("t", "42", "42")["score"] == 1.25
    flexible = load_custom_reward_function(
        reward_file, "length_penalty", reward_kwargs={"scale": 2.0, "any": 1}
    )
    assert flexible("t", "ab", "x") == -4.0


def test_unknown_reward_kwargs_fail_at_load_time(reward_file):
    message = (
        r"custom_reward_function.reward_kwargs has \['bonsu'\] but compute_score\(\) in .*my_reward.py accepts only "
        r"\['bonus', 'data_source', 'extra_info', 'ground_truth', 'solution_str'\]"
    )
    with pytest.raises(TypeError, match=message):
        load_custom_reward_function(reward_file, reward_kwargs={"bonsu": 1.0})


def test_files_with_the_same_basename_do_not_collide(tmp_path):
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(
            f"def compute_score(*args, **kwargs):\n    return {value}\n"
        )
    first = load_custom_reward_function(tmp_path / "a" / "reward.py")
    second = load_custom_reward_function(tmp_path / "b" / "reward.py")
    assert (first(), second()) == (1.0, 2.0)
    assert first.__module__ != second.__module__


def test_missing_file_names_the_path_and_the_config_key(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(
        FileNotFoundError,
        match=rf"custom_reward_function.path='{re.escape(str(missing))}' names the file .*, which does not exist; fix the path",
    ):
        load_custom_reward_function(missing)


def test_missing_function_lists_what_the_file_defines(reward_file):
    with pytest.raises(AttributeError) as info:
        load_custom_reward_function(reward_file, "compute_scor")
    message = str(info.value)
    assert "custom_reward_function.name='compute_scor': the file " in message
    assert "has no function 'compute_scor'." in message
    assert "Did you mean 'compute_score'?" in message
    assert "Callables defined there: Verdict, compute_score, length_penalty; fix the name" in message
    assert "dataclass" not in message  # imported names are not listed


def test_file_raising_at_import_names_the_file_and_the_exception(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import json\nCONFIG = json.loads('{bad')\n")
    with pytest.raises(
        ImportError,
        match=r"custom_reward_function.path='.*broken.py': importing the file .*broken.py raised JSONDecodeError",
    ) as info:
        load_custom_reward_function(path)
    assert "Expecting property name" in str(info.value)
    assert type(info.value.__cause__).__name__ == "JSONDecodeError"


def test_syntax_error_in_the_file(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text("def compute_score(:\n    return 1\n")
    with pytest.raises(ImportError, match=r"typo.py .*raised SyntaxError"):
        load_custom_reward_function(path)


def test_not_callable_is_a_type_error(reward_file):
    with pytest.raises(
        TypeError,
        match=r"'THRESHOLD' in .*my_reward.py is a float, not a function; custom_reward_function.name",
    ):
        load_custom_reward_function(reward_file, "THRESHOLD")


def test_async_functions_are_returned_as_coroutine_functions(tmp_path):
    path = tmp_path / "async_reward.py"
    path.write_text(
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None, k=1):\n    return k\n"
    )
    fn = load_custom_reward_function(path, reward_kwargs={"k": 3})
    assert inspect.iscoroutinefunction(fn)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (1, (1.0, {})),
        (0.25, (0.25, {})),
        (True, (1.0, {})),
        (np.float32(0.5), (0.5, {})),
        (np.int64(2), (2.0, {})),
        ({"score": 1, "acc": True, "pred": "4"}, (1.0, {"acc": True, "pred": "4"})),
    ],
)
def test_normalize_score(result, expected):
    assert normalize_score(result) == expected


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        (
            "1.0",
            TypeError,
            r"reward function returned '1.0'; expected a number or a dict with a numeric 'score'",
        ),
        (None, TypeError, r"reward function returned None; expected a number"),
        ({"acc": True}, TypeError, r"reward function returned a dict without a 'score' key: \{'acc': True\}"),
        ({"score": "high"}, TypeError, r"returned \{'score': 'high'\}; .*got score of type str"),
        (math.nan, ValueError, r"reward function returned a non-finite score \(nan\)"),
        ({"score": math.inf}, ValueError, r"non-finite score \(inf\) in \{'score': inf\}"),
    ],
)
def test_normalize_score_errors_name_the_value(result, error, message):
    with pytest.raises(error, match=message):
        normalize_score(result)
