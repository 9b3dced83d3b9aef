"""The one way the project waits for something to happen: poll a check until it answers.

Built on tenacity, so intervals and deadlines are the library's, not a hand-written loop's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, stop_never, wait_fixed

T = TypeVar("T")


def wait_for(check: Callable[[], T | None], *, interval: float, timeout: float | None = None,
             what: str = "the condition") -> T:
    """Call `check` every `interval` seconds until it returns something other than None; return
    that. TimeoutError naming `what` once `timeout` seconds have passed (None: wait for ever).
    An exception raised by `check` ends the wait at once."""
    retrying = Retrying(retry=retry_if_result(lambda value: value is None), wait=wait_fixed(interval),
                        stop=stop_never if timeout is None else stop_after_delay(timeout), reraise=True)
    try:
        return retrying(check)
    except RetryError:
        raise TimeoutError(f"{what}: not reached within {timeout:g}s") from None
