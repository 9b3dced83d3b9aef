"""The environment API users implement. Environments see text (and images), never tokens or models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from opentinker.env.observation import Observation

SEED_KEY = "__seed__"
"""The one key of a data-free game's task: the seed its host sets before `reset` (see env.hosting)."""

UNAVAILABLE = "__unavailable__"
"""Key of the sentinel task a served environment gives when no shard answered (see env.remote)."""


@dataclass
class StepResult:
    """What one environment step returns; `observation` is text, or an Observation with images."""

    observation: str | Observation
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class ToolFailure(Exception):
    """A failed call of a GameTool whose message the model reads (opentinker.tools' ToolError)."""


@dataclass
class GameTool:
    """A tool declared by code below opentinker.tools (which this layer may not import): the fields
    of opentinker.tools.declared.Tool, whose `as_tools` takes either; `run` raises ToolFailure for
    a failure the model should read."""

    name: str
    description: str
    run: Callable[[dict[str, Any]], str]
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = 30.0


def seed_task(rng: Any) -> dict[str, Any]:
    """A data-free episode's task: only a seed drawn from the environment's generator."""
    return {SEED_KEY: int(rng.integers(2**31 - 1))}


class AbstractGame:
    """One episode's game logic. A new instance serves each episode.

    `reset(**task)` receives one task from the environment's data source (e.g. a math problem)
    and returns the initial observation; when `get_initial_user_message` returns "" the
    observation is the first user message. `step(action)` receives the model's text. An
    observation is text, or an `Observation(text, images)` whose PIL images the policy sees
    before the text (vision-language policies).

    Data: a static dataset needs nothing here; a game with generated tasks overrides
    `generate_task`; a data-free game needs neither: its `reset()` draws its own start, from
    Python's and numpy's generators (seeded per episode by its host, so validation episodes are
    the same every time), optionally through `generate_initial_state()`, whose dict is passed to
    `reset` as keyword arguments.
    """

    def get_system_prompt(self) -> str:
        return ""

    def get_initial_user_message(self) -> str:
        return ""

    def get_example_turns(self) -> list[dict[str, str]]:
        """Optional few-shot chat turns placed between the system prompt and the first user message."""
        return []

    def reset(self, **kwargs: Any) -> str | Observation:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources held by this episode."""

    def get_tools(self) -> list[Any]:
        """The tools this episode's model may call, called after reset: opentinker.tools' Tools
        (or GameTools), each run against this episode's own state. Default: none."""
        return []

    @classmethod
    def generate_task(cls, rng: Any, **config: Any) -> dict[str, Any]:
        """One task (keyword arguments of `reset`) drawn from `rng`, a numpy Generator. The
        default, for data-free games: a seed task."""
        return seed_task(rng)


class AbstractMatch:
    """A game for several players, each seat a policy (self-play); text only, like AbstractGame.

    `players` in turn order; `current_player` moves next until `finished`. `apply` never raises
    on bad model text: it returns (legal, message), the message shown to that player when the
    move was refused. `result_for` is the zero-sum result (+1 win, -1 loss, 0 draw), `info_for`
    the player's counts. Optional: `example_turns(player)`, few-shot exchanges shown first.
    """

    players: tuple[str, ...]
    current_player: str
    finished: bool

    def reset(self, **task: Any) -> str:
        raise NotImplementedError

    def system_prompt(self, player: str) -> str:
        raise NotImplementedError

    def observation_for(self, player: str) -> str:
        raise NotImplementedError

    def apply(self, player: str, action: str) -> tuple[bool, str]:
        raise NotImplementedError

    def result_for(self, player: str) -> float:
        raise NotImplementedError

    def info_for(self, player: str) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def generate_task(cls, rng: Any, **config: Any) -> dict[str, Any]:
        return seed_task(rng)
