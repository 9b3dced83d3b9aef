"""Turn what a user hands the clients (a spec, a dict, a YAML path, argparse/omegaconf args)
into the spec dict the gateway validates, and an environment into the spec's env section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def config_to_dict(config: Any) -> dict[str, Any]:
    from opentinker.spec import JobSpec

    if isinstance(config, JobSpec):
        return config.model_dump(mode="json", exclude_none=True)
    if isinstance(config, (str, Path)):
        return dict(yaml.safe_load(Path(config).read_text()) or {})
    if isinstance(config, dict):
        return dict(config)
    try:  # omegaconf DictConfig, as in the reference design's scripts
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return dict(OmegaConf.to_container(config, resolve=True))
    except ImportError:
        pass
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise TypeError(f"config must be a JobSpec, a dict, a YAML path or an args object, not {type(config).__name__}")


def env_section(env: Any, config: Any = None) -> dict[str, Any]:
    """The spec's `env` for a GameEnvironment, a served environment (its URL), or an env dict.

    A game class must be importable on the worker: a class defined in `__main__` is not.
    """
    if isinstance(env, dict):
        return env
    if isinstance(env, str):
        return {"url": env} if env.startswith(("http://", "https://")) else {"game": env}
    game_class = getattr(env, "game_class", env)
    urls = getattr(game_class, "urls", None)
    cfg = _env_config_of(config)
    if urls:
        return {"url": list(urls), "config": cfg}
    module, name = getattr(game_class, "__module__", None), getattr(game_class, "__qualname__", None)
    if not module or not name or module == "__main__" or "<locals>" in name:
        raise ValueError(
            f"{name or game_class!r} is defined in a script, so the worker cannot import it: move it into a module "
            "on the worker's path, or serve it with `opentinker env serve module:Class` and pass its URL"
        )
    return {"game": f"{module}:{name}", "config": cfg}


def _env_config_of(config: Any) -> dict[str, Any]:
    """The environment's data-source config inside a job config: `env.config` or `env_config`."""
    if config is None:
        return {}
    data = config_to_dict(config)
    env = data.get("env") or {}
    return dict(env.get("config") or data.get("env_config") or {})
