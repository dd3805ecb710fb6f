"""The calculator task: rows, tool and direct demonstrations, parquet round trip, rendering with the tiny template."""

from __future__ import annotations

import json
import re

import pytest

from hyflow.data.io import check_rows, read_rows
from hyflow.data.tasks import get_task, make_task, task_options
from hyflow.data.tasks.calculator import AGENT_NAME, CALCULATOR_SCHEMA, DATA_SOURCE, INSTRUCTION
from hyflow.rewards.registry import default_compute_score

calculator = get_task("calculator")


def _uses_tool(row: dict) -> bool:
    return any(m["tool_calls"] for m in row["extra_info"]["messages"])


def test_registered_with_its_options():
    assert calculator.NAME == "calculator" and DATA_SOURCE == "hyflow/calculator"
    options = task_options("calculator")
    assert {k: options[k] for k in ("digits", "n_operands", "operators", "tool_use_rate", "instruction",
                                    "system_prompt")} == {
        "digits": 4, "n_operands": 2, "operators": "+-", "tool_use_rate": 0.5, "instruction": INSTRUCTION,
        "system_prompt": None,
    }
    assert INSTRUCTION == "Use the calculator. Put the final answer after '####'."


def test_row_schema_prompt_truth_and_tool_columns():
    rows = calculator.generate(seed=0, n_train=50, n_test=10)
    for split, split_rows in rows.items():
        check_rows(split_rows, f"calculator/{split}")
        for index, row in enumerate(split_rows):
            expression = row["extra_info"]["expression"]
            a, op, b = expression.split(" ")
            assert len(a) == len(b) == 4 and op in "+-"
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            question = f"What is {expression}? Use the calculator. Put the final answer after '####'."
            assert row["prompt"] == [{"role": "user", "content": question}]
            assert row["data_source"] == DATA_SOURCE and row["ability"] == "arithmetic"
            assert row["reward_model"] == {"style": "rule", "ground_truth": str(value)}
            assert row["agent_name"] == AGENT_NAME == "tool_agent"
            assert row["tools"] == CALCULATOR_SCHEMA
            assert row["tools"] is not CALCULATOR_SCHEMA
            extra = row["extra_info"]
            assert (extra["split"], extra["index"], extra["question"]) == (split, index, question)
            assert extra["answer"] == f"#### {value}"


def test_schema_constant():
    assert CALCULATOR_SCHEMA == [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression exactly",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                       "required": ["expression"]}}}]


def test_tool_and_direct_demonstrations():
    rows = calculator.generate(seed=0, n_train=40, n_test=0)["train"]
    tool_row = next(r for r in rows if _uses_tool(r))
    direct_row = next(r for r in rows if not _uses_tool(r))
    for row in (tool_row, direct_row):
        for message in row["extra_info"]["messages"]:
            assert set(message) == {"role", "content", "tool_calls"}
    user = {"role": "user", "content": tool_row["prompt"][0]["content"], "tool_calls": None}
    expression, value = tool_row["extra_info"]["expression"], tool_row["reward_model"]["ground_truth"]
    assert tool_row["extra_info"]["messages"] == [
        user,
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}},
        ]},
        {"role": "tool", "content": value, "tool_calls": None},
        {"role": "assistant", "content": f"#### {value}", "tool_calls": None},
    ]
    assert direct_row["extra_info"]["messages"] == [
        {"role": "user", "content": direct_row["prompt"][0]["content"], "tool_calls": None},
        {"role": "assistant", "content": f"#### {direct_row['reward_model']['ground_truth']}", "tool_calls": None},
    ]


def test_tool_use_rate_applies_to_train_only():
    rows = calculator.generate(seed=0, n_train=400, n_test=100)
    assert all(_uses_tool(r) for r in rows["test"])
    rate = sum(_uses_tool(r) for r in rows["train"]) / 400
    assert 0.4 < rate < 0.6
    none = calculator.generate(seed=0, n_train=50, n_test=10, tool_use_rate=0.0)
    every = calculator.generate(seed=0, n_train=50, n_test=10, tool_use_rate=1.0)
    assert not any(_uses_tool(r) for r in none["train"]) and all(_uses_tool(r) for r in every["train"])
    assert all(_uses_tool(r) for r in none["test"])

    def strip(split_rows):  # everything but the demonstration
        return [{**r, "extra_info": {k: v for k, v in r["extra_info"].items() if k != "messages"}} for r in split_rows]

    half = calculator.generate(seed=0, n_train=50, n_test=10)
    assert strip(none["train"]) == strip(every["train"]) == strip(half["train"])
    assert none["test"] == every["test"] == half["test"]


def test_options_digits_operators_and_system_prompt():
    rows = calculator.generate(seed=1, n_train=100, n_test=0, digits=3, n_operands=3, operators="+-*",
                               system_prompt="Be brief.", instruction="Go.")["train"]
    for row in rows:
        expression = row["extra_info"]["expression"]
        assert re.fullmatch(r"[0-9]{3} [-+*] [0-9]{3} [-+*] [0-9]{3}", expression)
        assert row["reward_model"]["ground_truth"] == str(eval(expression))
        assert row["prompt"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": f"What is {expression}? Go."}]
        assert row["extra_info"]["messages"][0] == {"role": "system", "content": "Be brief.", "tool_calls": None}
    assert any("*" in r["extra_info"]["expression"] for r in rows)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tool_use_rate": 1.5}, r"tool_use_rate must be in \[0, 1\], got 1.5"),
        ({"digits": 0}, r"digits must be at least 1, got 0"),
        ({"n_operands": 1}, r"n_operands must be at least 2, got 1"),
        ({"operators": "+/"}, r"operators must be distinct characters from '\+-\*'"),
        ({"digits": 1, "operators": "+", "n_train": 100, "n_test": 1}, r"only 100 exist"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        calculator.generate(**options)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_files_round_trip_exactly_and_render_the_exact_call(tmp_path, tiny_tokenizer, fmt):
    paths = make_task("calculator", tmp_path, n_train=20, n_test=5, seed=2, fmt=fmt, system_prompt="Be brief.")
    expected = calculator.generate(n_train=20, n_test=5, seed=2, system_prompt="Be brief.")
    for split, path in paths.items():
        rows = read_rows(path)
        assert rows == expected[split]  # no null-filled keys from parquet's struct unification
        for row in rows:
            messages = row["extra_info"]["messages"]
            calls = [c for m in messages if m["tool_calls"] for c in m["tool_calls"]]
            for call in calls:
                assert call["function"]["arguments"] == {"expression": row["extra_info"]["expression"]}
            text = tiny_tokenizer.apply_chat_template(messages, tools=row["tools"], tokenize=False)
            value = row["reward_model"]["ground_truth"]
            call_json = json.dumps({"name": "calculator", "arguments": {"expression": row["extra_info"]["expression"]}})
            head = ("<|im_start|>system\nBe brief.\n\nTools: calculator(expression)<|im_end|>\n"
                    f"<|im_start|>user\n{row['prompt'][-1]['content']}<|im_end|>\n")
            if calls:
                assert text == (head + f"<|im_start|>assistant\n<tool_call>{call_json}</tool_call><|im_end|>\n"
                                f"<|im_start|>tool\n{value}<|im_end|>\n<|im_start|>assistant\n#### {value}<|im_end|>\n")
            else:
                assert text == head + f"<|im_start|>assistant\n#### {value}<|im_end|>\n"


def test_demonstrations_score_one():
    rows = calculator.generate(seed=0, n_train=30, n_test=5)
    for row in rows["train"] + rows["test"]:
        messages = row["extra_info"]["messages"]
        # what a multi-turn rollout decodes to: every turn after the prompt, tool answers included
        response = "\n".join(
            m["content"] + "".join(json.dumps(c["function"]) for c in m["tool_calls"] or []) for m in messages[1:]
        )
        assert default_compute_score(row["data_source"], response, row["reward_model"]["ground_truth"])["acc"]
        assert default_compute_score(row["data_source"], row["prompt"][-1]["content"],
                                     row["reward_model"]["ground_truth"])["score"] == 0.0
