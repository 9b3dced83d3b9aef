"""JSON read from text nobody checked (a model's output, a client's request, a tenant's server).

`json.loads` has three ways to fail besides `JSONDecodeError`: nesting deeper than the
interpreter's recursion limit raises `RecursionError` (about 500 `[` do it), an integer of more
than 4,300 digits raises a plain `ValueError`, and a large text costs its size in memory before
any of that. And it reads what JSON does not have: `NaN`, `Infinity` and `1e999` (as floats no
later check expects). `loads_bounded` refuses all of these with one error type, so a caller
catches `JsonTextError` (a `ValueError`) and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64  # objects and arrays inside one another: far more than any tool's arguments need
MAX_CHARS = 1 << 20  # characters of JSON text

# Opening and closing brackets, and strings as whole tokens (a bracket inside a string is text).
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class JsonTextError(ValueError):
    """The text is not JSON we read: malformed, too deep, too large, or a number out of range."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonTextError(f"the number {text[:40]} is out of range (JSON has no infinity)")
    return value


def _no_constant(name: str) -> Any:
    raise JsonTextError(f"{name} is not a JSON number")


def nesting_depth(text: str) -> int:
    """How deep brackets nest in `text`, strings skipped (an unclosed string ends the scan)."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth = max(0, depth - 1)
    return deepest


def loads_bounded(text: str | bytes, *, max_depth: int = MAX_DEPTH, max_chars: int = MAX_CHARS) -> Any:
    """`json.loads(text)`, or JsonTextError saying why not (never RecursionError or another ValueError)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as err:
            raise JsonTextError(f"not UTF-8 (byte {err.start})") from None
    if len(text) > max_chars:
        raise JsonTextError(f"{len(text)} characters of JSON, over the limit of {max_chars}")
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JsonTextError(f"nested {depth} levels deep, over the limit of {max_depth}")
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except JsonTextError:
        raise
    except json.JSONDecodeError as err:
        raise JsonTextError(f"{err.msg} at character {err.pos}") from None
    except (ValueError, RecursionError, MemoryError) as err:  # a 5,000-digit integer; recursion our scan missed
        raise JsonTextError(f"{type(err).__name__}: {str(err)[:200]}") from None
