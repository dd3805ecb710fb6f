"""Built-in tasks: determinism, disjoint splits, the row schema, the worked answers, option errors."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyflow.data.io import check_rows, read_rows
from hyflow.data.tasks import TASKS, get_task, make_task, task_options
from hyflow.data.tasks.arithmetic import evaluate_steps
from hyflow.data.tasks.countdown import evaluate_tree, render_tree

SMALL = {"n_train": 60, "n_test": 20}


def _user_text(row: dict) -> str:
    return row["prompt"][-1]["content"]


def _problem(row: dict) -> tuple:
    """What the model sees: the user text and, for a visual task (shapes), the image bytes."""
    return _user_text(row), tuple(image["bytes"] for image in row.get("images", []))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_same_seed_same_rows_other_seed_other_rows(name):
    task = get_task(name)
    assert task.generate(seed=3, **SMALL) == task.generate(seed=3, **SMALL)
    assert task.generate(seed=3, **SMALL)["train"] != task.generate(seed=4, **SMALL)["train"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_disjoint_and_sized(name):
    rows = get_task(name).generate(seed=0, n_train=300, n_test=100)
    assert (len(rows["train"]), len(rows["test"])) == (300, 100)
    train_prompts = {_problem(r) for r in rows["train"]}
    assert len(train_prompts) == 300
    assert not train_prompts & {_problem(r) for r in rows["test"]}


def test_countdown_test_split_holds_no_reordering_of_a_train_instance():
    rows = get_task("countdown").generate(seed=0, n_train=300, n_test=100)

    def key(row):
        return tuple(sorted(row["extra_info"]["numbers"])), row["extra_info"]["target"]

    assert not {key(r) for r in rows["train"]} & {key(r) for r in rows["test"]}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_test_split_does_not_depend_on_n_train(name):
    task = get_task(name)
    assert task.generate(seed=1, n_train=10, n_test=20)["test"] == task.generate(seed=1, n_train=50, n_test=20)["test"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_row_has_the_verl_schema(name):
    task = get_task(name)
    rows = task.generate(seed=0, system_prompt="Be brief.", **SMALL)
    for split, split_rows in rows.items():
        check_rows(split_rows, f"{name}/{split}")
        for index, row in enumerate(split_rows):
            extra_columns = {"calculator": {"agent_name", "tools"}, "shapes": {"images"}}.get(name, set())
            assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"} | extra_columns
            assert row["data_source"] == task.DATA_SOURCE == f"hyflow/{name}"
            assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
            assert row["prompt"][1]["role"] == "user" and len(row["prompt"]) == 2
            assert row["reward_model"]["style"] == "rule"
            assert isinstance(row["reward_model"]["ground_truth"], str)
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == index
            assert row["extra_info"]["question"] == row["prompt"][-1]["content"]
            assert row["extra_info"]["answer"].splitlines()[-1].startswith("#### ")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "json"])
@pytest.mark.parametrize("name", sorted(TASKS))
def test_make_task_writes_what_generate_returns(tmp_path, name, fmt):
    if name == "shapes" and fmt != "parquet":  # image bytes: parquet only, as verl stores them
        with pytest.raises(ValueError, match=r"raw bytes \(the images of multimodal rows\).*write \.parquet"):
            make_task(name, tmp_path, seed=5, fmt=fmt, **SMALL)
        return
    paths = make_task(name, tmp_path, seed=5, fmt=fmt, **SMALL)
    assert paths == {"train": tmp_path / f"train.{fmt}", "test": tmp_path / f"test.{fmt}"}
    expected = get_task(name).generate(seed=5, **SMALL)
    for split, path in paths.items():
        assert read_rows(path) == expected[split]


def test_arithmetic_prompt_truth_and_worked_answer():
    row = get_task("arithmetic").generate(seed=0, n_train=1, n_test=0, n_operands=3, operators="*")["train"][0]
    a, b, c = map(int, re.findall(r"\d+", row["extra_info"]["expression"]))
    assert _user_text(row) == f"What is {a} * {b} * {c}? Put the final answer after '####'."
    assert row["reward_model"]["ground_truth"] == str(a * b * c)
    assert row["extra_info"]["answer"] == f"{a} * {b} * {c} = {a * b} * {c} = {a * b * c}\n#### {a * b * c}"


def test_arithmetic_without_work_answers_only_the_final_line():
    row = get_task("arithmetic").generate(seed=0, n_train=1, n_test=0, show_work=False)["train"][0]
    assert row["extra_info"]["answer"] == f"#### {row['reward_model']['ground_truth']}"


def test_arithmetic_steps_multiply_first_then_left_to_right():
    assert evaluate_steps([12, 7, 3], ["+", "*"]) == ["12 + 21", "33"]
    assert evaluate_steps([2, 3, 4], ["-", "*"]) == ["2 - 12", "-10"]
    assert evaluate_steps([10, 4, 3], ["-", "-"]) == ["6 - 3", "3"]
    assert evaluate_steps([2, 3, 4, 5], ["*", "+", "*"]) == ["6 + 4 * 5", "6 + 20", "26"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 999), min_size=2, max_size=5), st.data())
def test_arithmetic_steps_agree_with_python_precedence(numbers, data):
    ops = data.draw(st.lists(st.sampled_from("+-*"), min_size=len(numbers) - 1, max_size=len(numbers) - 1))
    expression = " ".join([str(numbers[0])] + [f"{op} {n}" for op, n in zip(ops, numbers[1:])])
    assert re.fullmatch(r"[0-9+\-* ]+", expression)  # only digits and operators reach eval
    assert evaluate_steps(numbers, ops)[-1] == str(eval(expression))


def test_countdown_render_keeps_only_needed_parentheses():
    assert render_tree(("*", ("+", 3, 5), 7)) == "(3 + 5) * 7"
    assert render_tree(("+", 3, ("*", 5, 7))) == "3 + 5 * 7"
    assert render_tree(("-", 9, ("-", 5, 2))) == "9 - (5 - 2)"
    assert render_tree(("-", ("-", 9, 5), 2)) == "9 - 5 - 2"
    assert render_tree(("/", 12, ("*", 2, 3))) == "12 / (2 * 3)"
    assert render_tree(("+", 1, ("-", 5, 2))) == "1 + 5 - 2"


def test_countdown_tree_values_are_exact_integers_or_rejected():
    assert evaluate_tree(("/", ("*", 6, 4), 3)) == 8
    assert evaluate_tree(("/", 7, 2)) is None
    assert evaluate_tree(("/", 7, ("-", 2, 2))) is None
    assert evaluate_tree(("*", ("/", 7, 2), 2)) is None  # non-integer intermediate


def _value_of(expression: str) -> Fraction:
    assert re.fullmatch(r"[0-9+\-*/() ]+", expression)
    return Fraction(eval(expression)).limit_denominator()


def test_countdown_instances_are_solvable_with_every_number_once():
    rows = get_task("countdown").generate(seed=2, n_train=200, n_test=0, max_number=12, max_target=50)["train"]
    for row in rows:
        truth = json.loads(row["reward_model"]["ground_truth"])
        expression = row["extra_info"]["answer"].split("#### ")[-1]
        assert set(truth) == {"target", "numbers"}
        assert 3 <= len(truth["numbers"]) <= 4 and all(1 <= n <= 12 for n in truth["numbers"])
        assert 1 <= truth["target"] <= 50
        assert sorted(map(int, re.findall(r"\d+", expression))) == sorted(truth["numbers"])
        assert _value_of(expression) == truth["target"]
        assert f"Using the numbers {' '.join(map(str, truth['numbers']))}, make {truth['target']}." in _user_text(row)


def test_countdown_non_default_rules_are_in_the_prompt_and_the_truth():
    row = get_task("countdown").generate(seed=0, n_train=1, n_test=0, operators="+-", use_all=False)["train"][0]
    truth = json.loads(row["reward_model"]["ground_truth"])
    assert truth["use_all"] is False and truth["operators"] == "+-"
    assert "Use each number at most once, with + - and parentheses." in _user_text(row)


def test_sorting_truth_is_the_sorted_list():
    rows = get_task("sorting").generate(seed=0, n_train=50, n_test=0, min_len=2, max_len=4, min_value=-5, max_value=5)
    for row in rows["train"]:
        numbers = row["extra_info"]["numbers"]
        assert 2 <= len(numbers) <= 4 and all(-5 <= n <= 5 for n in numbers)
        assert row["reward_model"]["ground_truth"] == " ".join(map(str, sorted(numbers)))
        assert _user_text(row).startswith(f"Sort these numbers in ascending order: {' '.join(map(str, numbers))}.")


def test_too_small_problem_space_is_named():
    with pytest.raises(ValueError, match=r"asked for 101 distinct problems but only 100 exist.*raise digits"):
        make_task("arithmetic", "unused", n_train=100, n_test=1, digits=1, operators="+")
    with pytest.raises(ValueError, match=r"only 12 exist.*raise max_len"):
        get_task("sorting").generate(n_train=13, n_test=0, min_len=1, max_len=2, max_value=2)
    with pytest.raises(ValueError, match=r"found only 1 distinct problems of the 2 asked for"):
        get_task("countdown").generate(n_train=2, n_test=0, min_numbers=3, max_numbers=3, max_number=1,
                                       operators="+")


def test_the_whole_small_space_can_be_drawn():
    rows = get_task("arithmetic").generate(n_train=90, n_test=10, digits=1, operators="+")
    assert len({_user_text(r) for r in rows["train"] + rows["test"]}) == 100


def test_unreachable_countdown_targets_are_named():
    with pytest.raises(ValueError, match="no expression over numbers in \\[1, 1\\].*raise max_target"):
        get_task("countdown").generate(n_train=1, n_test=0, max_number=1, max_target=2, operators="+")


def test_make_task_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"unknown task 'sortin'. Did you mean 'sorting'\? Available tasks: "
                                         r"arithmetic, calculator, countdown, shapes, sorting"):
        make_task("sortin", "unused")
    with pytest.raises(ValueError, match=r"task 'arithmetic' has no option 'digit'. Did you mean 'digits'\?"):
        make_task("arithmetic", "unused", digit=3)
    with pytest.raises(ValueError, match=r"option 'digits' takes a int, got 'two'"):
        make_task("arithmetic", "unused", digits="two")
    with pytest.raises(ValueError, match=r"option 'use_all' takes true or false, got 'maybe'"):
        make_task("countdown", "unused", use_all="maybe")
    with pytest.raises(ValueError, match=r"fmt must be one of parquet, jsonl, json, got 'csv'"):
        make_task("sorting", "unused", fmt="csv", n_train=1, n_test=1)


def test_make_task_converts_command_line_strings(tmp_path):
    paths = make_task("countdown", tmp_path, n_train="3", n_test="2", use_all="false", max_numbers="3")
    rows = read_rows(paths["train"])
    assert len(rows) == 3 and len(read_rows(paths["test"])) == 2
    assert all(json.loads(r["reward_model"]["ground_truth"])["use_all"] is False for r in rows)


def test_task_options_list_every_make_keyword():
    options = task_options("arithmetic")
    assert options["n_train"] == 2000 and options["seed"] == 0 and options["fmt"] == "parquet"
    assert options["digits"] == 2 and options["operators"] == "+-"


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("arithmetic", {"operators": "+/"}, r"operators must be distinct characters from '\+-\*'"),
        ("arithmetic", {"operators": "++"}, r"operators must be distinct characters"),
        ("arithmetic", {"n_operands": 1}, r"n_operands must be at least 2, got 1"),
        ("arithmetic", {"digits": 0}, r"digits must be at least 1, got 0"),
        ("countdown", {"min_numbers": 4, "max_numbers": 3}, r"need 2 <= min_numbers <= max_numbers, got 4 and 3"),
        ("countdown", {"max_target": 0}, r"max_number and max_target must be at least 1"),
        ("sorting", {"min_len": 0}, r"need 1 <= min_len <= max_len, got 0 and 6"),
        ("sorting", {"min_value": 5, "max_value": 1}, r"need min_value <= max_value, got 5 and 1"),
        ("sorting", {"n_train": -1}, r"n_train must be a non-negative integer, got -1"),
        ("sorting", {"n_train": 0, "n_test": 0}, r"n_train \+ n_test is 0"),
    ],
)
def test_bad_options_are_named(name, options, message):
    with pytest.raises(ValueError, match=message):
        get_task(name).generate(**options)
