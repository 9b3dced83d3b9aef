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
- Services: `env.url` may not reach the stack's own services (Prefect, MLflow, the gateway, Ray)
  however its host is spelt, nor an address the operator has not allowed
  (OPENTINKER_ENV_URL_ALLOW: core/env_hosts.py); `rollout.server_url` is refused: a job's
  inference server is the one its worker starts (it would get the job's adapter folders and its
  key otherwise).
- Sizes: a reasoning-gym environment whose prompts leave no room for an answer within
  `rollout.max_total_tokens` (`prompts_fit`). `check_job_env` makes these environment checks
  for the CLI (`validate`, `run`, `train`), so it says what the gateway says.
Refusals are SpecError lines (`field: reason`, HTTP 422) that name only what the tenant gave.
"""

from __future__ import annotations

import posixpath
import threading
from functools import lru_cache
from typing import Any

from opentinker.core.env_sources import DATASET_KEY, REASONING_GYM_GAME, mix, resolve_source
from opentinker.core.model_names import KNOWN_MODELS
from opentinker.core.settings import Settings
from opentinker.core.spec import SpecError, parse_spec, storage_url

PROMPT_CHECK_CHARS = 250_000
"""The most characters of one drawn prompt that are tokenized (`prompts_fit`); a longer one is judged by its length."""
_COUNTING = threading.Lock()  # the gateway's request threads share one tokenizer per model


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
    """Refuse a URL of the stack's own services (by the addresses it reaches, not its spelling),
    then one outside the operator's allowlist: core/env_hosts.py. Workers check both again before
    their first request (a spec may reach them without the gateway) and at each connection."""
    for url in urls:
        if why := settings.env_hosts.refusal(url):
            raise SpecError(why)


def confine_env(settings: Settings, tenant: str, env: dict[str, Any], players: list[str] | None = None) -> dict[str, Any]:
    """`players`: a self-play spec's `multiagent.players` (checked against its match's)."""
    env = dict(resolve_source(env))  # env.source names a shipped adapter game: the allowlist decides it too
    if env.get("game"):
        game(settings, env["game"], env.get("config"), players)
    if env.get("url"):
        env_url(settings, [env["url"]] if isinstance(env["url"], str) else list(env["url"]))
    env_url(settings, [t["mcp"] for t in env.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("mcp"), str)])  # env.tools' MCP servers: the same rule
    config = dict(env.get("config") or {})
    root = tenant_storage(settings, tenant)
    for key in ("data_path", "val_data_path"):
        if config.get(key) is not None:
            config[key] = tenant_location(root, config[key], f"env.config.{key}")
    env["config"] = config
    return env


def confine_rollout(data: dict[str, Any]) -> None:
    """`rollout.server_url` is refused; an environment's prompts must fit `rollout.max_total_tokens`."""
    if (data.get("rollout") or {}).get("server_url"):
        raise SpecError("rollout.server_url: jobs sample through the inference server their worker starts "
                        "(rollout.engine: server, without a URL)")
    try:
        spec = parse_spec(data)
    except SpecError:
        return  # the caller's own parse says why
    prompts_fit(spec)


def check_job_env(settings: Settings, spec: Any) -> None:
    """The gateway's checks of an RL spec's environment, where a spec does not pass the gateway
    (`opentinker validate`; `run` and `train` before the model loads): its game, config and
    players (`game`), and that its prompts fit (`prompts_fit`). SpecError, one line."""
    if spec.env.game:
        game(settings, spec.env.game, spec.env.config, spec.multiagent.players if spec.multiagent else None)
    prompts_fit(spec)


@lru_cache(maxsize=4)
def _chat_format(model: str) -> Any:
    """The chat template and tokenizer a job of `model` renders its prompts with."""
    from transformers import AutoTokenizer

    from opentinker.agent.chat import ChatFormat
    from opentinker.model.loading import tokenizer_path

    return ChatFormat(AutoTokenizer.from_pretrained(tokenizer_path() if model in KNOWN_MODELS else model))


def prompts_fit(spec: Any) -> None:
    """Refuse a reasoning-gym environment whose prompts leave no room for an answer within
    `rollout.max_total_tokens` (its config sizes its questions: chain_sum can make them a million
    characters long): a few tasks drawn as a job opens them (envs.reasoning_gym.prompts, bounded in
    time and memory), counted with the model's tokenizer on at most as many characters as that many
    tokens could hold (PROMPT_CHECK_CHARS at most): a longer text is never tokenized whole."""
    env, limit = spec.env, spec.rollout.max_total_tokens
    if env.game != REASONING_GYM_GAME:
        return
    from envs.reasoning_gym.prompts import opening_prompts

    try:
        name = "/".join(part["name"] for part in mix(env.config.get(DATASET_KEY)))
    except ValueError as err:  # env.game given as the adapter, without its dataset
        raise SpecError(f"env.config.{DATASET_KEY}: {err}") from None
    try:
        with _COUNTING:
            chat = _chat_format(spec.model.name)
    except (OSError, ValueError) as err:
        raise SpecError(f"model.name: {spec.model.name}: its tokenizer does not load to count the prompts ({err})") from None
    chars = min((limit + 1) * (chat.max_token_chars or PROMPT_CHECK_CHARS), PROMPT_CHECK_CHARS)
    try:
        prompts = opening_prompts(env.config, spec.seed, chars)
    except ValueError as err:
        raise SpecError(f"env.config: reasoning-gym {name}: {err}") from None
    for prompt in prompts:
        with _COUNTING:
            tokens = len(chat.prompt_ids(prompt["messages"]))  # what came back: all of it, or enough to tell
        whole = sum(len(m["content"]) for m in prompt["messages"]) == prompt["chars"]
        tokens = tokens if whole else max(tokens, chat.min_tokens(prompt["chars"]))
        if tokens >= limit:
            raise SpecError(f"env.config: a prompt of reasoning-gym {name} is {'' if whole else 'at least '}{tokens:,} tokens "
                            f"({prompt['chars']:,} characters) and rollout.max_total_tokens is {limit:,}: no room is left for "
                            "an answer; make its items smaller or rollout.max_total_tokens larger")


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
