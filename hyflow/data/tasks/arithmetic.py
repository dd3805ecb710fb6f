"""Arithmetic task: evaluate an integer expression such as `12 + 7 * 3` (usual precedence, no parentheses).

Made for a tiny model trained from scratch: the prompt is one short line,

    What is 12 + 7 * 3? Put the final answer after '####'.

and the worked answer stored for SFT (`extra_info.answer`, verl's SFT `response_dict_keys=['answer']`) reduces
the expression one operation at a time — first the leftmost `*`, then `+`/`-` left to right — and ends with
the answer line the scorer reads:

    12 + 7 * 3 = 12 + 21 = 33
    #### 33

Operands are uniform in [0, 10^digits - 1]; ground truth is the value as a decimal integer string.
Problems are distinct by expression, so train and test never share a prompt.
"""

from __future__ import annotations

from random import Random

from hyflow.data.tasks.common import Request, check_sizes, make_row, parse_operators, task_generator

NAME = "arithmetic"
DATA_SOURCE = "hyflow/arithmetic"
INSTRUCTION = "Put the final answer after '####'."
OPERATORS = "+-*"


def evaluate_steps(numbers: list[int], ops: list[str]) -> list[str]:
    """The expression after each single reduction: leftmost `*` first, then `+`/`-` left to right.

    The last entry is the value; an expression with k operators gives k entries.
    """
    numbers, ops = list(numbers), list(ops)
    states = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b, op = numbers[i], numbers[i + 1], ops[i]
        numbers[i : i + 2] = [a * b if op == "*" else a + b if op == "+" else a - b]
        del ops[i]
        states.append(render(numbers, ops))
    return states


def render(numbers: list[int], ops: list[str]) -> str:
    """`[12, 7, 3], ['+', '*']` -> `'12 + 7 * 3'`."""
    parts = [str(numbers[0])]
    for op, n in zip(ops, numbers[1:]):
        parts += [op, str(n)]
    return " ".join(parts)


def draw_expressions(
    request: Request, n_operands: int, digits: int, operators: str, *, exact_digits: bool = False
) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """The request's distinct problems `(numbers, ops)`: `n_operands` operands uniform in [0, 10^digits - 1]
    (with `exact_digits`, of exactly `digits` digits: [10^(digits-1), 10^digits - 1], [0, 9] for one digit) and
    operators drawn from `operators` (a subset of `OPERATORS`). The split sizes and the options are checked
    first. Shared by the arithmetic and calculator tasks."""
    check_sizes(request.n_train, request.n_test)
    ops_allowed = parse_operators(operators, OPERATORS)
    if n_operands < 2:
        raise ValueError(f"n_operands must be at least 2, got {n_operands}")
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    low, high = (10 ** (digits - 1) if exact_digits and digits > 1 else 0), 10**digits - 1

    def draw(rng: Random) -> tuple[tuple[int, ...], tuple[str, ...]]:
        numbers = tuple(rng.randint(low, high) for _ in range(n_operands))
        return numbers, tuple(rng.choice(ops_allowed) for _ in range(n_operands - 1))

    capacity = (high - low + 1) ** n_operands * len(ops_allowed) ** (n_operands - 1)
    return request.draw(
        draw, key=lambda p: p, capacity=capacity,
        fix="raise digits, n_operands or the number of operators, or lower n_train/n_test",
    )


@task_generator(INSTRUCTION)
def generate(
    request: Request,
    *,
    n_operands: int = 2,
    digits: int = 2,
    operators: str = "+-",
    show_work: bool = True,
    answer_line_rate: float = 1.0,
    preference_pairs: bool = False,
) -> dict[str, list[dict]]:
    """Rows of both splits in memory: {"train": [...], "test": [...]} (see the module docstring).

    `preference_pairs` adds TRL's preference columns for `hyflow dpo`: `chosen` = the worked answer, `rejected` =
    the same work ending in a wrong value (the true one plus a nonzero offset in [-3, 3], drawn with the seed), both
    with the answer line.

    `answer_line_rate` < 1 makes the SFT demonstrations of the train split imperfect: that fraction of worked
    answers (chosen with the seed) ends with the `#### value` line the scorer reads, the rest stop after the
    work. The prompts and ground truths are unchanged, and the test split always has the line.
    """
    if not 0.0 <= answer_line_rate <= 1.0:
        raise ValueError(f"answer_line_rate must be in [0, 1], got {answer_line_rate}")
    if answer_line_rate < 1.0 and not show_work:
        raise ValueError("answer_line_rate < 1 needs show_work=True (an answer without work or answer line is empty)")
    line_rng, wrong_rng = Random(request.seed + 1), Random(request.seed + 2)
    problems = draw_expressions(request, n_operands, digits, operators)

    def row(problem, split, i):
        out = _row(*problem, split, i, show_work, request.instruction, request.system_prompt,
                   answer_line=split != "train" or line_rng.random() < answer_line_rate)
        if preference_pairs:
            out.update(_pair(*problem, show_work, wrong_rng.choice((-3, -2, -1, 1, 2, 3))))
        return out

    return request.rows(problems, row)


def _pair(numbers, ops, show_work: bool, offset: int) -> dict:
    """TRL's preference columns: the worked answer and the same work ending in the value + `offset`."""
    expression, steps = render(numbers, ops), evaluate_steps(numbers, ops)
    wrong = str(int(steps[-1]) + offset)

    def answer(last: str) -> str:
        work = " = ".join([expression, *steps[:-1], last]) if show_work else ""
        return f"{work}\n#### {last}" if work else f"#### {last}"

    return {"chosen": answer(steps[-1]), "rejected": answer(wrong)}


def _row(numbers, ops, split, index, show_work, instruction, system_prompt, answer_line=True) -> dict:
    expression = render(numbers, ops)
    steps = evaluate_steps(numbers, ops)
    value = steps[-1]
    work = " = ".join([expression, *steps]) if show_work else ""
    answer = f"{work}\n#### {value}" if work and answer_line else (work or f"#### {value}")
    content = f"What is {expression}? {instruction}".strip()
    return make_row(
        DATA_SOURCE, content, ability="arithmetic", ground_truth=value, split=split, index=index,
        extra={"question": content, "answer": answer, "expression": expression},
        system_prompt=system_prompt,
    )
