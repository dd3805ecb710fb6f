"""Calculator task: multi-digit arithmetic that a tiny model cannot do in its head but can with a tool.

The prompt is one short line,

    What is 4817 + 2958? Use the calculator. Put the final answer after '####'.

and the row names the agent loop that runs it (`agent_name = "tool_agent"`) and the tool it offers (`tools`:
`CALCULATOR_SCHEMA`, OpenAI function schemas, rendered by the chat template as `Tools: calculator(expression)`).
What the model must do: call the tool in hermes format and end its turn,

    <tool_call>{"name": "calculator", "arguments": {"expression": "4817 + 2958"}}</tool_call><|im_end|>

read the tool's answer (a `tool` message, `7775`), then answer `#### 7775`. The scorer is the arithmetic one:
the number after the last `####` of the response; tool turns never contain `####`, so it is the model's.

The SFT demonstration is the conversation in `extra_info.messages` (train with `messages_key=extra_info.messages`,
`tools_key=tools`). With probability `tool_use_rate` (drawn with the seed, train split only; the test split
always uses the tool) it is the tool trace above: user prompt, assistant tool call (content "", `tool_calls`),
tool answer, assistant `#### value`. Otherwise it is the direct trace: user prompt, assistant `#### value`,
the model "answering in its head". Why `tool_use_rate` < 1 exists: SFT teaches the call format on part of
the traces, while the direct answers it also imitates are usually wrong at 4 digits, so RL sees a clear signal:
rollouts that call the tool score, rollouts that answer directly mostly do not, and the habit of answering
without the tool is what RL has to remove.

Every message dict in `messages` has the same keys (`role`, `content`, `tool_calls`, None where absent) and
every call's `arguments` is the dict `{"expression": ...}`, so parquet infers one struct type for them all and
reads the rows back exactly as written (no null-filled keys appear). `extra_info.answer` holds the final answer
line (`#### value`), the single-turn response of the other built-in tasks.

Operands have exactly `digits` digits (0-9 for `digits=1`); ground truth is the value, computed with Python
ints (usual precedence when `*` is among the operators), as a decimal string. Problems are distinct by
expression, so train and test never share a prompt.
"""

from __future__ import annotations

import copy
from random import Random

from hyflow.data.tasks.arithmetic import draw_expressions, evaluate_steps, render
from hyflow.data.tasks.common import Request, make_row, task_generator

NAME = "calculator"
DATA_SOURCE = "hyflow/calculator"
AGENT_NAME = "tool_agent"
TOOL_NAME = "calculator"
INSTRUCTION = "Use the calculator. Put the final answer after '####'."

CALCULATOR_SCHEMA: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate an arithmetic expression exactly",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    }
]


def tool_call(expression: str) -> dict:
    """The OpenAI-format call of the calculator on `expression` (as an assistant message's `tool_calls` entry)."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}


def _message(role: str, content: str, tool_calls: list[dict] | None = None) -> dict:
    return {"role": role, "content": content, "tool_calls": tool_calls}


def demonstration(prompt: list[dict], expression: str, value: str, use_tool: bool) -> list[dict]:
    """The SFT conversation: the prompt, then the tool trace (call, tool answer, `#### value`) or the direct
    answer `#### value`. Every message has the keys role, content and tool_calls."""
    messages = [_message(m["role"], m["content"]) for m in prompt]
    if use_tool:
        messages += [
            _message("assistant", "", [tool_call(expression)]),
            _message("tool", value),
        ]
    return [*messages, _message("assistant", f"#### {value}")]


@task_generator(INSTRUCTION)
def generate(
    request: Request, *, digits: int = 4, n_operands: int = 2, operators: str = "+-", tool_use_rate: float = 0.5
) -> dict[str, list[dict]]:
    """Rows of both splits in memory: {"train": [...], "test": [...]} (see the module docstring).

    `tool_use_rate` is the fraction of train rows (chosen with the seed) whose demonstration calls the tool;
    the others answer directly. Test rows always call it. Prompts and ground truths do not depend on it.
    """
    if not 0.0 <= tool_use_rate <= 1.0:
        raise ValueError(f"tool_use_rate must be in [0, 1], got {tool_use_rate}")
    problems = draw_expressions(request, n_operands, digits, operators, exact_digits=True)
    tool_rng = Random(request.seed + 1)
    return request.rows(problems, lambda problem, split, i: _row(
        *problem, split, i, request.instruction, request.system_prompt,
        use_tool=split != "train" or tool_rng.random() < tool_use_rate,
    ))


def _row(numbers, ops, split, index, instruction, system_prompt, use_tool) -> dict:
    expression = render(numbers, ops)
    value = evaluate_steps(numbers, ops)[-1]
    content = f"What is {expression}? {instruction}".strip()
    row = make_row(
        DATA_SOURCE, content, ability="arithmetic", ground_truth=value, split=split, index=index,
        extra={"question": content, "answer": f"#### {value}", "expression": expression},
        system_prompt=system_prompt,
    )
    row["extra_info"]["messages"] = demonstration(row["prompt"], expression, value, use_tool)
    row["agent_name"] = AGENT_NAME
    row["tools"] = copy.deepcopy(CALCULATOR_SCHEMA)
    return row
