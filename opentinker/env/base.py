"""The environment API users implement. Environments see text only, never tokens or models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What one environment step returns."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class AbstractGame:
    """One episode's game logic. A new instance serves each episode.

    `reset(**task)` receives one task from the environment's data source (e.g. a math problem)
    and returns the initial observation; when `get_initial_user_message` returns "" the
    observation is the first user message. `step(action)` receives the model's text.
    """

    def get_system_prompt(self) -> str:
        return ""

    def get_initial_user_message(self) -> str:
        return ""

    def get_example_turns(self) -> list[dict[str, str]]:
        """Optional few-shot chat turns placed between the system prompt and the first user message."""
        return []

    def reset(self, **kwargs: Any) -> str:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources held by this episode."""

    # Data: a game with generated tasks overrides `generate_task`; static datasets need neither.
    @classmethod
    def generate_task(cls, rng: Any, **config: Any) -> dict[str, Any]:
        raise NotImplementedError(f"{cls.__name__} has no task generator: give the environment a dataset")
