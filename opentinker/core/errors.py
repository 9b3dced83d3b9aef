"""Failures as one line a user can read; the traceback belongs in the logs."""

from __future__ import annotations

import re
import traceback

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def plain(text: str) -> str:
    """`text` without terminal colour codes."""
    return _ANSI.sub("", text)


def root_cause(err: BaseException) -> BaseException:
    """The exception that started it: a Ray task error's original exception, else `err`."""
    cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError / RayActorError carry it
    return cause if isinstance(cause, BaseException) else err


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def where(err: BaseException) -> str | None:
    """`module.function:line` of the innermost frame that raised `err` (the file's name without
    its folder: paths are the worker's, not the user's), from its traceback or, for an error that
    crossed from a Ray worker, from the traceback text Ray kept; None when neither exists."""
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(err.__traceback__)] if err.__traceback__ else []
    remote = [(f, int(n), fn) for f, n, fn in _FRAME.findall(plain(getattr(err, "traceback_str", "") or ""))]
    filename, lineno, name = (remote or frames or [(None, 0, "")])[-1]
    if filename is None:
        return None
    return f"{filename.rsplit('/', 1)[-1].removesuffix('.py')}.{name}:{lineno}"


def one_line(err: BaseException) -> str:
    """`ExcType: first line of the message (at module.function:line)`, colour codes removed."""
    cause = root_cause(err)
    lines = [line.strip() for line in plain(str(cause)).splitlines() if line.strip()]
    text = f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
    at = where(err) if getattr(err, "traceback_str", None) else where(cause)
    return f"{text} (at {at})" if at else text
