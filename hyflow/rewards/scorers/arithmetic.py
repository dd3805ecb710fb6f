"""Scorer of the built-in arithmetic task (`hyflow.data.tasks.arithmetic`): the integer after the last `####`.

It also scores the calculator task (`hyflow/calculator`, `hyflow.data.tasks.calculator`): there the decoded
response of a multi-turn rollout holds the tool calls and the tool's answers too, but only the model writes
`####`, so the number after the last one is the model's final answer.

Extraction (`method`):

- ``"strict"`` (default): the number right after the LAST ``####`` of the response (spaces, a minus sign and
  thousands commas allowed: ``#### -1,204``). A last ``####`` not followed by a number means no answer.
- ``"flexible"``: as strict; when that finds nothing, the last integer anywhere in the response.

Reward, gsm8k's rule: ``score`` (1.0) when the extracted number equals the ground truth, ``format_score``
(default 0.0; e.g. 0.1 rewards learning the format) when a number was extracted but is wrong, 0.0 when none
was. Comparison is numeric: ``33``, ``33.0`` and ``0033`` all equal ``"33"``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from hyflow.rewards.scorers import rule_scorer

_AFTER_MARK_RE = re.compile(r"\s*(-?\s*[0-9][0-9,]*(?:\.[0-9]+)?)")
_INTEGER_RE = re.compile(r"(?<![\w.])-?[0-9][0-9,]*(?![0-9])")
METHODS = ("strict", "flexible")


def _number(text: str) -> Decimal | None:
    try:
        value = Decimal(text.replace(",", "").replace(" ", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _canonical(value: Decimal) -> str:
    return str(int(value)) if value == value.to_integral_value() else format(value.normalize(), "f")


def extract_answer(solution_str: str, method: str = "strict") -> Decimal | None:
    """The number after the last ``####`` (or, with ``method="flexible"``, the last integer), else None."""
    if method not in METHODS:
        raise ValueError(f"unknown arithmetic extraction method {method!r}; use one of {METHODS}")
    mark = solution_str.rfind("####")
    if mark >= 0:
        match = _AFTER_MARK_RE.match(solution_str, mark + 4)
        if match:
            return _number(match.group(1))
    if method == "flexible":
        integers = _INTEGER_RE.findall(solution_str)
        if integers:
            return _number(integers[-1])
    return None


def _judge(solution_str: str, ground_truth, method: str = "strict", **kwargs) -> tuple[bool | None, str | None]:
    """score = `score` if extract(solution) == int(ground_truth); `format_score` if a number was extracted but
    differs; 0.0 if none. Returns ``{"score": float, "acc": bool, "pred": str | None}`` (`pred` canonical).
    Other keyword arguments are accepted and ignored.
    """
    pred = extract_answer(solution_str, method=method)
    if pred is None:
        return None, None
    truth = _number(str(ground_truth).split("####")[-1].strip())
    return truth is not None and pred == truth, _canonical(pred)


compute_score = rule_scorer(_judge)
