"""The `\\boxed{}` answer parser (MATH's convention: the final answer in the last top-level `\\boxed{...}` or
`\\fbox{...}`), shared by the MATH / GSM8K-style data preprocessors (`hyflow.data.preprocess`, which take a row's
reference answer with it) and the math scorer (`hyflow.rewards.scorers.math`, which takes the model's with it), so
rows and scoring agree. A leaf: it imports nothing of hyflow.
"""

from __future__ import annotations

import re

__all__ = ["BOX_RE", "extract_boxed_answer", "read_box_argument"]

BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def read_box_argument(text: str, start: int) -> tuple[str | None, int]:
    """Argument of a box command whose name ends at `start`, and the index just past it.

    ``{...}`` with brace matching, or (``\\boxed 5``) the token after a space. ``(None, -1)`` when the brace
    is never closed; ``(None, start)`` when there is no argument.
    """
    i = start
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        j = i
        while j < len(text):
            char = text[j]
            if char == "\\":
                j += 2  # an escaped character (`\{`, `\}`, `\\`) never opens or closes a group
                continue
            if char == "{":
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j], j + 1
            j += 1
        return None, -1
    token = re.match(r"[^\s$]+", text[i:]) if i > start else None
    return (token.group(0), i + token.end()) if token else (None, start)


def extract_boxed_answer(text: str) -> str | None:
    """Content of the LAST top-level ``\\boxed{}``/``\\fbox{}`` in `text`; None if there is none or it is unclosed."""
    answer = None
    pos = 0
    while (match := BOX_RE.search(text, pos)) is not None:
        content, end = read_box_argument(text, match.end())
        if end == -1:
            return None
        if content is not None:
            answer = content
        pos = max(end, match.end())
    return answer
