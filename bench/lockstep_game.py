"""The calculator task played in lock-step: the benchmark's baseline for streaming rollouts, built
as a barrier in the environment over the one agent loop (no second loop is kept).

Lock-step means what the loop before streaming did: every episode's turn t waits until all the
episodes playing have finished turn t's generation, their tool calls then run together, and turn
t + 1 starts once the slowest of them has answered. Here each game's `step` (called once its
episode's turn is generated) waits at the first barrier, runs the tool, and waits at the second;
an episode that ends leaves both. The episodes of a step (and of an evaluation) join at their
reset; at k = 0 a step's episodes start together and no two steps overlap, so one process-wide
barrier serves them all. A barrier that waits longer than `BARRIER_TIMEOUT_S` (an episode cut off
by its token limit never steps again) lets the others go and counts it (`stalls`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from envs.math_tool.game import MathToolGame

BARRIER_TIMEOUT_S = 120.0


class TurnBarrier:
    """A barrier whose parties come and go: `join` at an episode's start, `arrive(key)` waits until
    every party still playing has arrived at `key`, `leave` at its end."""

    def __init__(self):
        self.condition = threading.Condition()
        self.playing = 0
        self.arrived: dict[tuple[str, int], int] = {}
        self.stalls = 0

    def join(self) -> None:
        with self.condition:
            self.playing += 1

    def leave(self) -> None:
        with self.condition:
            self.playing -= 1
            if self.playing == 0:
                self.arrived.clear()  # the step (or evaluation) is over: the next one counts afresh
            self.condition.notify_all()

    def arrive(self, key: tuple[str, int]) -> None:
        with self.condition:
            self.arrived[key] = self.arrived.get(key, 0) + 1
            self.condition.notify_all()
            if not self.condition.wait_for(lambda: self.arrived.get(key, 0) >= self.playing, timeout=BARRIER_TIMEOUT_S):
                self.stalls += 1
                print(f"lockstep barrier at {key} timed out ({self.arrived.get(key, 0)} of {self.playing})", file=sys.stderr)


BARRIER = TurnBarrier()


class LockstepMathToolGame(MathToolGame):
    """envs.math_tool's game, its turns in lock-step with every other episode's (`max_turns`: the
    job's rollout.max_turns, after which an episode steps no more)."""

    def __init__(self, *args: Any, max_turns: int = 4, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_turns, self.turn, self.joined = max_turns, 0, False

    def reset(self, *args: Any, **kwargs: Any) -> str:
        if self.joined:
            BARRIER.leave()
        BARRIER.join()
        self.turn, self.joined = 0, True
        return super().reset(*args, **kwargs)

    def step(self, action: str):
        BARRIER.arrive(("generated", self.turn))
        result = super().step(action)
        self.turn += 1
        if result.done or self.turn >= self.max_turns:
            BARRIER.leave()
            self.joined = False
        else:
            BARRIER.arrive(("tools answered", self.turn))
        return result

    def close(self) -> None:
        if self.joined:  # an episode that ended without its last step (failed, cut off)
            BARRIER.leave()
            self.joined = False
        super().close()
