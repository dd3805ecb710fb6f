"""Scorer of the sorting task (`hyflow.data.tasks.sorting`): the list after the last `####`.

The answer is the text after the LAST ``####`` up to the end of that line. It is well-formed when it holds at
least one integer and nothing else but separators (spaces, commas, square brackets, a final ``.``):
``#### 1 3 5``, ``#### [1, 3, 5]``. The ground truth is the sorted list as ``"1 3 5"`` (or a list of ints).

Reward: ``score`` (1.0) when the answer lists exactly the ground-truth integers in order; ``format_score``
(default 0.0) for a well-formed answer that differs (wrong order, missing or extra values); 0.0 when there is
no ``####`` or the text after it is not a list of integers.
"""

from __future__ import annotations

import re

from hyflow.rewards.scorers import rule_scorer

_INTEGER_RE = re.compile(r"-?[0-9]+")
_SEPARATORS_RE = re.compile(r"[\s,\[\]]*")


def extract_list(solution_str: str) -> list[int] | None:
    """Integers after the last ``####`` when that line is a well-formed list, else None."""
    mark = solution_str.rfind("####")
    if mark < 0:
        return None
    line = solution_str[mark + 4 :].split("\n", 1)[0].strip().rstrip(".")
    values = _INTEGER_RE.findall(line)
    if not values or _SEPARATORS_RE.fullmatch(_INTEGER_RE.sub(" ", line)) is None:
        return None
    return [int(v) for v in values]


def _judge(solution_str: str, ground_truth, **kwargs) -> tuple[bool | None, str | None]:
    """score = `score` if extract(solution) == ground-truth list; `format_score` if a well-formed list differs;
    0.0 if none. Returns ``{"score": float, "acc": bool, "pred": str | None}`` with `pred` as ``"1 3 5"``.
    Other keyword arguments are ignored.
    """
    pred = extract_list(solution_str)
    if pred is None:
        return None, None
    truth = ground_truth if isinstance(ground_truth, list) else [int(v) for v in _INTEGER_RE.findall(str(ground_truth))]
    return pred == [int(v) for v in truth], " ".join(map(str, pred))


compute_score = rule_scorer(_judge)
