"""GSM8K scorer: the final number of a response against the reference answer (Cobbe et al., arXiv 2110.14168).

Extraction (`method`):

- ``"strict"``: the LAST ``#### <number>`` in the response — the format GSM8K's own solutions use and the
  prompt of verl's preprocessing asks for ("output the final answer after ####").
- ``"flexible"``: the LAST number anywhere in the response (no format required).

Comparison is numeric, on normalised strings: ``$`` signs, thousands commas and a trailing ``.`` are removed and
the number is written canonically with `decimal.Decimal` (``"1,000" == "1000"``, ``"3.0" == "3"``,
``"-0" == "0"``), so no float rounding is involved.

Reward: ``score`` if the extracted answer equals the reference, ``format_score`` if an answer was extracted
but is wrong, ``0.0`` if none was found — verl's rule.

Difference from verl: verl scans only the last 300 characters of the response (a guard for its regex speed).
The regexes here run in linear time, so the whole response is scanned by default; the last match wins either
way, so the two agree unless the answer is followed by more than 300 characters of text, which verl scores 0.
``tail_chars=300`` reproduces verl exactly.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from hyflow.rewards.scorers import require_ground_truth

# `####`, then digits, commas, dots with optional minus and `$` (verl's `#### (-?[0-9.,]+)`, spaces tolerated);
# it stops at the last digit, so a sentence-ending `.` is not part of the number.
_STRICT_RE = re.compile(r"####\s*(-?\s*\$?\s*-?[0-9.,]*[0-9])")
# A number in running text: a minus sign that is not a hyphen (`10-20`), optional `$`, digits with
# thousands groups `1,000,000`, optional decimals.
_NUMBER_RE = re.compile(r"(?:(?<![\w)])-)?\$?(?:(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")

METHODS = ("strict", "flexible")


def normalize_number(text: str) -> str | None:
    """Canonical string of a number written as text, or None when `text` is not a number.

    Removes ``$``, spaces, thousands commas and trailing ``.``, then writes `Decimal(text)` in plain notation
    without trailing zeros: ``"$1,000.50" -> "1000.5"``, ``"3.0" -> "3"``, ``"-0" -> "0"``.
    """
    cleaned = text.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def extract_answer(solution_str: str, method: str = "strict", tail_chars: int | None = None) -> str | None:
    """The answer string of a response: last ``#### <number>`` (strict) or last number (flexible), normalised.

    `tail_chars` limits the search to the last `tail_chars` characters (verl uses 300); None scans everything.
    """
    if method not in METHODS:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; use one of {METHODS}")
    text = solution_str if tail_chars is None else solution_str[-tail_chars:]
    pattern = _STRICT_RE if method == "strict" else _NUMBER_RE
    candidates = [m.group(1) if pattern.groups else m.group(0) for m in pattern.finditer(text)]
    for candidate in reversed(candidates):
        normalized = normalize_number(candidate)
        if normalized is not None:
            return normalized
    return None


def reference_answer(ground_truth) -> str:
    """Normalised reference answer: a number, or a full GSM8K solution ending in ``#### <number>``."""
    text = str(ground_truth)
    if "####" in text:
        extracted = extract_answer(text, method="strict")
        if extracted is not None:
            return extracted
    normalized = normalize_number(text)
    return normalized if normalized is not None else text.strip()


def compute_score(
    data_source,
    solution_str: str,
    ground_truth,
    extra_info=None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    tail_chars: int | None = None,
    **kwargs,
) -> dict:
    """Score one GSM8K response.

    score = `score` if extract(solution) == normalise(ground_truth); `format_score` if an answer was extracted
    but differs; 0.0 if none was extracted. Returns ``{"score": float, "acc": bool, "pred": str | None}``;
    `pred` is the normalised extracted answer (usable for majority voting). Extra keyword arguments (other
    reward_kwargs) are accepted and ignored.
    """
    require_ground_truth(ground_truth, data_source)
    pred = extract_answer(solution_str, method=method, tail_chars=tail_chars)
    if pred is None:
        return {"score": 0.0, "acc": False, "pred": None}
    correct = pred == reference_answer(ground_truth)
    return {"score": float(score if correct else format_score), "acc": correct, "pred": pred}
