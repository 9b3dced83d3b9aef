"""Run untrusted environment code with a deadline, turning every failure into a value."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from opentinker.env.base import StepResult
from opentinker.env.hosting import checked_observation


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
    outcomes = [Outcome() for _ in calls]
    done = [threading.Event() for _ in calls]

    def run(i: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            outcomes[i].value = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - any failure of user code costs one episode
            outcomes[i].error = f"{type(err).__name__}: {err}"
        finally:
            done[i].set()

    for i, (fn, args, kwargs) in enumerate(calls):
        threading.Thread(target=run, args=(i, fn, args, kwargs), daemon=True).start()
    end = time.monotonic() + timeout_s
    for i, ev in enumerate(done):
        if not ev.wait(max(0.0, end - time.monotonic())):
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
