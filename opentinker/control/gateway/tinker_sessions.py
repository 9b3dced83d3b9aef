"""Tinker sessions as jobs: each is a `tinker-session` flow run of its pool's deployment.

`create` checks the tenant's limit of live sessions and queues the run (tags: tenant, job id,
`kind:tinker`); the flow holds a slot of its pool (and of the tenant's running limit) while the
session lives, its model in a Ray actor, and publishes the actor's server as the artifact
`endpoint-<session>`. `endpoint` finds that server (cached once found); an ended run reads as
SessionGone with one line on how it ended (and, where the client can go on, how), one that has
not started serving yet as SessionStarting. `unanswered` decides, in seconds, what a server that
stopped answering means.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from opentinker.control.gateway import confine
from opentinker.tinker.paths import RESUME, SessionGone, SessionLimit, SessionStarting, absent_line
from opentinker.control.gateway.quota import tenant_lock
from opentinker.control.scheduler import (CANCEL_REQUESTED_TAG, EXPIRED, TINKER_TAG, check_fits, deployment_name, ensure_tenant_limit,
                                          ensure_tenant_queue, job_state, job_tags, prefect_client)
from opentinker.core.tokens import job_token
from opentinker.inference.spec import endpoint_key

log = logging.getLogger("opentinker.gateway.tinker")
KIND_TAG = TINKER_TAG
FLOW = "tinker-session"
FINAL = ("COMPLETED", "FAILED", "CANCELLED")
# A session whose server stopped answering has this long to record its own end (its flow looks every
# second, e.g. WorkerLost); past it, its process died with its server and nothing else would say so
# for minutes (the stack's automation waits `lost_run_after_s`).
LOST_AFTER_S = 8.0
LOST_MESSAGE = "its server stopped answering and its run recorded no end: its worker or machine went away"


def gone_line(session_id: str, run: Any) -> str:
    """How an ended session ended, in one line; an expired one also says how its client goes on (a
    crashed one's reason already does: scheduler.crash_line)."""
    state, reason = job_state(run)
    if run.state.name == EXPIRED:
        return f"session {session_id} {reason}; {RESUME}"
    return f"session {session_id} has ended ({state.lower()}{': ' + reason if reason else ''})"


class PrefectSessions:
    def __init__(self, settings: Any):
        self.settings = settings
        self.found: dict[str, tuple[str, str]] = {}
        self.ended_runs: set[str] = set()  # sessions whose MLflow run this gateway ended (a crashed one's)
        self.lock = threading.Lock()

    def storage_url(self, tenant: str) -> str:
        return confine.tenant_storage(self.settings, tenant)

    def _runs(self, tenant: str, session_id: str | None = None) -> list[Any]:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        tags = [f"tenant:{tenant}", KIND_TAG] + ([f"job:{session_id}"] if session_id else [])
        with prefect_client() as client:
            return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags)), limit=200)

    def create(self, tenant: str, body: dict[str, Any]) -> str:
        """Queue a session for `tenant`; ValueError (one line) over its limit or when no pool fits.
        Counted and created under the tenant's lock (quota.py): a burst opens exactly the limit."""
        num_gpus = self.settings.tinker_session_gpus
        pool = check_fits(self.settings, num_gpus)
        ensure_tenant_limit(tenant, self.settings.tenant_max_running)
        queue = ensure_tenant_queue(self.settings, tenant, pool)
        session_id = f"{tenant}-tk-{secrets.token_hex(6)}"
        meta = {str(k)[:64]: str(v)[:256] for k, v in list((body.get("user_metadata") or {}).items())[:32]}
        with tenant_lock(self.settings, tenant), prefect_client() as client:
            live = [r for r in self._runs(tenant) if job_state(r)[0] not in FINAL]
            if len(live) >= self.settings.tinker_max_sessions:  # sessions whose clients are gone give their places
                live = [r for r in live if not self._ended_if_absent(tenant, r)]
            if len(live) >= self.settings.tinker_max_sessions:
                raise SessionLimit(tenant, len(live), self.settings.tinker_max_sessions, self.settings.tinker_absent_after_s)
            deployment = client.read_deployment_by_name(deployment_name(FLOW, pool))
            client.create_flow_run_from_deployment(
                deployment.id, parameters={"session_id": session_id, "tenant": tenant, "num_gpus": num_gpus,
                                           "user_metadata": meta, "sdk_version": str(body.get("sdk_version", ""))[:32],
                                           "heartbeat_timeout_s": self.settings.tinker_heartbeat_timeout_s},
                tags=[*job_tags(tenant, session_id), KIND_TAG], work_queue_name=queue)
        return session_id

    def _ended_if_absent(self, tenant: str, run: Any) -> bool:
        """End a running session whose client has sent nothing for `tinker_absent_after_s` (its
        flow ends it as Expired within a second, saying why); True if it was ended."""
        import httpx

        session_id = next((t.split(":", 1)[1] for t in run.tags if t.startswith("job:")), None)
        if session_id is None or job_state(run)[0] != "RUNNING":
            return False
        try:
            url, token = self.endpoint(tenant, session_id)
            headers = {"Authorization": f"Bearer {token}"}
            idle_s = float(httpx.post(f"{url}/direct/describe", json={}, headers=headers, timeout=5).json()["idle_s"])
            if idle_s <= self.settings.tinker_absent_after_s:
                return False
            reason = absent_line(idle_s, self.settings.tinker_absent_after_s)
            httpx.post(f"{url}/direct/expire", json={"reason": reason}, headers=headers, timeout=5).raise_for_status()
        except (LookupError, httpx.HTTPError, KeyError, ValueError):  # starting, gone or not answering: not ours to judge here
            return False
        log.info("session %s: %s", session_id, reason)
        self.forget(session_id)
        return True

    def list(self, tenant: str) -> list[str]:
        """The tenant's session ids, newest first."""
        runs = sorted(self._runs(tenant), key=lambda r: r.created or 0, reverse=True)
        return [t.split(":", 1)[1] for r in runs for t in r.tags if t.startswith("job:")]

    def forget(self, session_id: str) -> None:
        with self.lock:
            self.found.pop(session_id, None)

    def endpoint(self, tenant: str, session_id: str) -> tuple[str, str]:
        """(url, token) of the session's server."""
        with self.lock:
            if session_id in self.found:
                return self.found[session_id]
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

        runs = self._runs(tenant, session_id)
        if not runs:
            raise LookupError(session_id)
        run = runs[0]
        state, reason = job_state(run)
        if state in FINAL:
            raise self._gone(tenant, session_id, run)
        if state != "RUNNING":
            raise SessionStarting(reason or "queued")
        with prefect_client() as client:
            found = client.read_artifacts(artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[endpoint_key(session_id)]), flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        if not found:
            raise SessionStarting("loading")
        url = (found[-1].metadata_ or {})["url"]
        entry = (url, job_token(self.settings.stack_secret(), session_id))
        with self.lock:
            self.found[session_id] = entry
        return entry

    def finish(self, tenant: str, session_id: str, body: dict[str, Any]) -> None:
        """Tell the session its client is done; a session that has not started is cancelled."""
        import httpx
        from prefect.states import Cancelled

        try:
            url, token = self.endpoint(tenant, session_id)
        except SessionStarting:
            run = self._runs(tenant, session_id)[0]
            with prefect_client() as client:  # tagged first: a process that starts for it later ends at once
                client.update_flow_run(run.id, tags=[*run.tags, CANCEL_REQUESTED_TAG])
                client.set_flow_run_state(run.id, Cancelled(message="finished by its client before it started"), force=True)
            return
        except LookupError:  # SessionGone too: nothing left to finish
            return
        try:
            httpx.post(f"{url}/direct/finish", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        except httpx.TransportError:
            self.forget(session_id)

    def unanswered(self, tenant: str, session_id: str, url: str) -> None:
        """The session's server did not answer the gateway: return if it answers again within
        LOST_AFTER_S (a blip), else raise SessionGone, with the line of the end its run records
        meanwhile or, when it records none, as Crashed here (the process died with its server: a
        stack or host gone, a kill -9), so that the client, Prefect and MLflow learn it now."""
        import httpx
        from prefect.states import Crashed

        self.forget(session_id)
        deadline = time.monotonic() + LOST_AFTER_S
        while True:
            run = self._runs(tenant, session_id)[0]
            if job_state(run)[0] in FINAL:
                raise self._gone(tenant, session_id, run)
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
            try:
                httpx.get(f"{url}/health", timeout=2).raise_for_status()
                return
            except httpx.HTTPError:
                pass
        with prefect_client() as client:
            client.set_flow_run_state(run.id, Crashed(message=LOST_MESSAGE), force=True)
        raise self._gone(tenant, session_id, self._runs(tenant, session_id)[0])

    def _gone(self, tenant: str, session_id: str, run: Any) -> SessionGone:
        """SessionGone for an ended run. A Crashed one's MLflow run is ended here: its process died
        before it could, and the gateway is where a crash is first read (the client's next call)."""
        if run.state.is_crashed() and session_id not in self.ended_runs:
            from opentinker.tracking.runs import end_job_run

            try:
                end_job_run(self.settings.mlflow_url, tenant, session_id)
                self.ended_runs.add(session_id)
            except Exception:  # noqa: BLE001 - MLflow down: the client still gets its line; a later read tries again
                log.warning("could not end the MLflow run of session %s", session_id, exc_info=True)
        return SessionGone(gone_line(session_id, run))
