"""Environments from collections people already use, named by a spec (`env.source`) and played by
the operator's adapter game in `envs/`.

`env: {source: reasoning_gym, dataset: chain_sum, config: {...}}` resolves here to the adapter's
`env.game` with the dataset under `env.config.rg_dataset`, so the runtime sees a shipped game like
any other. What a tenant names (a dataset, its config, the game's prompt) is checked here, before the
job is submitted, with reasoning-gym's own words. Tenants name data; they never choose code: datasets
whose scoring evaluates the model's text as Python are refused, and so is a config key naming a file.
"""

from __future__ import annotations

import json
from functools import lru_cache
from numbers import Real
from typing import Any

REASONING_GYM_GAME = "envs.reasoning_gym:ReasoningGymGame"
DATASET_KEY = "rg_dataset"
"""The key of `env.config` that names the adapter's dataset (or weighted mix)."""

POOL_SIZE = 10_000
"""Default `env.config.size`: a job's tasks are items 0..size-1 of one seeded reasoning-gym
dataset, the job's seed picks which (a few datasets precompute all `size` items when built)."""

MAX_POOL_SIZE = 1_000_000
POOL_SEED = 0
"""reasoning-gym's own `seed` of the pool (the job's seed draws from it; `env.config.seed` is the
environment's seed, as for every game)."""

GAME_KWARGS = ("system_prompt", "answer_tag")  # text
MAX_FEW_SHOT = 8  # game_kwargs.few_shot: example exchanges shown first (0 to this)
ENVIRONMENT_KEYS = frozenset({"dataset", "data_path", "val_dataset", "val_data_path", "val_fraction", "val_size",
                              "epoch_size", "game_kwargs", "seed"})
"""GameEnvironment's own keys of `env.config` (opentinker.env.environment); the rest is the dataset's."""

_EVAL = "its score_answer runs eval() on the model's text"
_SYMPY = "its score_answer runs sympy's parse_expr (an eval) on the model's text"
REFUSED = {"binary_matrix": _EVAL, "n_queens": _EVAL, "spiral_matrix": _EVAL, "string_insertion": _EVAL,
           "countdown": _SYMPY, "intermediate_integration": _SYMPY, "polynomial_multiplication": _SYMPY,
           "puzzle24": _SYMPY, "simple_integration": _SYMPY,
           "composite": "give a mix as a mapping in env.dataset ({name: weight, ...})"}
"""Registered datasets a tenant may not name, with the reason: the model's text is the tenant's."""

REFUSED_KEYS = {"data_file": "it names a file on the worker"}


def registered() -> list[str]:
    """reasoning-gym's registered datasets that train here (its registry, less REFUSED)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError("reasoning-gym is not installed here (pip install 'opentinker[envs]')") from None

    return sorted(set(DATASETS) - set(REFUSED))


def resolve_source(env: Any) -> Any:
    """The spec's sugar: `source: reasoning_gym` + `dataset` become the adapter's game and config."""
    if not isinstance(env, dict) or env.get("source") != "reasoning_gym" or any(env.get(k) for k in ("url", "link")):
        return env
    if env.get("game") not in (None, REASONING_GYM_GAME):
        return env  # EnvSpec refuses it, naming env.source
    config = env.get("config") if isinstance(env.get("config"), dict) else {}
    return {**env, "game": REASONING_GYM_GAME, "config": {**config, DATASET_KEY: env.get("dataset")}}


def _name_problem(name: Any) -> str | None:
    if not isinstance(name, str):
        return f"a dataset is named by a string, got {type(name).__name__}"
    if name in REFUSED:
        return f"reasoning-gym dataset {name!r} is refused here: {REFUSED[name]}"
    known = registered()
    if name not in known:
        near = [k for k in known if k.split("_")[0] in name or name.split("_")[0] in k][:5] or known[:8]
        return f"unknown reasoning-gym dataset {name!r} (some: {', '.join(near)}; {len(known)} in all)"
    return None


def mix(dataset: Any) -> list[dict[str, Any]]:
    """`env.dataset` as reasoning-gym's DatasetSpec fields: [{name, weight, config}]; ValueError if malformed."""
    if isinstance(dataset, str):
        items = [(dataset, {"weight": 1.0, "config": {}})]
    elif isinstance(dataset, dict) and dataset:
        items = [(k, {"weight": v, "config": {}} if isinstance(v, Real) and not isinstance(v, bool) else v) for k, v in dataset.items()]
    else:
        raise ValueError("name a reasoning-gym dataset (e.g. chain_sum) or a weighted mix ({chain_sum: 2, leg_counting: 1})")
    out = []
    for name, entry in items:
        if problem := _name_problem(name):
            raise ValueError(problem)
        if not isinstance(entry, dict) or set(entry) - {"weight", "config"} or not isinstance(entry.get("config", {}), dict):
            raise ValueError(f"{name}: give a weight, or {{weight: w, config: {{...}}}}")
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, Real) or isinstance(weight, bool) or not 0 < weight < float("inf"):
            raise ValueError(f"{name}: the weight must be a positive number, got {weight!r}")
        out.append({"name": name, "weight": float(weight), "config": dict(entry.get("config", {}))})
    return out


@lru_cache(maxsize=64)
def _build(key: str) -> Any:
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    parts, config = json.loads(key)
    for part in parts:
        for k in set(part["config"]) | (set(config) if len(parts) == 1 else set()):
            if k in REFUSED_KEYS:
                raise ValueError(f"{k}: refused here, {REFUSED_KEYS[k]}")
    size = int(config.pop("size", POOL_SIZE))
    if not 0 < size <= MAX_POOL_SIZE:
        raise ValueError(f"size: between 1 and {MAX_POOL_SIZE:,}, got {size}")
    if len(parts) == 1:
        return reasoning_gym.create_dataset(parts[0]["name"], **{**parts[0]["config"], **config, "seed": POOL_SEED, "size": size})
    if config:
        raise ValueError(f"{', '.join(sorted(config))}: a mix takes each dataset's config in env.dataset.<name>.config")
    return reasoning_gym.create_dataset("composite", seed=POOL_SEED, size=size, datasets=[DatasetSpec(**p) for p in parts])


def build_dataset(dataset: Any, config: dict[str, Any]) -> Any:
    """The reasoning-gym dataset (a ProceduralDataset; a CompositeDataset for a mix) that `dataset`
    and the dataset's part of `config` name, built once per process; ValueError in reasoning-gym's words."""
    parts = mix(dataset)
    try:
        return _build(json.dumps([parts, dict(config)], sort_keys=True))
    except (TypeError, AssertionError, ValueError, KeyError) as err:  # reasoning-gym's config errors
        raise ValueError(f"reasoning-gym {'/'.join(p['name'] for p in parts)}: {err}") from None


def check_config(config: dict[str, Any]) -> None:
    """A reasoning-gym environment's `env.config`, checked before submission (ValueError, one line)."""
    if static := sorted(k for k in ("dataset", "data_path", "val_dataset", "val_data_path", "val_fraction") if k in config):
        raise ValueError(f"{', '.join(static)}: a reasoning-gym environment draws its own tasks (use size and val_size)")
    kwargs = config.get("game_kwargs") or {}
    few = kwargs.get("few_shot", 0) if isinstance(kwargs, dict) else None
    if (not isinstance(kwargs, dict) or set(kwargs) - {*GAME_KWARGS, "few_shot"} or not all(isinstance(kwargs.get(k, ""), str) for k in GAME_KWARGS)
            or not isinstance(few, int) or isinstance(few, bool) or not 0 <= few <= MAX_FEW_SHOT):
        raise ValueError(f"game_kwargs: the reasoning-gym game takes {' and '.join(GAME_KWARGS)} (text) and few_shot "
                         f"(0 to {MAX_FEW_SHOT}), got {kwargs!r}")
    dataset_config = {k: v for k, v in config.items() if k not in ENVIRONMENT_KEYS and k != DATASET_KEY}
    size = dataset_config.get("size", POOL_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_POOL_SIZE:
        raise ValueError(f"size: a whole number between 1 and {MAX_POOL_SIZE:,}, got {size!r}")
    build_dataset(config.get(DATASET_KEY), {**dataset_config, "size": min(size, 8)})  # a small pool: the check stays fast


def check_env_field(name: str, value: Any, earlier: dict[str, Any]) -> Any:
    """EnvSpec's field checks (`earlier`: the fields validated before this one), kept here so the
    spec module stays a list of fields: an import path, http URLs, and a source with its dataset."""
    if name == "game" and value is not None and (":" not in value or not all(value.split(":", 1))):
        raise ValueError("must look like 'package.module:ClassName'")
    if name == "url":
        if value == []:
            raise ValueError("give at least one URL")
        for url in [value] if isinstance(value, str) else value or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} must start with http:// or https://")
    if name == "source" and value and (earlier.get("game") != REASONING_GYM_GAME or earlier.get("url") or earlier.get("link")):
        raise ValueError("names the environment itself: give it without env.game, env.url or env.link")
    if name == "dataset" and "source" in earlier:  # (a source that failed its own check says so alone)
        if earlier["source"] is None and value is not None:
            raise ValueError("give it with env.source (e.g. reasoning_gym), which it is a dataset of")
        if earlier["source"] is not None:
            mix(value)
    if name == "config" and earlier.get("game") == REASONING_GYM_GAME and "dataset" in earlier:
        check_config(value)
    return value
