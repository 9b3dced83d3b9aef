"""The calculator tool: arithmetic on model-written text without eval/exec.

The text is parsed with `ast` and only numbers, unary +/-, binary + - * / // % ** and parentheses
are evaluated. Model text is untrusted, so sizes are bounded: input length, the exponent, and
every literal and intermediate value (`9**9**9` is refused instead of hanging the episode).
"""

from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_EXPONENT = 10
MAX_MAGNITUDE = 10**15  # bound on every literal and intermediate result

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
ALLOWED = "numbers, + - * / // % ** and parentheses"


class CalcError(ValueError):
    """A refused or failed calculation; the message is shown to the model."""


def safe_eval(expression: str) -> int | float:
    """The value of an arithmetic expression; raises CalcError (only) when it is refused or fails."""
    if not isinstance(expression, str):
        raise CalcError("expression must be text")
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression too long (max {MAX_CHARS} characters)")
    try:
        tree = ast.parse(text, mode="eval")
        return _eval(tree.body)
    except CalcError:
        raise
    except SyntaxError:
        raise CalcError("syntax error") from None
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except (OverflowError, MemoryError):
        raise CalcError("number too large") from None
    except (RecursionError, ValueError):  # absurd nesting; null bytes on older Pythons
        raise CalcError("expression not understood") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # bool and complex excluded
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent too large (max {MAX_EXPONENT})")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalcError(f"only {ALLOWED} are allowed")


def _bounded(value: object) -> int | float:
    if isinstance(value, complex):  # e.g. (-8) ** 0.5
        raise CalcError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("number too large")
    if abs(value) > MAX_MAGNITUDE:  # type: ignore[arg-type]
        raise CalcError(f"number too large (max {MAX_MAGNITUDE:.0e})")
    return value  # type: ignore[return-value]


def format_number(value: float) -> str:
    """Ints as they are; floats rounded to 6 decimals, integral ones shown as ints (6.0 -> '6')."""
    if isinstance(value, int):
        return str(value)
    if 0 < abs(value) < 1e-6:  # would round to a misleading 0
        return f"{value:.6g}"
    rounded = round(value, 6)
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)


def calculate(expression: str) -> tuple[bool, str]:
    """(True, formatted value) or (False, error message): never raises, for use inside a game step."""
    try:
        return True, format_number(safe_eval(expression))
    except CalcError as err:
        return False, str(err)
