"""A trivially learnable environment for smoke tests of the whole pipeline.

Reward 1 when the reply's first letter is uppercase. A random model starts near chance and the
policy only has to move probability mass at its first token, so even a tiny random model learns
it within seconds: useful to check that a deployment, a worker or a cluster really trains.
"""

from __future__ import annotations

from typing import Any

from opentinker.env import AbstractGame, StepResult


class UppercaseGame(AbstractGame):
    def reset(self, prompt: str = "Say something.", **_: Any) -> str:
        return prompt

    @classmethod
    def generate_task(cls, rng: Any, **_: Any) -> dict[str, Any]:
        return {"prompt": f"Say something about item {int(rng.integers(10_000))}."}

    def step(self, action: str) -> StepResult:
        letters = [c for c in action if c.isalpha()]
        good = bool(letters) and letters[0].isupper()
        return StepResult(observation="", reward=1.0 if good else 0.0, done=True, info={"correct": good})
