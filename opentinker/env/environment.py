"""GameEnvironment: a game class paired with its data source and train/validation splits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from opentinker.env.base import UNAVAILABLE, AbstractGame, AbstractMatch

# Keys GameEnvironment reads itself; every other key of the environment config goes to the
# game's task generator.
_OWN_KEYS = {"dataset", "data_path", "val_dataset", "val_data_path", "val_fraction", "val_size", "epoch_size", "game_kwargs", "seed"}


def _env_config(config: Any) -> tuple[dict[str, Any], int]:
    """(environment config, seed) from what the reference client passes as `config`: the job's own
    args (a JobSpec, a dict or an argparse/omegaconf namespace, whose `env.config` or `env_config`
    is the environment's part), or an environment config given directly."""
    from opentinker.core.spec import JobSpec
    from opentinker.core.spec_input import config_to_dict

    if isinstance(config, JobSpec):
        return dict(config.env.config), config.seed
    if config is None:
        return {}, 0
    data = config_to_dict(config)
    if isinstance(data.get("env"), dict):
        cfg = dict(data["env"].get("config") or {})
    elif "env_config" in data:
        cfg = dict(data["env_config"] or {})
    elif set(data) & (set(JobSpec.model_fields) - {"seed"}):  # job args without an environment part
        cfg = {}
    else:
        cfg = data
    return cfg, int(cfg.get("seed", data.get("seed", 0)))


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
    `generate_task(rng, **config)` with `val_size` held-out tasks the training stream never repeats;
    a data-free game (no generator) gets seed tasks, the validation seeds fixed by the job's seed.
    An epoch is the training set, or `epoch_size` episodes (default `val_size`) without one.
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
        # The same config with files read in: what a job elsewhere needs to draw the same tasks.
        self.portable_config = {k: v for k, v in cfg.items() if k not in ("data_path", "val_data_path")}
        self.portable_config |= {k: list(v) for k, v in (("dataset", train), ("val_dataset", val)) if v is not None}
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
        self.epoch_size = len(self._static) if self._static is not None else int(cfg.get("epoch_size", cfg.get("val_size", 64)))

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


def import_game(path: str, allowed: tuple[str, ...] | None = None) -> type:
    """Resolve 'package.module:ClassName' into an AbstractGame (or AbstractMatch) subclass.
    With `allowed` (module prefixes, e.g. ("envs",)), a module outside them is refused before
    anything is imported: importing runs code, and workers run only the operator's."""
    import importlib

    module_name, _, attr = path.partition(":")
    if not (module_name and attr):
        raise ValueError(f"env.game: {path!r} must look like 'package.module:ClassName'")
    if allowed is not None and not any(module_name == p or module_name.startswith(p + ".") for p in allowed):
        raise ValueError(f"env.game: {module_name!r} is not among the environments this service runs "
                         f"({', '.join(f'{p}.*' for p in allowed)}); keep your game in your own process "
                         "(ServiceClient.fit with a GameEnvironment) or serve it (opentinker env serve) and give env.url")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"env.game: cannot import module {module_name!r}: {err}") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"env.game: module {module_name!r} has no {attr!r}") from None
    if not (isinstance(found, type) and issubclass(found, (AbstractGame, AbstractMatch))):
        raise ValueError(f"env.game: {path} is not an AbstractGame subclass")
    return found


def check_players(game_class: Any, players: list[str] | tuple[str, ...]) -> None:
    """A self-play spec's `multiagent.players` must name its match's players (the seats are theirs:
    a name the match never says moves would leave every match unplayable); ValueError, one line. A
    served match (env.url, env.link) states its players only as it plays: not checked here."""
    own = getattr(game_class, "players", None)
    if isinstance(own, tuple) and own and sorted(own) != sorted(players):
        name = getattr(game_class, "__name__", str(game_class))
        raise ValueError(f"multiagent.players: {list(players)} are not the players of {name} ({', '.join(own)})")


def environment_from_spec(spec: Any, job_id: str | None = None) -> GameEnvironment:
    """The spec's game: a shipped class imported here (`env.game`, only from the operator's
    allowlist), a served environment (`env.url`; an OpenEnv server with `env.protocol: openenv`) or
    the user's own process through the gateway (`env.link`). The job shows its job token to all but the first.
    Served environments are checked against this machine's OPENTINKER_ENV_URL_ALLOW before any request
    (the gateway checked it too, but a spec may come without it: `opentinker run`, an edited spec)."""
    from opentinker.core.settings import get_settings
    from opentinker.core.tokens import job_token

    env, settings = spec.env, get_settings()
    job_id = job_id or spec.job_id
    if env.game:
        game_class = import_game(env.game, settings.allowed_games)
    else:
        settings.env_hosts.check(env.urls)  # ValueError, one line; nothing was sent
        token = job_token(settings.stack_secret(), job_id) if job_id else None
        if env.url and env.protocol == "openenv":  # an OpenEnv server (openenv-core): see env.openenv_client
            try:
                from opentinker.env.openenv_client import OpenEnvGameClass
            except ImportError as err:
                raise ValueError(f"env.protocol: openenv needs openenv-core where the job runs (pip install 'opentinker[openenv]'): {err}") from None
            game_class = OpenEnvGameClass(env.urls, env.timeout_s, env.retries, token, settings.env_hosts)
        elif env.url:  # the HTTP clients load only here: a job with a shipped game needs no httpx
            from opentinker.env.remote import RemoteGameClass

            game_class = RemoteGameClass(env.urls, env.timeout_s, env.retries, token, settings.env_hosts)
        else:
            from opentinker.env.linked import LinkedGameClass

            if not job_id:
                raise ValueError("env.link: a linked game needs the job's id")
            game_class = LinkedGameClass(settings.gateway_url, job_id, token, env.link, env.timeout_s, env.link_timeout_s)
    return GameEnvironment(game_class=game_class, config=spec, job_id=job_id)


def save_dataset(tasks: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(t) + "\n" for t in tasks))
