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


_BLIPS = {"ConnectError", "ConnectTimeout", "ReadError", "ReadTimeout", "WriteError", "PoolTimeout", "RemoteProtocolError",
          "ConnectionError", "ConnectionRefusedError", "ConnectionResetError", "MaxRetryError", "NewConnectionError"}


def is_blip(err: BaseException) -> bool:
    """A server that did not answer (down, restarting, a dropped connection), as opposed to one
    that answered with an error: worth trying again. Also a 5xx from a server coming back up."""
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & _BLIPS:
        return True
    status = getattr(getattr(err, "response", None), "status_code", None) or getattr(err, "status", None)
    if isinstance(status, int) and status >= 502:
        return True
    text = str(err)  # an MlflowException wraps the connection error in its message
    return "MlflowException" in names and ("Max retries exceeded" in text or "Connection refused" in text)


def through_blips(call: Callable[[], T], *, give_up_after_s: float, on_retry: Callable[[int, BaseException], None] | None = None) -> T:
    """`call()`, tried again with backoff (0.5 s doubling to 10 s) while it fails with a blip, for
    up to `give_up_after_s`; then the last error is raised. `on_retry(attempt, error)` before each wait."""
    from tenacity import retry_if_exception, wait_exponential

    def before_sleep(state) -> None:
        if on_retry is not None:
            on_retry(state.attempt_number, state.outcome.exception())

    retrying = Retrying(retry=retry_if_exception(is_blip), wait=wait_exponential(multiplier=0.5, max=10),
                        stop=stop_after_delay(give_up_after_s), before_sleep=before_sleep, reraise=True)
    return retrying(call)


def wait_healthy(url: str, timeout: float = 60.0, path: str = "/health") -> None:
    """Wait until `url` answers `path` with a success (a server this process just started);
    TimeoutError naming the URL past `timeout`."""
    import httpx

    def healthy() -> bool | None:
        try:
            return True if httpx.get(f"{url.rstrip('/')}{path}", timeout=1.0, trust_env=False).is_success else None
        except httpx.HTTPError:
            return None

    wait_for(healthy, interval=0.2, timeout=timeout, what=f"{url} to answer {path}")
