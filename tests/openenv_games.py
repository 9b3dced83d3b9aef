"""Tiny OpenEnv environments (openenv-core's own base types) for tests/test_openenv.py: importable by
path, so `opentinker env serve --openenv tests.openenv_games:GuessEnv` can serve them too."""

from __future__ import annotations

import random
import threading
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field, field_validator


class EchoAction(Action):
    message: str = Field(..., min_length=1, pattern=r"^[^#]*$", description="what to say (no '#')")

    @field_validator("message")
    @classmethod
    def _polite(cls, v: str) -> str:
        """A rule JSON schema cannot state: only the server's own validation sees it."""
        if "rude" in v:
            raise ValueError("no rude words")
        return v


class EchoObservation(Observation):
    echoed_message: str = ""


class EchoEnv(Environment):
    """One text field each way (the shape of OpenEnv's echo template): reward 1 for saying 'stop', which ends it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed_message=f"ready (seed {seed})")

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **kwargs: Any) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        stop = action.message.strip() == "stop"
        return EchoObservation(echoed_message=action.message, reward=1.0 if stop else 0.0, done=stop)

    @property
    def state(self) -> State:
        return self._state


class GuessAction(Action):
    guess: int = Field(..., ge=0, le=9)
    note: str = ""


class GuessObservation(Observation):
    hint: str = ""
    tries: int = 0


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Typed JSON actions: guess a digit drawn from the reset's seed; 'higher'/'lower' hints."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self._secret = State(step_count=0), 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(hint="guess a digit")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        if action.guess == self._secret:
            return GuessObservation(hint="right", tries=self._state.step_count, reward=1.0, done=True)
        hint = "higher" if action.guess < self._secret else "lower"
        return GuessObservation(hint=hint, tries=self._state.step_count, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


RELEASE = threading.Event()  # set by the test's teardown: the hanging env's thread returns


class TroubleEnv(EchoEnv):
    """'boom' raises in step, 'hang' blocks until the test releases it; anything else echoes."""

    def step(self, action: EchoAction, timeout_s: Optional[float] = None, **kwargs: Any) -> EchoObservation:  # type: ignore[override]
        if action.message == "boom":
            raise RuntimeError("the environment broke")
        if action.message == "hang":
            RELEASE.wait(60)
        return super().step(action)


class PlainEnv(Environment):
    """No annotations and one session at a time: the command line must be told its types."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        return EchoObservation(echoed_message="ready")

    def step(self, action, timeout_s=None, **kwargs):
        return EchoObservation(echoed_message=action.message, done=True)

    @property
    def state(self) -> State:
        return State(step_count=0)
