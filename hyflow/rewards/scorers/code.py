"""Code scorer: run the response's Python program against the task's tests in the local sandbox.

Data sources: ``codecontests``, ``apps``, ``codeforces``, ``taco`` (verl's names for its PRIME-style code
data) and the generic ``code``. LiveCodeBench is not registered: its tests use another format (a list of
``{"input", "output", "testtype"}`` with string-encoded call arguments); convert it to the format below.

Tests (``ground_truth``: a dict, or its JSON string, as in verl/PRIME/TACO data):

- stdin/stdout: ``{"inputs": [stdin_1, ...], "outputs": [stdout_1, ...]}``. The program reads stdin and must
  print the expected output. Outputs match when their whitespace-separated tokens are equal, a pair of
  tokens at least one of which is a decimal/exponent number may differ by ``FLOAT_TOLERANCE`` (absolute or
  relative); integers and words must be identical (case-sensitive).
- call-based: ``{"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value, ...]}``. The program's
  function ``f`` (or method ``Solution().f``, LeetCode style) is called with each argument list and its
  return value, sent back as JSON, must equal the expected value (floats within ``FLOAT_TOLERANCE``; tuples
  compare as lists; an expected ``[value]`` also accepts ``value``, as APPS/TACO wrap return values).

The program is the LAST fenced block tagged python/py/python3 in the response, else the last untagged fenced
block, else the whole response. Each test runs in its own process (`hyflow.rewards.sandbox.run_code`, with
wall-clock/CPU/memory limits and no network); a timeout, crash or memory error fails that test and is
counted in ``timeouts``/``errors``.

Reward: ``partial=False`` (default, verl-like) gives 1.0 when every test passes and 0.0 otherwise, and stops
at the first failing test (its result is already decided); ``partial=True`` gives the fraction of tests
passed and runs all of them. ``pass_rate`` is passed/total, a lower bound when the run stopped early.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from hyflow.rewards.sandbox import SandboxResult, run_code

FLOAT_TOLERANCE = 1e-6
_PYTHON_TAGS = {"python", "py", "python3", "py3"}
_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_RESULT_MARKER = "@@hyflow-call-result@@"
_FLOAT_TOKEN_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+|\d+(?:\.\d*)?[eE][+-]?\d+|inf|nan)", re.IGNORECASE)

# The call-based test program: the solution is executed as a module named "solution" (so an `if __name__ ==
# "__main__":` block does not run and wait for stdin), then the function is called and its result printed as
# JSON on a line of its own after a marker, which separates it from anything the solution printed.
_CALL_HARNESS = """
import json as _json, sys as _sys, types as _types

def _encode(value):
    if isinstance(value, (set, frozenset)):
        try:
            return sorted(value)
        except TypeError:
            return list(value)
    return repr(value)

_module = _types.ModuleType("solution")
_module.__file__ = "solution.py"
_sys.modules["solution"] = _module
exec(compile({source!r}, "solution.py", "exec"), _module.__dict__)
_fn = getattr(_module, {fn_name!r}, None)
if _fn is None and isinstance(getattr(_module, "Solution", None), type):
    _fn = getattr(_module.Solution(), {fn_name!r}, None)
if not callable(_fn):
    raise NameError("the solution defines no function or Solution method named " + {fn_name!r})
_result = _fn(*_json.loads({args_json!r}))
print()
print({marker!r} + _json.dumps(_result, default=_encode))
"""


@dataclass(frozen=True)
class TestSuite:
    """The tests of one task: parallel lists of inputs and expected outputs; `fn_name` set for call-based."""

    inputs: list
    outputs: list
    fn_name: str | None = None

    def __len__(self) -> int:
        return len(self.inputs)


def extract_code(solution_str: str) -> str:
    """The program in a response: last ```python block, else last untagged ``` block, else the whole text."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE_RE.findall(solution_str)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return solution_str


def _as_list(value, what: str) -> list:
    """A list from a list, tuple or numpy array (parquet round trips turn lists into arrays)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"code ground_truth[{what!r}] must be a list, got {type(value).__name__}")
    return list(value)


def parse_tests(ground_truth) -> TestSuite:
    """Tests from a dict or JSON string ``{"inputs": [...], "outputs": [...], "fn_name"?: str}``."""
    expected_format = (
        'a dict or JSON string {"inputs": [...], "outputs": [...]} (stdin/stdout tests) or '
        '{"fn_name": "f", "inputs": [[args...], ...], "outputs": [...]} (call-based tests)'
    )
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"code ground_truth is not valid JSON ({error}); it must be {expected_format}"
            ) from None
    if not isinstance(ground_truth, dict) or "inputs" not in ground_truth or "outputs" not in ground_truth:
        shown = repr(ground_truth)[:200]
        raise ValueError(f"code ground_truth must be {expected_format}; got {shown}")
    inputs = _as_list(ground_truth["inputs"], "inputs")
    outputs = _as_list(ground_truth["outputs"], "outputs")
    if len(inputs) != len(outputs):
        raise ValueError(
            f"code ground_truth has {len(inputs)} inputs but {len(outputs)} outputs; they must pair up"
        )
    if not inputs:
        raise ValueError(
            "code ground_truth has no tests (empty 'inputs'); every code task needs at least one"
        )
    fn_name = ground_truth.get("fn_name") or None
    return TestSuite(inputs=inputs, outputs=outputs, fn_name=fn_name)


def _join_lines(value) -> str:
    """A stdin/stdout test value as text (some datasets store it as a list of lines)."""
    if isinstance(value, (list, tuple)):
        return "\n".join(str(line) for line in value)
    return str(value)


def _tokens_close(actual: str, expected: str) -> bool:
    """Equal tokens, or two numbers (at least one written with a decimal point/exponent) within tolerance."""
    if actual == expected:
        return True
    if not (_FLOAT_TOKEN_RE.fullmatch(actual) or _FLOAT_TOKEN_RE.fullmatch(expected)):
        return False
    try:
        a, b = float(actual), float(expected)
    except ValueError:
        return False
    return math.isclose(a, b, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def outputs_match(actual: str, expected: str) -> bool:
    """Judge a stdout: same whitespace-separated tokens, numbers with a decimal part within FLOAT_TOLERANCE."""
    actual_tokens, expected_tokens = actual.split(), expected.split()
    if len(actual_tokens) != len(expected_tokens):
        return False
    return all(_tokens_close(a, e) for a, e in zip(actual_tokens, expected_tokens))


def _values_equal(actual, expected) -> bool:
    """Deep equality with tuples as lists and floats within FLOAT_TOLERANCE."""
    if isinstance(actual, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(_values_equal(a, e) for a, e in zip(actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(_values_equal(actual[k], expected[k]) for k in actual)
    numbers = (int, float)
    if (
        isinstance(actual, numbers)
        and isinstance(expected, numbers)
        and not isinstance(actual, bool)
        and not isinstance(expected, bool)
        and (isinstance(actual, float) or isinstance(expected, float))
    ):
        return math.isclose(actual, expected, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    return actual == expected


def values_match(actual, expected) -> bool:
    """Judge a returned value: deep equality, or equality with the only element of an expected ``[value]``."""
    if _values_equal(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(actual, expected[0])


def _call_program(code: str, fn_name: str, args) -> str:
    """The harness program that calls `fn_name(*args)` of `code` and prints the JSON result after a marker."""
    args = args if isinstance(args, (list, tuple)) else [args]
    return _CALL_HARNESS.format(
        source=code, fn_name=fn_name, args_json=json.dumps(list(args)), marker=_RESULT_MARKER
    )


def _returned_value(stdout: str) -> tuple[bool, object]:
    """(found, value) of the harness's result line (the last line carrying the marker)."""
    position = stdout.rfind(_RESULT_MARKER)
    if position < 0:
        return False, None
    line = stdout[position + len(_RESULT_MARKER) :].split("\n", 1)[0]
    try:
        return True, json.loads(line)
    except json.JSONDecodeError:
        return False, None


def run_test(
    code: str, tests: TestSuite, index: int, *, timeout_s: float, memory_mb: int
) -> tuple[bool, SandboxResult]:
    """Run test `index` of `tests` against `code`: (passed, sandbox result)."""
    if tests.fn_name is None:
        result = run_code(code, _join_lines(tests.inputs[index]), timeout_s=timeout_s, memory_mb=memory_mb)
        return result.ok and outputs_match(result.stdout, _join_lines(tests.outputs[index])), result
    program = _call_program(code, tests.fn_name, tests.inputs[index])
    result = run_code(program, "", timeout_s=timeout_s, memory_mb=memory_mb)
    found, value = _returned_value(result.stdout) if result.ok else (False, None)
    return found and values_match(value, tests.outputs[index]), result


def compute_score(
    data_source,
    solution_str: str,
    ground_truth,
    extra_info=None,
    partial: bool = False,
    stop_at_first_failure: bool | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    **kwargs,
) -> dict:
    """Score one code response by running its tests.

    pass_rate = passed / total; score = pass_rate if `partial` else 1.0 if all passed else 0.0.
    `stop_at_first_failure` defaults to ``not partial``. `timeout_s`/`memory_mb` limit each test's process.
    Returns ``{"score", "acc" (all passed), "pass_rate", "timeouts", "errors"}`` (counts of tests that timed
    out / crashed or ran out of memory). Other keyword arguments are accepted and ignored.
    """
    tests = parse_tests(ground_truth)
    code = extract_code(solution_str)
    stop = (not partial) if stop_at_first_failure is None else stop_at_first_failure
    passed = timeouts = errors = 0
    for index in range(len(tests)):
        ok, result = run_test(code, tests, index, timeout_s=timeout_s, memory_mb=memory_mb)
        passed += ok
        timeouts += result.status == "timeout"
        errors += result.status in ("error", "memory")
        if not ok and stop:
            break
    pass_rate = passed / len(tests)
    all_passed = passed == len(tests)
    return {
        "score": pass_rate if partial else float(all_passed),
        "acc": all_passed,
        "pass_rate": pass_rate,
        "timeouts": timeouts,
        "errors": errors,
    }
