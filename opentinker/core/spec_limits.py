"""How big a spec may be, checked before anything parses it further or sends it anywhere: a
50 MB value is refused in a line, at once, not after a minute of uploading and a screenful of
the value echoed back."""

from __future__ import annotations

import json
from typing import Any

MAX_SPEC_BYTES = 8 * 1024**2
"""A whole spec as JSON (inline datasets included)."""

MAX_VALUE_BYTES = 256 * 1024
"""One value (a string, or one element of a list) as JSON."""


def _size(value: Any) -> int:
    try:
        return len(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return len(str(value))


def _largest(value: Any, path: str) -> tuple[int, str]:
    """(size, path) of the largest single value (a leaf, or one item of a list) under `value`."""
    if isinstance(value, dict):
        found = [_largest(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
        return max(found, default=(0, path))
    if isinstance(value, list):
        found = [_largest(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return max(found, default=(0, path))
    return _size(value), path


def size_problem(data: Any) -> str | None:
    """`field: reason` when `data` (a spec as plain data) is too big, else None."""
    total = _size(data)
    if total > MAX_SPEC_BYTES:
        return f"<spec>: {total / 1024**2:.1f} MB, more than the {MAX_SPEC_BYTES // 1024**2} MB a spec may hold (give large data by path)"
    size, path = _largest(data, "")
    if size > MAX_VALUE_BYTES:
        return f"{path or '<spec>'}: a value of {size / 1024:.0f} KB, more than the {MAX_VALUE_BYTES // 1024} KB one value may hold"
    return None
