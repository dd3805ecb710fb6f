"""Scorer of the shapes task (`hyflow.data.tasks.shapes`): the one word or number after the last `####`.

The answer is the text after the LAST ``####`` up to the end of that line, with spaces, a final ``.`` and the
case ignored: ``#### red``, ``#### Red.``, ``#### 3``. It is well-formed when it is one word of letters (a
colour) or one non-negative integer (a count); anything else (``#### red circle``, ``#### 3 shapes``, no
``####``) is no answer. The ground truth is the colour name (``"red"``) or the count as a decimal string
(``"3"``); counts compare as numbers (``#### 03`` equals ``"3"``).

Reward, the built-in tasks' rule: ``score`` (1.0) when the answer equals the ground truth, ``format_score``
(default 0.0) for a well-formed answer that differs, 0.0 when there is none.
"""

from __future__ import annotations

import re

from hyflow.rewards.scorers import rule_scorer

_ANSWER_RE = re.compile(r"[a-z]+|[0-9]+")


def extract_answer(solution_str: str) -> str | None:
    """The lower-cased word or canonical integer after the last ``####`` when it is well-formed, else None."""
    mark = solution_str.rfind("####")
    if mark < 0:
        return None
    answer = solution_str[mark + 4 :].split("\n", 1)[0].strip().rstrip(".").strip().lower()
    if not _ANSWER_RE.fullmatch(answer):
        return None
    return str(int(answer)) if answer.isdigit() else answer


def _judge(solution_str: str, ground_truth, **kwargs) -> tuple[bool | None, str | None]:
    """score = `score` if extract(solution) == ground truth (a colour, or a count compared as a number);
    `format_score` if a well-formed answer differs; 0.0 if none. Returns ``{"score": float, "acc": bool,
    "pred": str | None}``. Other keyword arguments are ignored.
    """
    pred = extract_answer(solution_str)
    if pred is None:
        return None, None
    truth = str(ground_truth).strip().lower()
    truth = str(int(truth)) if re.fullmatch(r"[0-9]+", truth) else truth
    return pred == truth, pred


compute_score = rule_scorer(_judge)
