"""Scorer of the countdown task (`hyflow.data.tasks.countdown`; TinyZero's `countdown` data too).

The answer is the expression after the LAST ``####`` (to the end of that line), or else the last
``<answer>...</answer>`` (TinyZero's format). A trailing ``= 33`` is dropped. The expression is never run:
it is parsed with `ast` and only integer literals, ``+ - * /`` (binary), unary ``-``/``+`` and parentheses
are accepted — a name, call, attribute, string, float, power or anything else makes it invalid. Its value is
computed exactly with `fractions.Fraction`, and only after the number check below, so the work is bounded.

Rules: the integer literals used must be the given numbers, each exactly once (``use_all``, the default and
TinyZero's rule) or each at most once (ground truth ``"use_all": false``); when the ground truth names
``operators``, only those may appear. Correct = rules kept and |value - target| < 1e-6.

Reward: ``score`` (1.0) correct; ``format_score`` (default 0.0) for a valid expression that breaks a rule or
misses the target (division by zero included); 0.0 for no answer or an invalid one.
Ground truth: ``{"target": int, "numbers": [int, ...]}`` as a JSON string or a dict (TinyZero's parquet).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction

from hyflow.rewards.scorers import rule_scorer

MAX_EXPRESSION_CHARS = 200
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINARY_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_UNARY_OPS = (ast.USub, ast.UAdd)


def extract_expression(solution_str: str) -> str | None:
    """The answer expression: text after the last ``####`` to the end of its line, else the last
    ``<answer>...</answer>``; a trailing ``= ...``, backticks, ``$`` and a final ``.`` are removed."""
    mark = solution_str.rfind("####")
    if mark >= 0:
        text = solution_str[mark + 4 :].split("\n", 1)[0]
    else:
        tags = _ANSWER_TAG_RE.findall(solution_str)
        if not tags:
            return None
        text = tags[-1]
    text = text.split("=", 1)[0].replace("`", "").replace("$", "").strip().rstrip(".").strip()
    return text or None


def parse_expression(expression: str) -> tuple[ast.expr, list[int], set[str]] | None:
    """(tree, integer literals in order, binary operators used) of a safe arithmetic expression, else None."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    numbers: list[int] = []
    ops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
            ops.add(_BINARY_OPS[type(node.op)])
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY_OPS):
            pass
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
        elif not isinstance(node, ast.operator | ast.unaryop):
            return None
    return tree, numbers, ops


def evaluate(node: ast.expr) -> Fraction | None:
    """Exact value of a tree accepted by `parse_expression`; None on division by zero."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        value = evaluate(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    left, right = evaluate(node.left), evaluate(node.right)
    if left is None or right is None:
        return None
    op = _BINARY_OPS[type(node.op)]
    if op == "/":
        return None if right == 0 else left / right
    return left + right if op == "+" else left - right if op == "-" else left * right


def _ground_truth(ground_truth) -> tuple[int, list[int], bool, str | None]:
    truth = json.loads(ground_truth) if isinstance(ground_truth, str | bytes) else ground_truth
    operators = truth.get("operators")
    return int(truth["target"]), [int(n) for n in truth["numbers"]], bool(truth.get("use_all", True)), operators


def _judge(solution_str: str, ground_truth, **kwargs) -> tuple[bool | None, str | None]:
    """score = `score` if the expression keeps the rules and evaluates to the target (within 1e-6);
    `format_score` if it is a valid expression otherwise; 0.0 if missing or invalid.
    Returns ``{"score": float, "acc": bool, "pred": str | None}``; other keyword arguments are ignored.
    """
    expression = extract_expression(solution_str)
    parsed = parse_expression(expression) if expression is not None else None
    if parsed is None:
        return None, expression
    tree, used, ops = parsed
    target, numbers, use_all, operators = _ground_truth(ground_truth)
    used_count, given_count = Counter(used), Counter(numbers)
    numbers_ok = used_count == given_count if use_all else all(used_count[n] <= given_count[n] for n in used_count)
    ops_ok = operators is None or ops <= set(operators)
    value = evaluate(tree) if numbers_ok and ops_ok else None
    return value is not None and abs(value - target) < 1e-6, expression


compute_score = rule_scorer(_judge)
