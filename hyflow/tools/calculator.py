"""`CalculatorTool`: exact arithmetic on an expression the model writes, without `eval`.

The expression is parsed with `ast` and walked: int and float literals, unary ``+``/``-``, binary ``+ - * /
// % **`` and parentheses; anything else (names, calls, attributes, strings, comparisons, ``^``) is refused
with an error text naming it. Arithmetic is exact (`fractions.Fraction`; a float literal stands for its
decimal value, so ``0.1 + 0.2`` is ``0.3``) until a fractional power makes it inexact. Integer results print
as integers (``6/3`` gives ``2``), others as floats with 10 significant digits.

Blow-up guards: the expression is at most ``config["max_length"]`` characters (default 200); every value
must stay below 10**100 in magnitude; ``**`` takes exponents with ``|exponent| <= 64`` and refuses a power
whose result would pass that bound before computing it. Division by zero and every other problem give a
``"error: ..."`` text with reward 0.0 and ``{"error": message}`` metrics; model input never raises.
"""

from __future__ import annotations

import ast
import math
import warnings
from fractions import Fraction
from typing import Any

from hyflow.tools.base import BaseTool
from hyflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**100
_MAX_BITS = MAX_MAGNITUDE.bit_length()  # 333

_OPERATORS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}
_REFUSED_OPERATORS = {
    ast.BitXor: "operator ^ (write ** for powers)",
    ast.BitAnd: "operator &",
    ast.BitOr: "operator |",
    ast.LShift: "operator <<",
    ast.RShift: "operator >>",
    ast.MatMult: "operator @",
    ast.Invert: "operator ~",
    ast.Not: "operator not",
}
_NODE_NAMES = {
    ast.Call: "function call",
    ast.Attribute: "attribute access",
    ast.Subscript: "subscript",
    ast.Compare: "comparison",
    ast.BoolOp: "boolean operator",
    ast.IfExp: "conditional expression",
    ast.Lambda: "lambda",
    ast.List: "list",
    ast.Tuple: "tuple",
    ast.Dict: "dict",
    ast.Set: "set",
    ast.ListComp: "comprehension",
    ast.SetComp: "comprehension",
    ast.DictComp: "comprehension",
    ast.GeneratorExp: "generator expression",
    ast.JoinedStr: "f-string",
    ast.NamedExpr: "assignment (:=)",
    ast.Starred: "starred expression",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
    ast.Slice: "slice",
}

Number = Fraction | float

DESCRIPTION = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) exactly"


class CalculationError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is shown to the model)."""


def _check(value: Number) -> Number:
    """`value` if finite and below `MAX_MAGNITUDE`; an exact value with a huge denominator becomes a float."""
    if isinstance(value, complex):
        raise CalculationError("the result is a complex number (a fractional power of a negative number)")
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= MAX_MAGNITUDE:
            raise CalculationError("a value exceeds 10**100")
        return value
    if abs(value) >= MAX_MAGNITUDE:
        raise CalculationError("a value exceeds 10**100")
    if value.denominator >= MAX_MAGNITUDE:
        return float(value)
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculationError(
            f"exponent {_format(exponent)} is too large (the limit is |exponent| <= {MAX_EXPONENT})"
        )
    if base == 0 and exponent < 0:
        raise CalculationError("division by zero (0 raised to a negative power)")
    if isinstance(base, Fraction) and isinstance(exponent, Fraction) and exponent.denominator == 1:
        # The sizes of the exact result's numerator and denominator are known before computing it.
        power = exponent.numerator
        grows, shrinks = (
            (base.numerator, base.denominator) if power > 0 else (base.denominator, base.numerator)
        )
        if (abs(grows).bit_length() - 1) * abs(power) > _MAX_BITS:
            raise CalculationError(f"{_format(base)} ** {_format(exponent)} exceeds 10**100")
        if (abs(shrinks).bit_length() - 1) * abs(power) <= _MAX_BITS:
            return _check(base**exponent)
        # A tiny result: computed as a float instead (its exact denominator would pass 10**100).
    try:
        result = float(base) ** float(exponent)
    except OverflowError:
        raise CalculationError(f"{_format(base)} ** {_format(exponent)} exceeds 10**100") from None
    except ZeroDivisionError:
        raise CalculationError("division by zero (0 raised to a negative power)") from None
    return _check(result)


def _binary(op: ast.operator, left: Number, right: Number) -> Number:
    if isinstance(op, ast.Pow):
        return _power(left, right)
    if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
        raise CalculationError("division by zero")
    try:
        if isinstance(op, ast.Add):
            result = left + right
        elif isinstance(op, ast.Sub):
            result = left - right
        elif isinstance(op, ast.Mult):
            result = left * right
        elif isinstance(op, ast.Div):
            result = left / right
        elif isinstance(op, ast.FloorDiv):
            result = left // right
        else:
            result = left % right
    except OverflowError:
        raise CalculationError("a value exceeds 10**100") from None
    if isinstance(result, int):  # Fraction // Fraction is an int
        result = Fraction(result)
    return _check(result)


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            raise CalculationError(f"boolean {value} is not a number")
        if isinstance(value, int):
            return _check(Fraction(value))
        if isinstance(value, float):
            if not math.isfinite(value):
                raise CalculationError("a value exceeds 10**100")
            return _check(Fraction(repr(value)))  # the decimal the model wrote, not its binary approximation
        if isinstance(value, complex):
            raise CalculationError(f"complex literal {value!r} is not supported")
        if isinstance(value, str | bytes):
            raise CalculationError(f"string literal {value!r} is not a number")
        raise CalculationError(f"{value!r} is not a number")
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.USub):
            return _check(-_evaluate(node.operand))
        if isinstance(node.op, ast.UAdd):
            return _evaluate(node.operand)
        raise CalculationError(
            f"{_REFUSED_OPERATORS.get(type(node.op), type(node.op).__name__)} is not supported"
        )
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _OPERATORS:
            raise CalculationError(
                f"{_REFUSED_OPERATORS.get(type(node.op), type(node.op).__name__)} is not supported; "
                "use + - * / // % **"
            )
        return _binary(node.op, _evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.Name):
        raise CalculationError(f"name '{node.id}' is not allowed: only numbers and + - * / // % ** ( )")
    if isinstance(node, ast.Call):
        callee = ast.unparse(node.func)
        raise CalculationError(
            f"function call {callee}(...) is not allowed: only numbers and + - * / // % ** ( )"
        )
    description = _NODE_NAMES.get(type(node), type(node).__name__)
    raise CalculationError(f"{description} is not allowed: only numbers and + - * / // % ** ( )")


def _format(value: Number) -> str:
    """Integers as integers; other values as floats with 10 significant digits (trailing zeros dropped)."""
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        value = float(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.10g}"


def evaluate_expression(expression: str, max_length: int = 200) -> str:
    """The value of `expression` as text; raises `CalculationError` (a ValueError) with the reason if none."""
    expression = expression.strip()
    if not expression:
        raise CalculationError("empty expression")
    if len(expression) > max_length:
        raise CalculationError(f"expression is {len(expression)} characters long; the limit is {max_length}")
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and the like: the model's text, not ours
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise CalculationError(f"invalid syntax: {error.msg}") from None
    except (ValueError, RecursionError, MemoryError) as error:
        raise CalculationError(f"cannot parse the expression ({type(error).__name__})") from None
    try:
        return _format(_evaluate(tree))
    except RecursionError:
        raise CalculationError("the expression is nested too deeply") from None


class CalculatorTool(BaseTool):
    """Exact arithmetic (see the module docstring). Config: ``max_length`` (default 200 characters)."""

    def __init__(self, config: dict | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config if config is not None else {}, tool_schema)
        self.max_length = int(self.config.get("max_length", 200))
        self._calls: dict[str, int] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "calculator",
                    "description": DESCRIPTION,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "expression": {
                                "type": "string",
                                "description": "the expression, e.g. (3 + 4) * 2 / 7",
                            },
                        },
                        "required": ["expression"],
                    },
                },
            }
        )

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id, **kwargs)
        self._calls[instance_id] = 0
        return instance_id, response

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        self._calls[instance_id] = self._calls.get(instance_id, 0) + 1
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        try:
            if expression is None:
                raise CalculationError('missing the `expression` argument (a string such as "2 * (3 + 4)")')
            if not isinstance(expression, str):
                raise CalculationError(f"`expression` must be a string, got {type(expression).__name__}")
            result = evaluate_expression(expression, self.max_length)
        except CalculationError as error:
            return ToolResponse(text=f"error: {error}"), 0.0, {"error": str(error)}
        return ToolResponse(text=result), 0.0, {"ok": True}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._calls.pop(instance_id, None)
