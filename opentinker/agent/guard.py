"""Run untrusted environment code with a deadline, turning every failure into a value.

A call past its deadline cannot be killed: its thread is abandoned and runs on until the call
returns. So that a game or server that never answers cannot pile up threads for as long as the
job lives, at most MAX_STUCK_CALLS abandoned calls may still run in a process; past that, new calls
fail at once (one line, with the numbers) until some return. `stuck_calls()` counts them.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from opentinker.env.base import StepResult
from opentinker.env.hosting import checked_observation


MAX_STUCK_CALLS = 32  # abandoned environment calls (past their deadline, still running) a process keeps at most

_stuck = 0
_stuck_lock = threading.Lock()


def stuck_calls() -> int:
    """Environment calls of this process past their deadline and still running."""
    return _stuck


@dataclass
class Outcome:
    value: Any = None
    error: str | None = None


def call_with_timeout(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Outcome:
    """Run fn in a daemon thread; past the deadline the call is abandoned (it cannot be killed,
    but a daemon thread never blocks the process from exiting)."""
    return call_many_with_timeout([(fn, args, kwargs)], timeout_s)[0]


def call_many_with_timeout(calls: list[tuple[Callable[..., Any], tuple, dict]], timeout_s: float) -> list[Outcome]:
    """Run independent calls concurrently, each bounded by the same deadline."""
    global _stuck
    if _stuck >= MAX_STUCK_CALLS:
        refused = (f"not called: {_stuck} environment calls of this process are still running past their deadline "
                   f"(at most {MAX_STUCK_CALLS}); the environment does not answer")
        return [Outcome(error=refused) for _ in calls]
    outcomes = [Outcome() for _ in calls]
    done = [threading.Event() for _ in calls]
    abandoned = [False] * len(calls)

    def run(i: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        global _stuck
        out = Outcome()
        try:
            out.value = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - any failure of user code costs one episode
            out.error = f"{type(err).__name__}: {err}"
        with _stuck_lock:
            if abandoned[i]:
                _stuck -= 1
            else:
                outcomes[i] = out
            done[i].set()

    for i, (fn, args, kwargs) in enumerate(calls):
        threading.Thread(target=run, args=(i, fn, args, kwargs), name="env-call", daemon=True).start()
    end = time.monotonic() + timeout_s
    for i, ev in enumerate(done):
        if not ev.wait(max(0.0, end - time.monotonic())):
            with _stuck_lock:
                if not done[i].is_set():  # it may have returned just now
                    abandoned[i] = True
                    _stuck += 1
                    outcomes[i] = Outcome(error=f"timed out after {timeout_s:g}s")
    return outcomes


def check_step_result(value: Any) -> StepResult:
    """Reject what a step must never return: not a StepResult, an observation that is neither text
    nor a valid Observation (see env.observation), a reward that is not a finite number."""
    if not isinstance(value, StepResult):
        raise TypeError(f"step returned {type(value).__name__}, expected StepResult")
    value.observation = checked_observation(value.observation)
    try:
        reward = float(value.reward)
    except (TypeError, ValueError):
        raise TypeError(f"reward {value.reward!r} is not a number") from None
    if not math.isfinite(reward):
        raise ValueError(f"reward {reward} is not finite")
    value.reward = reward
    value.done = bool(value.done)
    value.info = dict(value.info or {})
    return value
