"""Countdown task: combine the given numbers with + - * / and parentheses to reach a target.

    Using the numbers 7 3 12 4, make 33. Use each number exactly once, with + - * / and parentheses.
    Put the expression after '####'.

Every instance is solvable by construction: draw 3-4 numbers in [1, max_number], combine a random permutation
of them with a random binary expression tree and random operators, and keep the tree only when every
intermediate result is an integer (no division remainder, no division by zero) and the value is a target in
[1, max_target]. With `use_all=True` (default, as in TinyZero) every number must be used exactly once; with
`use_all=False` each at most once. The constructed expression is stored as the worked answer:

    12 * 3 - 7 + 4 = 33
    #### 12 * 3 - 7 + 4

Ground truth is the JSON string `{"target": 33, "numbers": [7, 3, 12, 4]}`, plus `"use_all": false` and
`"operators": "+-"` only when they differ from the defaults. Problems are distinct by (sorted numbers, target),
so the test split holds no instance that is a reordering of a train instance.
"""

from __future__ import annotations

import json
from fractions import Fraction
from random import Random

from hyflow.data.tasks.common import Request, check_sizes, make_row, parse_operators, task_generator

NAME = "countdown"
DATA_SOURCE = "hyflow/countdown"
OPERATORS = "+-*/"
INSTRUCTION = "Put the expression after '####'."
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}

# An expression tree: an int leaf, or (op, left, right).
Tree = int | tuple


def evaluate_tree(tree: Tree) -> Fraction | None:
    """Exact value of the tree, or None when a division is by zero or any intermediate is not an integer."""
    if isinstance(tree, int):
        return Fraction(tree)
    op, left, right = tree
    a, b = evaluate_tree(left), evaluate_tree(right)
    if a is None or b is None or (op == "/" and b == 0):
        return None
    value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
    return value if value.denominator == 1 else None


def render_tree(tree: Tree, parent_op: str | None = None, right_child: bool = False) -> str:
    """Infix text with only the parentheses precedence needs: `('*', ('+', 3, 5), 7)` -> `'(3 + 5) * 7'`."""
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    text = f"{render_tree(left, op)} {op} {render_tree(right, op, right_child=True)}"
    if parent_op is not None:
        looser = _PRECEDENCE[op] < _PRECEDENCE[parent_op]
        regroups = right_child and _PRECEDENCE[op] == _PRECEDENCE[parent_op] and parent_op in "-/"
        if looser or regroups:
            return f"({text})"
    return text


def _random_tree(rng: Random, numbers: list[int], ops: tuple[str, ...]) -> Tree:
    if len(numbers) == 1:
        return numbers[0]
    cut = rng.randint(1, len(numbers) - 1)
    return (rng.choice(ops), _random_tree(rng, numbers[:cut], ops), _random_tree(rng, numbers[cut:], ops))


@task_generator(INSTRUCTION)
def generate(
    request: Request,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 20,
    max_target: int = 100,
    operators: str = OPERATORS,
    use_all: bool = True,
) -> dict[str, list[dict]]:
    """Rows of both splits in memory: {"train": [...], "test": [...]} (see the module docstring)."""
    check_sizes(request.n_train, request.n_test)
    ops = parse_operators(operators, OPERATORS)
    if not 2 <= min_numbers <= max_numbers:
        raise ValueError(f"need 2 <= min_numbers <= max_numbers, got {min_numbers} and {max_numbers}")
    if max_number < 1 or max_target < 1:
        raise ValueError(f"max_number and max_target must be at least 1, got {max_number} and {max_target}")

    def draw(rng: Random) -> tuple[list[int], int, Tree]:
        for _ in range(1000):
            numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
            for _ in range(20):
                order = rng.sample(numbers, len(numbers))
                tree = _random_tree(rng, order, ops)
                value = evaluate_tree(tree)
                if value is not None and 1 <= value <= max_target:
                    return numbers, int(value), tree
        raise ValueError(
            f"no expression over numbers in [1, {max_number}] with operators {''.join(ops)!r} reaches a target "
            f"in [1, {max_target}] after 20,000 tries; raise max_target or max_number, or allow more operators"
        )

    problems = request.draw(
        draw, key=lambda p: (tuple(sorted(p[0])), p[1]),
        fix="raise max_number, max_target or max_numbers, or lower n_train/n_test",
    )
    rule = "exactly once" if use_all else "at most once"
    rules = f"Use each number {rule}, with {' '.join(ops)} and parentheses. {request.instruction}".strip()
    extra_truth: dict = {}  # only rules that differ from the defaults go into the ground truth
    if not use_all:
        extra_truth["use_all"] = False
    if set(ops) != set(OPERATORS):
        extra_truth["operators"] = "".join(ops)
    return request.rows(problems, lambda problem, split, i: _row(
        *problem, split, i, rules, extra_truth, request.system_prompt,
    ))


def _row(numbers, target, tree, split, index, rules, extra_truth, system_prompt) -> dict:
    expression = render_tree(tree)
    content = f"Using the numbers {' '.join(map(str, numbers))}, make {target}. {rules}"
    truth = json.dumps({"target": target, "numbers": numbers, **extra_truth})
    return make_row(
        DATA_SOURCE, content, ability="arithmetic", ground_truth=truth, split=split, index=index,
        extra={
            "question": content,
            "answer": f"{expression} = {target}\n#### {expression}",
            "numbers": numbers,
            "target": target,
        },
        system_prompt=system_prompt,
    )
