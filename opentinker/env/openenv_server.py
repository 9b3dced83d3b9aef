"""Serve an OpenEnv `Environment` class with OpenEnv's own app factory (`openenv.core.env_server.create_app`),
so OpenEnv clients (TRL, open-instruct, `EnvClient`) and our jobs (`env: {url, protocol: openenv}`) both
use it. We add only what our servers wear: the job token on every path but /health (HTTP and the
/ws WebSocket alike), a cap on request bodies and on WebSocket messages.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from typing import Any

from opentinker.core.asgi import BearerToken, BodyLimit


def import_class(path: str, what: str) -> type:
    """'package.module:ClassName' (the user's own code, on the user's machine); ValueError in one line."""
    module_name, _, attr = path.partition(":")
    if not (module_name and attr):
        raise ValueError(f"{what}: {path!r} must look like 'package.module:ClassName'")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except ImportError as err:
        raise ValueError(f"{what}: cannot import module {module_name!r}: {err}") from None
    except AttributeError:
        raise ValueError(f"{what}: module {module_name!r} has no {attr!r}") from None
    if not isinstance(found, type):
        raise ValueError(f"{what}: {path} is not a class")
    return found


def openenv_types(env_cls: type, action_cls: type | None = None, observation_cls: type | None = None) -> tuple[type, type]:
    """The environment's (Action, Observation) classes: as given, else from its generic base
    (`Environment[MyAction, MyObservation, State]`), else from `step`'s annotations."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation

    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ValueError(f"{getattr(env_cls, '__name__', env_cls)!r} is not an OpenEnv Environment subclass")
    found: dict[type, type] = {}
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Environment:
                args = [a for a in typing.get_args(base) if isinstance(a, type)]
                found |= {kind: a for a in args for kind in (Action, Observation) if issubclass(a, kind) and kind not in found}
    if len(found) < 2:
        try:
            hints = typing.get_type_hints(env_cls.step)
        except Exception:  # noqa: BLE001 - unresolvable annotations: ask for the classes instead
            hints = {}
        action_param = next(iter(list(inspect.signature(env_cls.step).parameters)[1:2]), None)
        for kind, hint in ((Action, hints.get(action_param)), (Observation, hints.get("return"))):
            if kind not in found and isinstance(hint, type) and issubclass(hint, kind):
                found[kind] = hint
    chosen = []
    for given, kind, flag in ((action_cls, Action, "--action"), (observation_cls, Observation, "--observation")):
        if given is not None and not (isinstance(given, type) and issubclass(given, kind)):
            raise ValueError(f"{flag}: {getattr(given, '__name__', given)} is not an OpenEnv {kind.__name__} subclass")
        if given is None and kind not in found:
            raise ValueError(f"cannot tell {env_cls.__name__}'s {kind.__name__} class from its annotations: give {flag} package.module:Class")
        chosen.append(given or found[kind])
    return chosen[0], chosen[1]


def create_openenv_app(env_cls: type, action_cls: type | None = None, observation_cls: type | None = None,
                       tokens: list[str] | None = None, max_sessions: int | None = None, max_request_bytes: int = 1024**2) -> Any:
    """OpenEnv's app for `env_cls`; `max_sessions` concurrent episodes (default: 64 when the class says
    SUPPORTS_CONCURRENT_SESSIONS, else 1, as OpenEnv requires). With `tokens`, every request and
    WebSocket but /health must carry one (`Authorization: Bearer …`)."""
    from openenv.core.env_server.exceptions import OpenEnvError
    from openenv.core.env_server.http_server import create_app

    action_cls, observation_cls = openenv_types(env_cls, action_cls, observation_cls)
    if max_sessions is None:
        max_sessions = 64 if getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    try:
        app = create_app(env_cls, action_cls, observation_cls, env_name=env_cls.__name__, max_concurrent_envs=max_sessions)
    except OpenEnvError as err:  # e.g. more than one session for a class that does not support it
        raise ValueError(str(err).splitlines()[0]) from None
    guarded = BodyLimit(app, max_request_bytes)
    return BearerToken(guarded, lambda: tokens) if tokens else guarded


def serve_openenv(env_path: str, host: str = "127.0.0.1", port: int = 8300, tokens: list[str] | None = None,
                  action: str | None = None, observation: str | None = None, max_sessions: int | None = None) -> None:
    """Import and serve until interrupted (WebSocket messages capped like request bodies)."""
    import uvicorn

    app = create_openenv_app(import_class(env_path, "environment"), action and import_class(action, "--action"),
                             observation and import_class(observation, "--observation"), tokens, max_sessions)
    uvicorn.run(app, host=host, port=port, access_log=False, timeout_keep_alive=75, ws_max_size=1024**2)
