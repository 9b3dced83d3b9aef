"""Small games for tests: scripted multi-turn episodes, faulty environments, a learnable toy task."""

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


class UppercaseGame(AbstractGame):
    """Reward 1 when the reply's first letter is uppercase. A random model starts near chance;
    the policy only has to move mass at its first token, so a tiny model learns it in seconds."""

    def reset(self, prompt: str = "Say something.", **_: Any) -> str:
        return prompt

    @classmethod
    def generate_task(cls, rng: Any, **_: Any) -> dict[str, Any]:
        return {"prompt": f"Say something about item {int(rng.integers(10_000))}."}

    def step(self, action: str) -> StepResult:
        letters = [c for c in action if c.isalpha()]
        good = bool(letters) and letters[0].isupper()
        return StepResult(observation="", reward=1.0 if good else 0.0, done=True, info={"correct": good})
