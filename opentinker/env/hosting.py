"""Hosting games: what every host does the same way, in the job's process, in an environment
server (opentinker.env.server), or in the user's own process behind the client link
(opentinker.client.link): start an episode, step it, draw a task, and answer in plain JSON.

A data-free game's task is only a seed (`SEED_KEY`): the host seeds Python's and numpy's
generators with it, draws the start from `generate_initial_state()` when the game defines one
and `reset` takes keyword arguments, and passes the seed to `reset` when it takes one. Seeded
starts run one at a time (episodes start concurrently, and the generators are global), so the
same seed gives the same episode: validation is reproducible.
"""

from __future__ import annotations

import inspect
import json
import random
import threading
from typing import Any

import numpy as np

from opentinker.env.base import SEED_KEY, AbstractGame, StepResult
from opentinker.env.observation import Observation, as_observation, to_wire

# Bit generators a caller may hand over by state; never an arbitrary attribute of numpy.random.
BIT_GENERATORS = {"PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937"}

_SEEDED = threading.Lock()


def _keywords(fn: Any) -> tuple[set[str], bool]:
    """(named keyword parameters, whether it takes **kwargs) of a callable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _fitting(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    names, any_name = _keywords(fn)
    return dict(kwargs) if any_name else {k: v for k, v in kwargs.items() if k in names}


def checked_observation(value: Any, what: str = "observation") -> str | Observation:
    """What a game returned as an observation, checked (see env.observation): text stays a
    string, an Observation keeps its images only when it has some."""
    observation = as_observation(value, what)
    return observation if observation.images else observation.text


def start_episode(game: Any, task: dict[str, Any]) -> str | Observation:
    """`game.reset` for `task` (see the module docstring); the initial observation, checked.
    A game hosted elsewhere (`hosted_elsewhere`) gets the task as it is: its host does this."""
    if getattr(game, "hosted_elsewhere", False):
        observation = game.reset(**task)
    elif SEED_KEY not in task:
        observation = game.reset(**task)
    else:
        task = dict(task)
        seed = int(task.pop(SEED_KEY))
        with _SEEDED:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            initial = getattr(game, "generate_initial_state", None)
            if initial is not None and not task and _keywords(game.reset) != (set(), False):
                state = initial()
                if not isinstance(state, dict):
                    raise TypeError(f"generate_initial_state returned {type(state).__name__}, expected a dict of reset's keyword arguments")
                task = state
            observation = game.reset(**_fitting(game.reset, {**task, "seed": seed}) if "seed" not in task else task)
    return checked_observation(observation, "reset's observation")


def plain_json(value: Any) -> Any:
    """JSON-safe copy of what game code returned (numpy scalars and arrays included); a NaN
    fails here, where the caller turns it into one failed episode."""

    def default(x: Any) -> Any:
        if isinstance(x, (np.generic, np.ndarray)):
            return x.tolist()
        raise TypeError(f"{type(x).__name__} is not JSON serializable")

    return json.loads(json.dumps(value, default=default, allow_nan=False))


def generator_from_state(state: dict[str, Any]) -> np.random.Generator:
    """A numpy Generator continuing a caller's generator (ValueError for anything else)."""
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in BIT_GENERATORS:
        raise ValueError(f"unknown bit generator {name!r}")
    bit_generator = getattr(np.random, name)()
    try:
        bit_generator.state = state
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"invalid rng_state: {err}") from None
    return np.random.Generator(bit_generator)


def prompts_of(game: AbstractGame) -> dict[str, Any]:
    """Sent after every reset, since a prompt may depend on the task."""
    return plain_json({"system_prompt": game.get_system_prompt(), "initial_user_message": game.get_initial_user_message(),
                       "example_turns": game.get_example_turns()})


def reset_reply(game: AbstractGame, task: dict[str, Any]) -> dict[str, Any]:
    return {"observation": to_wire(start_episode(game, task)), **prompts_of(game)}


def step_reply(game: AbstractGame, action: str) -> dict[str, Any]:
    result = game.step(action)
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__}, expected StepResult")
    observation = to_wire(checked_observation(result.observation))
    return {"observation": observation, **plain_json({"reward": result.reward, "done": result.done, "info": result.info})}


def generate_reply(game_class: Any, rng: np.random.Generator, config: dict[str, Any]) -> dict[str, Any]:
    """A task drawn by the game's generator, and the generator's state after it (the caller
    continues from there, so a hosted game draws the same stream as one in the job's process)."""
    return {"task": plain_json(game_class.generate_task(rng, **config)), "rng_state": rng.bit_generator.state}
