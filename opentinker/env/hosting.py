"""Starting an episode the way every host does it: in the job's process, in an environment
server, or in the user's own process behind the client link.

A data-free game's task is only a seed (`SEED_KEY`): the host seeds Python's and numpy's
generators with it, draws the start from `generate_initial_state()` when the game defines one
and `reset` takes keyword arguments, and passes the seed to `reset` when it takes one. Seeded
starts run one at a time (episodes start concurrently, and the generators are global), so the
same seed gives the same episode: validation is reproducible.
"""

from __future__ import annotations

import inspect
import random
import threading
from typing import Any

from opentinker.env.base import SEED_KEY

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


def start_episode(game: Any, task: dict[str, Any]) -> str:
    """`game.reset` for `task` (see the module docstring); the initial observation, checked to be text.
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
            import numpy as np

            np.random.seed(seed % 2**32)
            initial = getattr(game, "generate_initial_state", None)
            if initial is not None and not task and _keywords(game.reset) != (set(), False):
                state = initial()
                if not isinstance(state, dict):
                    raise TypeError(f"generate_initial_state returned {type(state).__name__}, expected a dict of reset's keyword arguments")
                task = state
            observation = game.reset(**_fitting(game.reset, {**task, "seed": seed}) if "seed" not in task else task)
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {type(observation).__name__}, expected str")
    return observation
