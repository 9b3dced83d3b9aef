"""Failures as one line a user can read; the traceback belongs in the logs.

An error that crossed from a Ray worker carries the worker's traceback as text (with colour
codes, pid, ip and actor id); the line kept is the original exception's and its innermost frame.
"""

from __future__ import annotations

import re
import traceback

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def plain(text: str) -> str:
    """`text` without terminal colour codes."""
    return _ANSI.sub("", text)


def _frame(filename: str, lineno: int | str, name: str) -> str:
    """`file.function:line`: the file's name without its folder (paths are the worker's)."""
    return f"{filename.rsplit('/', 1)[-1].removesuffix('.py')}.{name}:{lineno}"


def _from_text(text: str) -> tuple[str, str] | None:
    """(exception line, where) from a traceback rendered as text, or None without frames."""
    frames = list(_FRAME.finditer(text))
    if not frames:
        return None
    last = frames[-1]
    after = text[last.end():].splitlines()[1:]
    line = next((x.strip() for x in after if x.strip() and not x[:1].isspace()), "")
    return line, _frame(*last.groups())


def one_line(err: BaseException) -> str:
    """`ExcType: first line of the message (at file.function:line)`, colour codes removed."""
    cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError keeps the original exception
    remote = _from_text(plain(str(err))) if type(err).__module__.startswith("ray.") else None
    if isinstance(cause, BaseException):
        lines = [x.strip() for x in plain(str(cause)).splitlines() if x.strip()]
        text = f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
    elif remote and remote[0]:
        text = remote[0]
    else:
        lines = [x.strip() for x in plain(str(err)).splitlines() if x.strip()]
        text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    if remote:
        at = remote[1]
    else:
        frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ else []
        at = _frame(frames[-1].filename, frames[-1].lineno, frames[-1].name) if frames else None
    return f"{text} (at {at})" if at else text


def reason_line(message: str | None) -> str | None:
    """The one line to show for a Prefect failure message: its first line, colour codes removed,
    without Prefect's "Flow run encountered an exception:" and our JobError prefixes."""
    if not message:
        return message
    lines = [x.strip() for x in plain(message).splitlines() if x.strip()]
    text = lines[0] if lines else ""
    for prefix in ("Flow run encountered an exception: ", "JobError: "):
        text = text.removeprefix(prefix)
    return text
