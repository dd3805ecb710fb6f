"""Geometry3K scorer (`hiyouga/geometry3k`, Lu et al., arXiv 2105.04165), as verl's `reward_score/geo3k.py`.

The rows come from `hyflow data geo3k` (`hyflow.data.preprocess.preprocess_geo3k`), whose instruction asks for
the reasoning inside ``<think> </think>`` and the final answer in ``\\boxed{}``. The reward has two parts:

- format: 1.0 when the whole response is ``<think>...</think>`` followed by text holding a ``\\boxed{...}``
  (verl's ``re.fullmatch(r"<think>.*</think>.*\\boxed\\{.*\\}.*", response, re.DOTALL)``: the response must
  START with ``<think>``), else 0.0;
- accuracy: 1.0 when the last ``\\boxed{}`` of the response equals the ground truth, else 0.0. The extraction
  and the equivalence are the MATH scorer's (`hyflow.rewards.scorers.math`: `extract_boxed_answer`,
  `answers_match` — Hendrycks normalisation, exact rational values, Math-Verify as a second opinion) where verl
  calls mathruler's `extract_boxed_content` and `grade_answer`; both accept the same plain answers (``3``,
  ``2\\sqrt{3}``, ``\\frac{40}{3}``, ``60^\\circ``). The MATH extraction also reads ``\\fbox{}`` and the brace-less
  ``\\boxed 5``, which mathruler does not.

    score = (1 - format_score) * accuracy + format_score * format        (verl's weighting; format_score = 0.1)

so a right answer in the right format scores 1.0, a right answer without the ``<think>`` block 0.9, a wrong or
missing answer in the right format 0.1 and anything else 0.0. Note that `format_score` here is verl's weight of
the format part, not the reward of a wrong answer as in the other rule scorers. ``use_boxed=False`` compares the
whole response with the ground truth instead of the box (verl's option).
"""

from __future__ import annotations

import re

from hyflow.rewards.scorers import require_ground_truth
from hyflow.rewards.scorers.math import (
    answers_match,
    extract_boxed_answer,
    math_verifier,
    normalize_answer,
    reference_answer,
)

DATA_SOURCE = "hiyouga/geometry3k"
FORMAT_SCORE = 0.1  # verl's default weight of the format reward
_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    """1.0 when the response is ``<think>...</think>`` then text with a ``\\boxed{...}`` (verl's rule), else 0.0."""
    return 1.0 if _FORMAT_RE.fullmatch(solution_str) else 0.0


def compute_score(
    data_source,
    solution_str: str,
    ground_truth,
    extra_info=None,
    format_score: float = FORMAT_SCORE,
    use_boxed: bool = True,
    use_math_verify: bool | None = None,
    **kwargs,
) -> dict:
    """Score one Geometry3K response: ``(1 - format_score) * accuracy + format_score * format``.

    accuracy = the last ``\\boxed{}`` (the whole response with ``use_boxed=False``) matches the ground truth;
    format = `format_reward`. `use_math_verify` as in the MATH scorer (None = when installed).
    Returns ``{"score": float, "acc": bool, "format": bool, "pred": normalised answer or None}``; other
    keyword arguments are accepted and ignored.
    """
    require_ground_truth(ground_truth, data_source)
    if not 0.0 <= format_score <= 1.0:
        raise ValueError(f"format_score is the weight of the format reward, in [0, 1]; got {format_score!r}")
    verifier = math_verifier(use_math_verify)
    pred = extract_boxed_answer(solution_str) if use_boxed else solution_str.strip()
    correct = pred is not None and answers_match(pred, reference_answer(ground_truth), verifier)
    formatted = format_reward(solution_str)
    return {
        "score": (1.0 - format_score) * float(correct) + format_score * formatted,
        "acc": correct,
        "format": formatted == 1.0,
        "pred": None if pred is None else normalize_answer(pred),
    }
