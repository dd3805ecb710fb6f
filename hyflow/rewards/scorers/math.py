"""MATH scorer: the last ``\\boxed{...}`` of a response against the reference (Hendrycks et al., arXiv 2103.03874).

1. Extraction: the LAST top-level ``\\boxed{...}`` or ``\\fbox{...}`` (also the brace-less ``\\boxed 5``), with
   brace matching, so nested braces (``\\boxed{\\frac{1}{2}}``) and escaped braces (``\\boxed{\\{1,2\\}}``)
   are kept whole. A box left open (a truncated response) gives no answer.
2. Normalisation (`normalize_answer`, Hendrycks' `strip_string` rules, written afresh): remove line breaks,
   ``\\!`` and thin spaces, ``\\left``/``\\right``, ``\\displaystyle``, degrees (``^\\circ``), ``\\$``, ``\\%``,
   a trailing unit (``5\\text{ cm}`` -> ``5``); unwrap ``\\text{..}``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``;
   ``\\frac12`` -> ``\\frac{1}{2}``; ``\\sqrt2`` -> ``\\sqrt{2}``; ``a/b`` -> ``\\frac{a}{b}``; ``.5`` -> ``0.5``;
   drop a short ``x =`` prefix, spaces, a trailing ``.`` and thousands commas.
3. Equivalence (`is_equiv`): equal normalised strings, or both sides are plain rational numbers (integer,
   decimal, ``\\frac{a}{b}``, ``a/b``) with exactly equal values — this generalises Hendrycks' single
   ``0.5 -> \\frac{1}{2}`` rule (``0.25 == \\frac14``), with exact `fractions.Fraction` arithmetic.
4. Second opinion: the `math_verify` package (Hugging Face Math-Verify, a core dependency of hyflow since
   0.1.0; an install without it falls back to the checks above), its symbolic ``verify(parse(gold), parse(pred))`` is
   also asked, and the answer counts as correct if EITHER check says so (it catches ``\\sqrt{8} == 2\\sqrt{2}``
   and set/interval equalities that strings miss). Math-Verify's timeouts use SIGALRM, which only works in the
   main thread, so off the main thread it runs without a timeout. ``use_math_verify=False`` turns it off,
   ``True`` makes its absence an error.

Reward: ``score`` if correct, ``format_score`` if a box was found but is wrong, ``0.0`` if there is no box.
"""

from __future__ import annotations

import importlib
import re
import sys
import threading
import warnings
from fractions import Fraction
from types import ModuleType

from hyflow.boxed import BOX_RE, extract_boxed_answer, read_box_argument
from hyflow.rewards.scorers import require_ground_truth

_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm)\{([^{}]*)\}")
# A unit after a quantity: `5\text{ cm}`, `3 \mbox{inches}^2`, `12\text{ square units}`.
_TRAILING_UNIT_RE = re.compile(
    r"(?<=[0-9}])\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?\s*$"
)
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SQRT_BARE_RE = re.compile(r"\\sqrt([0-9A-Za-z])")
_SLASH_FRACTION_RE = re.compile(r"(-?[0-9]+)/([0-9]+)")
_THOUSANDS_RE = re.compile(r"-?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")
_NUMBER_RE = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_FRAC_RE = re.compile(r"(-?)\\frac\{(-?[0-9]+)\}\{(-?[0-9]+)\}")

_MATH_VERIFY_MISSING = False
_MATH_VERIFY_WARNED = False
MATH_VERIFY_TIMEOUT_S = 5


def _fix_fracs(s: str) -> str:
    """Brace the arguments of ``\\frac``: ``\\frac12 -> \\frac{1}{2}``, ``\\frac1{72} -> \\frac{1}{72}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        for _ in range(2):  # numerator, then denominator
            if not part:
                break
            if part[0] == "{":
                close = _matching_brace(part)
                if close is None:
                    break
                out += part[: close + 1]
                part = part[close + 1 :]
            else:
                out += "{" + part[0] + "}"
                part = part[1:]
        out += part
    return out


def _matching_brace(s: str) -> int | None:
    """Index of the brace closing the one at ``s[0]``."""
    depth = 0
    for i, char in enumerate(s):
        depth += char == "{"
        depth -= char == "}"
        if depth == 0:
            return i
    return None


def _unwrap_boxes(s: str) -> str:
    """``\\boxed{x} -> x`` for an answer that is itself entirely boxed (a boxed ground truth, nested boxes)."""
    while (match := BOX_RE.match(s)) is not None:
        inner, end = read_box_argument(s, match.end())
        if inner is None or end != len(s):
            break
        s = inner.strip()
    return s


def normalize_answer(answer: str) -> str:
    """Hendrycks-style canonical form of a LaTeX answer (rules in the module docstring)."""
    s = _unwrap_boxes(str(answer).strip())
    s = s.replace("\n", "").replace("\\!", "")
    for spacing in ("\\,", "\\;", "\\:", "\\qquad", "\\quad", "\\displaystyle"):
        s = s.replace(spacing, "")
    s = s.replace("\\\\", "\\")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT_RE.sub("", s)
    s = _DEGREES_RE.sub("", s)
    s = s.replace("\\$", "").replace("$", "")
    s = _TRAILING_UNIT_RE.sub("", s)
    s = _TEXT_WRAPPER_RE.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = _SQRT_BARE_RE.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "").replace("\\ ", "")
    s = _fix_fracs(s)
    if (slash := _SLASH_FRACTION_RE.fullmatch(s)) is not None:
        s = f"\\frac{{{slash.group(1)}}}{{{slash.group(2)}}}"
    s = s.rstrip(".")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    return s


def as_rational(normalized: str) -> Fraction | None:
    """Exact value of a normalised plain number (``3``, ``-0.25``, ``\\frac{1}{4}``, ``-\\frac{1}{4}``), else None."""
    if _NUMBER_RE.fullmatch(normalized):
        return Fraction(normalized)
    frac = _FRAC_RE.fullmatch(normalized)
    if frac is not None and int(frac.group(3)) != 0:
        value = Fraction(int(frac.group(2)), int(frac.group(3)))
        return -value if frac.group(1) else value
    return None


def is_equiv(pred: str | None, reference: str | None) -> bool:
    """Hendrycks string equivalence: normalize(pred) == normalize(reference), or equal rational values."""
    if pred is None or reference is None:
        return False
    a, b = normalize_answer(pred), normalize_answer(reference)
    if a == b:
        return True
    value_a, value_b = as_rational(a), as_rational(b)
    return value_a is not None and value_a == value_b


def _load_math_verify() -> ModuleType | None:
    """The `math_verify` module if importable (a failed import is remembered, not retried)."""
    global _MATH_VERIFY_MISSING
    if "math_verify" in sys.modules:
        return sys.modules["math_verify"]
    if _MATH_VERIFY_MISSING:
        return None
    try:
        return importlib.import_module("math_verify")
    except ImportError:
        _MATH_VERIFY_MISSING = True
        return None


def math_verify_equiv(pred: str, reference: str, module: ModuleType) -> bool:
    """Math-Verify's symbolic check ``verify(parse(\\boxed{reference}), parse(\\boxed{pred}))``; False on error."""
    global _MATH_VERIFY_WARNED
    on_main_thread = threading.current_thread() is threading.main_thread()
    timeout = MATH_VERIFY_TIMEOUT_S if on_main_thread else None
    try:
        gold = module.parse("\\boxed{" + reference + "}", parsing_timeout=timeout)
        answer = module.parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
        return bool(module.verify(gold, answer, timeout_seconds=timeout))
    except Exception as error:  # a bug or version mismatch in the optional checker must not kill training
        if not _MATH_VERIFY_WARNED:
            _MATH_VERIFY_WARNED = True
            warnings.warn(
                f"math_verify failed ({type(error).__name__}: {error}); scoring MATH answers with string "
                "equivalence only. Upgrade with `pip install -U math-verify` or pass use_math_verify=False.",
                stacklevel=2,
            )
        return False


def reference_answer(ground_truth) -> str:
    """The reference answer: the ground-truth string, or the last box of a full worked solution."""
    text = str(ground_truth)
    boxed = extract_boxed_answer(text)
    return boxed if boxed is not None else text


def math_verifier(use_math_verify: bool | None = None) -> ModuleType | None:
    """The `math_verify` module to ask for a second opinion, or None: `use_math_verify` None = when importable,
    True = required (its absence is an ImportError saying how to install it), False = never."""
    if use_math_verify is False:
        return None
    module = _load_math_verify()
    if module is None and use_math_verify:
        raise ImportError(
            "use_math_verify=True but the math_verify package is not installed; "
            "`pip install math-verify` (or hyflow[math]), or pass use_math_verify=None to use it only when present"
        )
    return module


def answers_match(pred: str, reference: str, verifier: ModuleType | None = None) -> bool:
    """Whether the extracted answer `pred` equals `reference`: `is_equiv`, or else (with `verifier`, from
    `math_verifier`) Math-Verify's symbolic check. Shared by the MATH and Geometry3K scorers."""
    return is_equiv(pred, reference) or (verifier is not None and math_verify_equiv(pred, reference, verifier))


def compute_score(
    data_source,
    solution_str: str,
    ground_truth,
    extra_info=None,
    use_math_verify: bool | None = None,
    format_score: float = 0.0,
    score: float = 1.0,
    **kwargs,
) -> dict:
    """Score one MATH response.

    acc = is_equiv(last_box(solution), reference) OR math_verify(reference, last_box(solution));
    score = `score` if acc, `format_score` if a box was found but is wrong, 0.0 without a box.
    `use_math_verify`: None = use Math-Verify when importable, True = require it, False = never.
    Returns ``{"score": float, "acc": bool, "pred": normalised box content or None}``; other keyword
    arguments are accepted and ignored.
    """
    require_ground_truth(ground_truth, data_source)
    verifier = math_verifier(use_math_verify)
    pred = extract_boxed_answer(solution_str)
    if pred is None:
        return {"score": 0.0, "acc": False, "pred": None}
    correct = answers_match(pred, reference_answer(ground_truth), verifier)
    return {
        "score": float(score if correct else format_score),
        "acc": correct,
        "pred": normalize_answer(pred),
    }
