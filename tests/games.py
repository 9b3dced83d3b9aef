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


class HugePromptGame(ScriptedTurns):
    """A question of a million characters (a reasoning-gym config with 60,000 terms, say): no episode fits."""

    def reset(self, **task: Any) -> str:
        return "1 + " * 250_000 + "1 = ?"


class HugeObservationGame(ScriptedTurns):
    """Its second observation is two million characters: the episode is cut there, never tokenized whole."""

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        if self.k == 2:
            result.observation = "x " * 1_000_000
        return result


def picture(colour: str, size: int = 96) -> Any:
    """A square of `colour` on white (a PIL image)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).rectangle((size // 5, size // 5, size * 4 // 5, size * 4 // 5), fill=colour)
    return image


class PictureGame(AbstractGame):
    """Images in the first observation and in a later one: a picture, then two more, then done.
    The first observation's text length depends on the task, so batched prompts differ in length."""

    def reset(self, colour: str = "red", words: int = 1, **_: Any):
        from opentinker.env import Observation

        self.turn = 0
        return Observation("What colour is it? " + "please " * words, [picture(colour)])

    def step(self, action: str) -> StepResult:
        from opentinker.env import Observation

        self.turn += 1
        if self.turn >= 2:
            return StepResult("Thanks.", reward=float(len(action) % 3), done=True)
        return StepResult(Observation("And these two?", [picture("blue"), picture("green", 64)]), reward=0.0)


class NotAnImageGame(PictureGame):
    def step(self, action: str) -> StepResult:
        from opentinker.env import Observation

        return StepResult(Observation("look", ["not an image"]), reward=0.0)


class HugeImageGame(PictureGame):
    def step(self, action: str) -> StepResult:
        from PIL import Image

        from opentinker.env import Observation

        return StepResult(Observation("look", [Image.new("RGB", (5000, 5000))]), reward=0.0)


class SometimesBroken(ScriptedTurns):
    """Learnable as envs.toy.UppercaseGame, but a quarter of its tasks raise at their step and a
    quarter hang past any step timeout: a stream must lose those episodes, never stall on them."""

    @classmethod
    def generate_task(cls, rng: Any, **_: Any) -> dict[str, Any]:
        return {"id": int(rng.integers(10_000))}

    def reset(self, **task: Any) -> str:
        self.id = int(task.get("id", 0))
        return f"Say something about item {self.id}."

    def step(self, action: str) -> StepResult:
        if self.id % 4 == 1:
            raise RuntimeError("the tool crashed")
        if self.id % 4 == 2:
            time.sleep(30)
        letters = [c for c in action if c.isalpha()]
        return StepResult(observation="", reward=float(bool(letters) and letters[0].isupper()), done=True)


class SlowForOneTask(ScriptedTurns):
    """One turn; the task with id 0 waits 1.5 s at its step (a slow tool), the others answer at once."""

    def __init__(self):
        super().__init__(turns=1)

    def reset(self, **task: Any) -> str:
        self.id = int(task.get("id", 0))
        return super().reset(**task)

    def step(self, action: str) -> StepResult:
        if self.id == 0:
            time.sleep(1.5)
        return super().step(action)
