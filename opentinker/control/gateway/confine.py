"""Everything a tenant names, confined to that tenant before a spec reaches Prefect.

- Files: checkpoints and job storage are forced into `<storage_url>/tenants/<tenant>`; a path a
  tenant gives (`model.init_from`, `env.config.data_path`, `val_data_path`, SFT `data.path`, an
  inference `model_path`) is taken relative to that folder, and an absolute path or URL must lie
  inside it (no `..`).
- Models: a `model.name` is a known name or a folder in the operator's model directory; a
  `models:/` name must be a registered model owned by the tenant (the `opentinker.tenant` tag the
  gateway's jobs set), and is pinned here to the checkpoint it names now.
- Code: `env.game` (or the adapter game an `env.source` names) only from the operator's allowlist,
  and an AbstractGame subclass (imported here, in the gateway: allowlisted modules only).
- Services: `env.url` may not point at the stack's own services (Prefect, MLflow, the gateway),
  nor at an address the operator has not allowed (OPENTINKER_ENV_URL_ALLOW: core/env_hosts.py);
  `rollout.server_url` is refused: a job's inference server is the one its worker starts (it
  would get the job's adapter folders and its key otherwise).
Refusals are SpecError lines (`field: reason`, HTTP 422) that name only what the tenant gave.
"""

from __future__ import annotations

import posixpath
from typing import Any
from urllib.parse import urlsplit

from opentinker.core.env_sources import resolve_source
from opentinker.core.model_names import KNOWN_MODELS
from opentinker.core.settings import Settings
from opentinker.core.spec import SpecError, storage_url


def tenant_storage(settings: Settings, tenant: str) -> str:
    return f"{settings.storage_url.rstrip('/')}/tenants/{tenant}"


def tenant_location(root: str, given: str, field: str) -> str:
    """`given` (relative to the tenant's `root`, or an absolute path or URL inside it) as a URL."""
    if not isinstance(given, str) or not given.strip():
        raise SpecError(f"{field}: must be a path or URL inside your storage")
    if "://" in given or given.startswith("/"):
        url = storage_url(given) if not given.startswith("/") else f"file://{posixpath.normpath(given)}"
    else:
        url = f"{root.rstrip('/')}/{given.strip('/')}"
    scheme, rest = url.split("://", 1)
    clean = f"{scheme}://{posixpath.normpath(rest) if scheme == 'file' else rest}"
    if ".." in rest.split("/") or not (clean.rstrip("/") + "/").startswith(root.rstrip("/") + "/"):
        raise SpecError(f"{field}: {given} is outside your storage ({root}); give a path inside it")
    return clean.rstrip("/")


def owned_checkpoint(settings: Settings, tenant: str, uri: str, field: str) -> str:
    """The checkpoint a `models:/` URI names, if the tenant owns the model; SpecError otherwise
    (the same words for a model of another tenant as for one that does not exist)."""
    from opentinker.storage.registry import resolve_model_uri

    try:
        return resolve_model_uri(uri, settings.mlflow_url, tenant=tenant)
    except Exception as err:  # noqa: BLE001 - missing, not owned, or unreachable: one line back
        raise SpecError(f"{field}: {uri}: {err}") from None


def checkpoint_location(settings: Settings, tenant: str, given: str, field: str) -> str:
    """A checkpoint a tenant may read: its own registered model (pinned) or a path in its storage."""
    if given.startswith("models:/"):
        return owned_checkpoint(settings, tenant, given, field)
    return tenant_location(tenant_storage(settings, tenant), given, field)


def model_name(settings: Settings, given: str) -> str:
    """A known model, or a folder of the operator's model directory (by name)."""
    if given in KNOWN_MODELS:
        return given
    folder = settings.models_folder
    try:
        candidate = (folder / given).resolve()
        found = "/" not in given and not given.startswith(".") and candidate.parent == folder and (candidate / "config.json").exists()
    except (OSError, ValueError):  # a name no file system takes (too long, a NUL)
        found = False
    if not found:
        raise SpecError(f"model.name: {given!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor a model "
                        "of this service's model folder")
    return str(candidate)


def game(settings: Settings, path: str, config: dict[str, Any] | None = None, players: list[str] | None = None) -> None:
    """Refuse a game the workers would not import (allowlist first: importing runs code), a
    config its class refuses (a game may check `env.config` with a `check_config` classmethod, e.g.
    the TextArena adapters refuse games that download data), and self-play `players` that are not
    the match's."""
    from opentinker.env.environment import check_players, import_game

    try:
        found = import_game(path, settings.allowed_games)
    except ValueError as err:
        raise SpecError(str(err)) from None
    try:
        getattr(found, "check_config", lambda _: None)(config or {})
    except ValueError as err:
        raise SpecError(f"env.config: {err}") from None
    if players is not None:
        try:
            check_players(found, players)
        except ValueError as err:
            raise SpecError(str(err)) from None


def env_url(settings: Settings, urls: list[str]) -> None:
    """Refuse a URL of the stack's own services, then one outside the operator's allowlist (workers
    check that again before their first request: a spec may reach them without the gateway)."""
    own = {settings.prefect_port, settings.mlflow_port, settings.gateway_port, settings.ray_port, settings.ray_client_port}
    local = {settings.host, settings.listen_host, settings.dial_host, "localhost", "127.0.0.1", "::1", "0.0.0.0"}
    for url in urls:
        parts = urlsplit(url)
        if parts.hostname in local and parts.port in own:
            raise SpecError(f"env.url: {url} is one of this service's own servers, not an environment")
        if why := settings.env_hosts.refusal(url):
            raise SpecError(why)


def confine_env(settings: Settings, tenant: str, env: dict[str, Any], players: list[str] | None = None) -> dict[str, Any]:
    """`players`: a self-play spec's `multiagent.players` (checked against its match's)."""
    env = dict(resolve_source(env))  # env.source names a shipped adapter game: the allowlist decides it too
    if env.get("game"):
        game(settings, env["game"], env.get("config"), players)
    if env.get("url"):
        env_url(settings, [env["url"]] if isinstance(env["url"], str) else list(env["url"]))
    config = dict(env.get("config") or {})
    root = tenant_storage(settings, tenant)
    for key in ("data_path", "val_data_path"):
        if config.get(key) is not None:
            config[key] = tenant_location(root, config[key], f"env.config.{key}")
    env["config"] = config
    return env


def confine_rollout(data: dict[str, Any]) -> None:
    if (data.get("rollout") or {}).get("server_url"):
        raise SpecError("rollout.server_url: jobs sample through the inference server their worker starts "
                        "(rollout.engine: server, without a URL)")


def confine_common(settings: Settings, tenant: str, data: dict[str, Any]) -> dict[str, Any]:
    """The sections RL and SFT specs share: storage, checkpoints, model and its init_from."""
    root = tenant_storage(settings, tenant)
    data["storage"] = {**dict(data.get("storage") or {}), "base_url": root}
    data["checkpoint"] = {**dict(data.get("checkpoint") or {}), "base_url": root}
    model = dict(data.get("model") or {})
    if isinstance(model.get("name"), str):
        model["name"] = model_name(settings, model["name"])
    if model.get("init_from"):
        model["init_from"] = checkpoint_location(settings, tenant, str(model["init_from"]), "model.init_from")
    data["model"] = model
    return data


def registry_name(settings: Settings, tenant: str, name: str) -> None:
    """Refuse a registered model name another owner holds (ownership is the gateway's tag)."""
    from opentinker.storage.registry import TENANT_TAG, is_missing, registry_client

    try:
        model = registry_client(settings.mlflow_url).get_registered_model(name)
    except Exception as err:  # noqa: BLE001 - missing (fine) or the registry is down (the job will say)
        if is_missing(err) or isinstance(err, ConnectionError):
            return
        raise
    if model.tags.get(TENANT_TAG, "") != tenant:
        raise SpecError(f"registry.model_name: {name!r} is not yours: choose another name")
