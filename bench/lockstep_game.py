"""The calculator task played in lock-step: the benchmark's baseline for streaming rollouts, built
as a barrier in the environment over the one agent loop (no second loop is kept).

Lock-step means what the loop before streaming did: every episode's turn t waits until all the
episodes playing have finished turn t's generation, their tool calls then run together, and turn
t + 1 starts once the slowest of them has answered. The calculator is a declared tool: the agent
loop answers a turn that calls it (the game's `calculate` runs), and only a turn without a call
reaches the game's `step` (which always ends the episode). So the barrier sits in both: a
calculator call waits at the first barrier, runs, and waits at the second (or leaves, on the
episode's last turn); `step` waits at the first barrier and leaves. The episodes of a step (and of
an evaluation) join at their reset; at k = 0 a step's episodes start together and no two steps
overlap, so one process-wide barrier serves them all.

What the game cannot see it cannot hold: a turn whose calls are all malformed (not JSON, an
unknown tool, bad arguments) is answered by the agent loop without the game, so that episode skips
the barrier for that turn and its count lags one behind; a turn with several calls arrives once
per call. Either only shifts which turns meet, but an episode that then runs out of turns on a call
without the game knowing, or one cut off by its token limit, never leaves: the others wait
`BARRIER_TIMEOUT_S`, then go on, and it is counted (`stalls`).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import replace
from typing import Any

from envs.math_tool.game import MathToolGame
from opentinker.tools.declared import Tool

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
    job's rollout.max_turns, after which an episode plays no more)."""

    def __init__(self, *args: Any, max_turns: int = 4, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_turns, self.turn, self.joined = max_turns, 0, False

    def get_tools(self) -> list[Tool]:
        # a call waits at two barriers inside the tool: its time limit must outlast both
        return [replace(t, timeout_s=max(t.timeout_s, 2 * BARRIER_TIMEOUT_S + 60.0)) for t in super().get_tools()]

    def reset(self, *args: Any, **kwargs: Any) -> str:
        if self.joined:
            BARRIER.leave()
        BARRIER.join()
        self.turn, self.joined = 0, True
        return super().reset(*args, **kwargs)

    def calculate(self, arguments: dict[str, Any]) -> str:
        """A tool turn: every episode's generation of this turn done, then the calls run together."""
        if not self.joined:
            return super().calculate(arguments)
        BARRIER.arrive(("generated", self.turn))
        try:
            return super().calculate(arguments)
        finally:
            self.turn += 1
            if self.turn >= self.max_turns:
                self._leave()
            else:
                BARRIER.arrive(("tools answered", self.turn))

    def step(self, action: str):
        """An answer turn (or one with neither call nor answer): it ends the episode."""
        if self.joined:
            BARRIER.arrive(("generated", self.turn))
        result = super().step(action)
        self.turn += 1
        if result.done or self.turn >= self.max_turns:
            self._leave()
        return result

    def _leave(self) -> None:
        if self.joined:
            BARRIER.leave()
            self.joined = False

    def close(self) -> None:
        self._leave()  # an episode that ended without the game knowing (failed, cut off, out of turns on a malformed call)
        super().close()
