"""GameEnvironment: a game class paired with its data source and train/validation splits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from opentinker.env.base import AbstractGame
from opentinker.env.remote import UNAVAILABLE, RemoteGameClass

# Keys GameEnvironment reads itself; every other key of the environment config goes to the
# game's task generator.
_OWN_KEYS = {"dataset", "data_path", "val_dataset", "val_data_path", "val_fraction", "val_size", "game_kwargs", "seed"}


def _env_config(config: Any) -> tuple[dict[str, Any], int]:
    """Accept a JobSpec, a plain dict, or an argparse-style namespace, as the reference client does."""
    from opentinker.core.spec import JobSpec

    if isinstance(config, JobSpec):
        return dict(config.env.config), config.seed
    if config is None:
        return {}, 0
    if not isinstance(config, dict):
        config = dict(vars(config))
    cfg = dict(config.get("env_config", config))
    return cfg, int(cfg.get("seed", config.get("seed", 0)))


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    import fsspec

    with fsspec.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _task_key(task: dict[str, Any]) -> str:
    return json.dumps(task, sort_keys=True, default=str)


class GameEnvironment:
    """Serves tasks to episodes: a seeded stream for training and a fixed validation split.

    Data comes from a static dataset (`dataset` list or `data_path` JSONL; a `val_fraction` of it
    held out unless `val_data_path` is given) or, when neither is set, from the game's own
    `generate_task(rng, **config)` with `val_size` held-out tasks the training stream never repeats.
    A served environment that cannot draw the validation set stops the job here; a training
    task it cannot draw later fails only its episodes (see `opentinker.env.remote`).
    """

    def __init__(self, game_class: type[AbstractGame] | Callable[..., AbstractGame], config: Any = None, job_id: str | None = None):
        self.game_class = game_class
        self.job_id = job_id
        cfg, self.seed = _env_config(config)
        self.game_kwargs: dict[str, Any] = dict(cfg.get("game_kwargs", {}))
        self.generator_config = {k: v for k, v in cfg.items() if k not in _OWN_KEYS and k != "env_config"}
        self._rng = np.random.default_rng(self.seed)
        self.tasks_drawn = 0

        train = cfg.get("dataset") or (_read_jsonl(cfg["data_path"]) if cfg.get("data_path") else None)
        val = cfg.get("val_dataset") or (_read_jsonl(cfg["val_data_path"]) if cfg.get("val_data_path") else None)
        self._static: list[dict[str, Any]] | None = None
        if train is not None:
            train = list(train)
            if val is None:
                order = np.random.default_rng(self.seed + 1).permutation(len(train))
                n_val = int(round(len(train) * float(cfg.get("val_fraction", 0.1))))
                val = [train[i] for i in order[:n_val]]
                train = [train[i] for i in order[n_val:]]
            if not train:
                raise ValueError("the environment's dataset has no training tasks")
            self._static = train
            self._validation = list(val)
        else:
            val_rng = np.random.default_rng([self.seed, 7919])
            n_val = int(cfg.get("val_size", 64))
            self._validation = self._distinct_tasks(val_rng, n_val)
        self._val_keys = {_task_key(t) for t in self._validation}

    # -- episodes -------------------------------------------------------------------------
    def make_game(self) -> AbstractGame:
        return self.game_class(**self.game_kwargs)

    # -- data -----------------------------------------------------------------------------
    def _distinct_tasks(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(n * 50):
            task = self.game_class.generate_task(rng, **self.generator_config)
            if UNAVAILABLE in task:  # a served environment that does not answer: the job cannot start
                raise RuntimeError(f"env.url: {task[UNAVAILABLE]}")
            seen.setdefault(_task_key(task), task)
            if len(seen) == n:
                break
        return list(seen.values())

    def validation_tasks(self, n: int | None = None) -> list[dict[str, Any]]:
        return self._validation[:n] if n else list(self._validation)

    def train_tasks(self, n: int) -> list[dict[str, Any]]:
        """The next n training tasks; the position is part of `state()` so resume continues it."""
        out = []
        for _ in range(n):
            out.append(self._next_task())
            self.tasks_drawn += 1
        return out

    def _next_task(self) -> dict[str, Any]:
        if self._static is not None:
            epoch, pos = divmod(self.tasks_drawn, len(self._static))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self._static))
            return self._static[order[pos]]
        for _ in range(1000):
            task = self.game_class.generate_task(self._rng, **self.generator_config)
            if _task_key(task) not in self._val_keys:
                return task
        raise RuntimeError("the task generator only produces validation tasks: widen its ranges")

    def state(self) -> dict[str, Any]:
        return {"tasks_drawn": self.tasks_drawn, "rng": self._rng.bit_generator.state}

    def load_state(self, state: dict[str, Any]) -> None:
        self.tasks_drawn = int(state["tasks_drawn"])
        self._rng.bit_generator.state = state["rng"]

    def __repr__(self) -> str:
        name = getattr(self.game_class, "__name__", str(self.game_class))
        return f"GameEnvironment({name}, job_id={self.job_id!r}, validation={len(self._validation)})"


def import_game(path: str) -> type[AbstractGame]:
    """Resolve 'package.module:ClassName' into the class."""
    import importlib

    module_name, _, attr = path.partition(":")
    if not (module_name and attr):
        raise ValueError(f"env.game: {path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"env.game: cannot import module {module_name!r}: {err}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"env.game: module {module_name!r} has no {attr!r}") from None


def environment_from_spec(spec: Any) -> GameEnvironment:
    """The spec's game: imported in-process (`env.game`) or served over HTTP (`env.url`)."""
    env = spec.env
    game_class = RemoteGameClass(env.urls, env.timeout_s, env.retries) if env.url else import_game(env.game)
    return GameEnvironment(game_class=game_class, config=spec, job_id=spec.job_id)


def save_dataset(tasks: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(t) + "\n" for t in tasks))
