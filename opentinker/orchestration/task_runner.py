"""RayTaskRunner that ships Prefect's settings once, not with every task.

Why: prefect_ray serializes the full Prefect settings (≈54 nested pydantic-settings models) on the
driver for every task, and every Ray worker rebuilds them from scratch before it runs the task.
Profiled here, that was ≈90% of Prefect's CPU per task (≈40 ms to serialize + ≈90 ms to rebuild
on a 2-core machine), paid three times per RL step. Settings do not change while a flow runs, so
the driver serializes them once per settings object, and each worker process builds the
`SettingsContext` once per distinct payload and re-enters a copy of it. Everything else (flow-run,
task-run, tags, asset and deployment contexts) is serialized per task exactly as Prefect does.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any
from uuid import uuid4

from prefect.context import (  # the deployment context vars are private; prefect is pinned
    AssetContext,
    EngineContext,
    SettingsContext,
    TagsContext,
    TaskRunContext,
    _deployment_id,
    _deployment_parameters,
)
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect_ray import RayTaskRunner
from prefect_ray.context import RemoteOptionsContext
from prefect_ray.task_runners import PrefectRayFuture

# Worker side: settings digest -> SettingsContext built once per Ray worker process.
_WORKER_SETTINGS: dict[str, SettingsContext] = {}


Connect = Callable[[], tuple[str | None, dict[str, Any]]]


class SettingsOnceRayTaskRunner(RayTaskRunner):
    """Same behaviour as RayTaskRunner; settings travel as a cached payload plus its digest.

    `connect`, when given, is asked for (address, ray.init kwargs) each time a flow run starts:
    a flow module is imported once, long before the cluster it should join is known (the stack's
    head may start, stop or move in between)."""

    def __init__(self, *args: Any, connect: Connect | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._connect = connect
        self._settings_cache: tuple[int, str, dict[str, Any]] | None = None

    def duplicate(self) -> "SettingsOnceRayTaskRunner":
        return type(self)(address=self.address, init_kwargs=self.init_kwargs, connect=self._connect)

    def __enter__(self) -> "SettingsOnceRayTaskRunner":
        if self._connect is not None:
            self.address, init_kwargs = self._connect()
            self.init_kwargs = {"namespace": "prefect", **init_kwargs}
        return super().__enter__()

    def _settings_payload(self) -> tuple[str, dict[str, Any]]:
        current = SettingsContext.get()
        if self._settings_cache is None or self._settings_cache[0] != id(current):
            payload = current.serialize() if current else {}
            digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
            self._settings_cache = (id(current), digest, payload)
        return self._settings_cache[1], self._settings_cache[2]

    def submit(self, task, parameters, wait_for=None, dependencies=None):
        """prefect_ray's submit with the settings context lifted out of the per-task context."""
        import ray

        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        task_run_id = uuid4()
        task_inputs = {k: collect_task_run_inputs_sync(v, future_cls=PrefectRayFuture) for k, v in parameters.items()}
        digest, payload = self._settings_payload()
        context = _context_without_settings(
            {"task": task, "task_run_id": task_run_id, "task_inputs": task_inputs, "copy_to_child_ctx": True})
        parameters, upstream_refs = self._exchange_prefect_for_ray_futures(parameters)
        options = RemoteOptionsContext.get().current_remote_options
        remote = ray.remote(**options) if options else ray.remote
        object_ref = remote(_run_with_cached_settings).options(name=task.name).remote(
            *upstream_refs, settings_digest=digest, settings_payload=payload, task=task, task_run_id=task_run_id,
            parameters=parameters, wait_for=wait_for, dependencies=dependencies, context=context,
        )
        return PrefectRayFuture(task_run_id=task_run_id, wrapped_future=object_ref)


def authenticate(env: dict[str, str]) -> None:
    """Make this process's Ray driver show the cluster's token (RAY_AUTH_MODE, RAY_AUTH_TOKEN).

    Ray reads the mode and the token once, when it is first imported: a process that imported it
    before the variables were set (a test, a notebook) must have Ray read them again. Ray offers no
    public call for that; `ray._raylet`'s Config and token loader are what ray.init itself uses."""
    changed = any(os.environ.get(key) != value for key, value in env.items())
    os.environ.update(env)
    if changed and "ray._raylet" in sys.modules:
        import ray
        from ray._raylet import AuthenticationTokenLoader, Config

        if not ray.is_initialized():
            Config.initialize("")
            AuthenticationTokenLoader.instance().reset_cache()


def _context_without_settings(asset_ctx_kwargs: dict[str, Any]) -> dict[str, Any]:
    """prefect.context.serialize_context (prefect 3.8.8) minus the settings it would dump again."""
    flow_run = EngineContext.get()
    task_run = TaskRunContext.get()
    tags = TagsContext.get()
    deployment_id = _deployment_id.get()
    return {
        "flow_run_context": flow_run.serialize() if flow_run else {},
        "task_run_context": task_run.serialize() if task_run else {},
        "tags_context": tags.serialize() if tags else {},
        "settings_context": {},
        "asset_context": AssetContext.from_task_and_inputs(**asset_ctx_kwargs).serialize(),
        "deployment_id": str(deployment_id) if deployment_id else None,
        "deployment_parameters": _deployment_parameters.get(),
    }


def _run_with_cached_settings(*upstream_refs: Any, settings_digest: str, settings_payload: dict[str, Any], **kwargs: Any) -> Any:
    """Ray worker entry point: enter the (cached) settings, then run the task as prefect_ray does."""
    settings = _WORKER_SETTINGS.get(settings_digest)
    if settings is None:
        settings = _WORKER_SETTINGS[settings_digest] = SettingsContext(**settings_payload) if settings_payload else SettingsContext.get()
    with settings.model_copy():
        return RayTaskRunner._run_prefect_task(*upstream_refs, **kwargs)
