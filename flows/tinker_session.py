"""A Tinker API session as a Prefect flow: one client's training and sampling, held as one job.

    hold a seat of the pool's base-model worker (or, unshared, a slot) → open the MLflow run →
    host the session on the worker (or start an actor of its own) on Ray → publish its server
    (artifact `endpoint-<session>`) → live until the client finishes, goes quiet past
    `tinker_heartbeat_timeout_s` (then the run ends Completed named "Expired"; sooner, past
    `tinker_absent_after_s`, when its tenant opens a session at its limit), or the run is cancelled → take it off the worker, free the seat

The client's calls never pass through Prefect: the gateway relays them to the actor's server,
so a call costs little more than its computation. Prefect sees the session (its state, its
slot, its logs: one line per minute of how many optimizer steps ran); MLflow sees every step.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, runtime
from prefect.states import Completed

from opentinker.control.scheduler import EXPIRED
from opentinker.core.settings import get_settings
from opentinker.core.tokens import job_token
from opentinker.inference.spec import endpoint_key
from opentinker.orchestration.on_base_worker import OnBaseWorker
from opentinker.orchestration.job import cluster_address, held_slots, ray_connection
from opentinker.orchestration.tinker_actor import OwnActor
from opentinker.tinker.spec import TinkerSessionSpec
from opentinker.tracking.runs import JobTracker, check_mlflow


def _publish(session_id: str, url: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    with get_client(sync_client=True) as client:
        client.create_artifact(ArtifactCreate(
            key=endpoint_key(session_id), type="markdown", description="the session's server (the gateway relays to it)",
            data=f"Tinker session `{session_id}` serving at `{url}` (reached through the gateway only)",
            metadata_={"url": url}, flow_run_id=runtime.flow_run.id))


@flow(name="tinker-session", persist_result=False, log_prints=True)
def tinker_session(session_id: str, tenant: str, num_gpus: float = 0.0, user_metadata: dict[str, str] | None = None,
                   sdk_version: str = "", heartbeat_timeout_s: float | None = None) -> dict[str, Any]:
    """`heartbeat_timeout_s`: the session ends after this long without a call (None: the settings')."""
    import ray

    from opentinker.control.gateway.confine import tenant_storage

    logger = get_run_logger()
    settings = get_settings()
    timeout_s = heartbeat_timeout_s or settings.tinker_heartbeat_timeout_s
    spec = TinkerSessionSpec(session_id=session_id, num_gpus=num_gpus, user_metadata=user_metadata or {}, sdk_version=sdk_version)
    check_mlflow(settings.mlflow_url)
    shared = settings.tinker_shared_bases and cluster_address(settings) is not None  # a worker outlives a run on a cluster only
    with held_slots(num_gpus, tenant, seat=shared):
        tracker = JobTracker(settings.mlflow_url, tenant, session_id, spec, tags={"prefect.flow_run_id": str(runtime.flow_run.id),
                                                                                   "opentinker.kind": "tinker-session"})
        address, init_kwargs = ray_connection()
        ray.init(**(init_kwargs if address is None else {**init_kwargs, "address": address}))
        args = (session_id, tenant, tenant_storage(settings, tenant), job_token(settings.stack_secret(), session_id),
                (tracker.tracking_uri, tracker.experiment_id, tracker.run_id))
        host = OnBaseWorker(num_gpus, settings.tinker_worker_idle_s, *args) if shared else OwnActor(num_gpus, *args)
        ended, status_end = "cancelled", "FAILED"
        try:
            info = host.start()
            if runtime.flow_run.id is not None:
                _publish(session_id, info["url"])
            logger.info(f"session {session_id} serving at {info['url']} (MLflow run {tracker.run_url})")
            last_report = time.monotonic()
            while True:
                status = host.status()
                if status["finished"]:
                    ended = f"finished by its client ({status['finished']})"
                    break
                if status.get("expired"):  # the gateway's call: its client gone, its tenant's new session needed the place
                    ended = status["expired"]
                    break
                if status["idle_s"] > timeout_s:
                    ended = (f"expired: no call or heartbeat for {status['idle_s']:.0f} s "
                             f"(OPENTINKER_TINKER_HEARTBEAT_TIMEOUT_S: {timeout_s:g} s)")
                    break
                if time.monotonic() - last_report > 60:
                    logger.info(f"{status['models']} model(s), {status['steps']} optimizer steps so far{status.get('worker', '')}")
                    last_report = time.monotonic()
                time.sleep(1.0)
            final = host.status()
            host.stop()
            status_end = "FINISHED"
        finally:
            host.kill()
            ray.shutdown()
            tracker.finish(status_end)
        logger.info(f"session {session_id} {ended}")
        registered = _register_newest_sampler(session_id, tenant, spec, tracker, logger)
    result = {"session_id": session_id, "ended": ended, "optimizer_steps": final["steps"], "mlflow_run_id": tracker.run_id,
              "registered_model": registered}
    if ended.startswith("expired"):  # not a close(): Prefect shows it apart, and the gateway tells its client how to go on
        return Completed(name=EXPIRED, message=ended, data=result)
    return result


def _register_newest_sampler(session_id: str, tenant: str, spec: TinkerSessionSpec, tracker: JobTracker, logger) -> dict | None:
    """The session's newest named sampler checkpoint (`save_weights_for_sampler(name)`) becomes a
    version of the tenant's registered model `<tenant>-tinker`, as a job's final checkpoint does
    (lineage tags, aliases challenger/champion). A registry failure is logged, never the session's."""
    from opentinker.control.gateway.confine import tenant_storage
    from opentinker.storage.registry import RegistryError, register_job_checkpoint
    from opentinker.tinker.paths import TenantCheckpoints, parse_path

    store = TenantCheckpoints(tenant_storage(get_settings(), tenant))
    newest = max((c for run in store.run_ids(f"{session_id}:") for c in store.checkpoints(run) if c["checkpoint_type"] == "sampler"),
                 key=lambda c: c["time"], default=None)
    if newest is None:
        return None
    path = parse_path(newest["tinker_path"])
    try:
        reg = register_job_checkpoint(
            checkpoint_url=store.url(path), model_name=f"{tenant}-tinker", job_id=session_id, kind="tinker",
            spec_data=spec.model_dump(mode="json"), base_model=store.policy_info(path)["base_model"], environment=None,
            flow_run_id=str(runtime.flow_run.id) if runtime.flow_run.id else None, mlflow_run_id=tracker.run_id,
            tracking_uri=tracker.tracking_uri, tenant=tenant)
    except (RegistryError, ValueError) as err:
        logger.warning(f"session {session_id}: {newest['tinker_path']} was not registered: {err}")
        return None
    tracker.set_tags({"opentinker.registered_model": reg["name"], "opentinker.registered_version": reg["version"],
                      "opentinker.checkpoint": newest["tinker_path"]})
    logger.info(f"registered {newest['tinker_path']} as {reg['name']} version {reg['version']}")
    return reg
