"""A job's environment as the spec's `env` section: a GameEnvironment's game, a served
environment's URL, or an env dict as given."""

from __future__ import annotations

from typing import Any

from opentinker.core.spec_input import env_config_of


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
    cfg = env_config_of(config)
    if urls:
        return {"url": list(urls), "config": cfg}
    module, name = getattr(game_class, "__module__", None), getattr(game_class, "__qualname__", None)
    if not module or not name or module == "__main__" or "<locals>" in name:
        raise ValueError(
            f"{name or game_class!r} is defined in a script, so the worker cannot import it: move it into a module "
            "on the worker's path, or serve it with `opentinker env serve module:Class` and pass its URL"
        )
    return {"game": f"{module}:{name}", "config": cfg}


