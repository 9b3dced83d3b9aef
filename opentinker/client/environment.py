"""A job's environment as the spec's `env` section, seen from the client.

A game the service runs itself (a shipped one, under the gateway's allowlist) goes by import
path; a served environment by URL; any other game (the user's own class, in a script or a
notebook) stays in this process and is reached through the client link (`env.link`), with the
environment's config made portable (datasets read in, so the job draws the same tasks).
"""

from __future__ import annotations

from typing import Any

from opentinker.core.spec_input import env_config_of


def env_section(env: Any, config: Any = None, allowed: tuple[str, ...] = ("envs",)) -> dict[str, Any]:
    """The spec's `env` for a GameEnvironment, a game class, a served environment (its URL), or an env dict."""
    if isinstance(env, dict):
        return env
    if isinstance(env, str):
        return {"url": env} if env.startswith(("http://", "https://")) else {"game": env}
    game_class = getattr(env, "game_class", env)
    cfg = dict(getattr(env, "portable_config", None) or env_config_of(config))
    urls = getattr(game_class, "urls", None)
    if urls:
        return {"url": list(urls), "config": cfg}
    module, name = getattr(game_class, "__module__", "") or "", getattr(game_class, "__qualname__", "") or ""
    if module and name and "<locals>" not in name and any(module == p or module.startswith(p + ".") for p in allowed):
        return {"game": f"{module}:{name}", "config": cfg}
    return {"link": _link_name(name or type(game_class).__name__), "config": cfg}


def hosted_game(env: Any) -> tuple[type, dict[str, Any]]:
    """(game class, its keyword arguments) that the client hosts for a linked environment."""
    return getattr(env, "game_class", env), dict(getattr(env, "game_kwargs", None) or {})


def _link_name(name: str) -> str:
    clean = "".join(c if c.isalnum() or c in "_." else "_" for c in name.replace("<locals>.", ""))
    return clean if clean[:1].isalpha() or clean[:1] == "_" else f"game_{clean}"
