"""Scorer of `hyflow data reasoning-gym` rows (data_source "reasoning_gym"): the task's own checker.

The answer is the text after the response's last "####" (its first line, stripped); the row's `extra_info.entry`
(the generated problem, JSON) names the task, whose `score_answer(answer, entry)` gives the score (1.0 right, 0.0
wrong, partial credit where the task defines it). No "####": score 0 and `pred` None.
"""

from __future__ import annotations

import json
from typing import Any


def extract_answer(solution_str: str) -> str | None:
    mark = solution_str.rfind("####")
    if mark < 0:
        return None
    lines = solution_str[mark + 4:].strip().splitlines()
    return lines[0].strip() if lines else ""


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs: Any) -> dict[str, Any]:
    entry_text = (extra_info or {}).get("entry")
    if not entry_text:
        raise ValueError("a reasoning_gym row needs extra_info.entry (the generated problem as JSON); write the "
                         "data with hyflow data reasoning-gym")
    entry = json.loads(entry_text) if isinstance(entry_text, str) else dict(entry_text)
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": False, "pred": None}
    import reasoning_gym

    score = float(reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])(answer, entry))
    return {"score": score, "acc": score == 1.0, "pred": answer}
