"""Small games for tests: scripted multi-turn episodes and faulty environments.

The learnable toy task is shipped as envs.toy.UppercaseGame (importable on any worker)."""

from __future__ import annotations

import time
from typing import Any

from opentinker.env import AbstractGame, StepResult


class ScriptedTurns(AbstractGame):
    """Answers every action with 'observation k' and ends after `turns` steps; reward 0.1·k per turn, 1 at the end."""

    def __init__(self, turns: int = 3):
        self.turns = turns
        self.k = 0

    def get_system_prompt(self) -> str:
        return "Play along."

    def reset(self, **task: Any) -> str:
        self.k = 0
        return f"start {task.get('id', 0)}"

    def step(self, action: str) -> StepResult:
        self.k += 1
        done = self.k >= self.turns
        return StepResult(observation=f"observation {self.k}", reward=1.0 if done else 0.1 * self.k, done=done, info={"turn": self.k})


class RaisingGame(ScriptedTurns):
    def step(self, action: str) -> StepResult:
        raise RuntimeError("environment bug")


class HangingGame(ScriptedTurns):
    def step(self, action: str) -> StepResult:
        time.sleep(30)
        return super().step(action)


class GarbageGame(ScriptedTurns):
    def step(self, action: str):
        return {"observation": "not a StepResult"}


class NanRewardGame(ScriptedTurns):
    def step(self, action: str) -> StepResult:
        return StepResult(observation="x", reward=float("nan"), done=True)


class BrokenResetGame(ScriptedTurns):
    """Every episode fails before it starts."""

    def reset(self, **task: Any) -> str:
        raise RuntimeError("the level file is missing")


class NoneRewardGame(ScriptedTurns):
    def step(self, action: str) -> StepResult:
        return StepResult(observation="x", reward=None, done=True)
