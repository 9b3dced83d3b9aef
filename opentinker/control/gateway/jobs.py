"""A tenant's view of jobs: Prefect flow runs tagged with the tenant, and their MLflow runs.

Every lookup filters on the tenant's tag, so a job of another tenant is indistinguishable from
a job that does not exist. Specs are validated here, before anything reaches Prefect; the
tenant namespace is forced into the job id, the checkpoint location and the MLflow experiment.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

from opentinker.control.gateway import inference
from opentinker.control.scheduler import (AWAITING_ENV, CANCEL_REQUESTED_TAG, check_fits, deployment_name, flow_for, job_state,
                                          job_tags, parked_state, prefect_client)
from opentinker.core.settings import Settings
from opentinker.core.spec import JobSpec, SpecError, parse_spec
from opentinker.tracking.metrics import headline_key
from opentinker.tracking.runs import JOB_TAG

# Stands in for the environment while a job waits for fit(): the rest of the spec is checked now.
_PLACEHOLDER_ENV = {"game": "opentinker.env:AbstractGame"}


class JobNotFound(LookupError):
    pass


class JobConflict(RuntimeError):
    pass


class TenantJobs:
    def __init__(self, settings: Settings, tenant: str):
        self.settings = settings
        self.tenant = tenant

    # --- Prefect --------------------------------------------------------------------------
    def _runs(self, job_id: str | None = None) -> list[Any]:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        tags = [f"tenant:{self.tenant}"] + ([f"job:{job_id}"] if job_id else [])
        with prefect_client() as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags)), limit=200)
        return sorted(runs, key=lambda r: r.created or datetime.min.replace(tzinfo=timezone.utc), reverse=True)

    def _run(self, job_id: str) -> Any:
        runs = self._runs(job_id)
        if not runs:
            raise JobNotFound(job_id)
        return runs[0]  # a re-submitted job id resumes in a newer run

    # --- submit ---------------------------------------------------------------------------
    def _normalise(self, config: dict[str, Any], num_gpus: float | None) -> tuple[JobSpec, bool]:
        """(validated spec in the tenant's namespace, whether the environment is still missing)."""
        data = dict(config)
        awaiting_env = not data.get("env")
        if awaiting_env:
            data["env"] = _PLACEHOLDER_ENV
        if num_gpus is not None:
            data["resources"] = {**dict(data.get("resources") or {}), "num_gpus": num_gpus}
        name = data.get("job_id") or uuid.uuid4().hex[:8]
        data["job_id"] = name if str(name).startswith(f"{self.tenant}-") else f"{self.tenant}-{name}"
        data["checkpoint"] = {**dict(data.get("checkpoint") or {}), "base_url": self.storage_url}
        return parse_spec(data), awaiting_env

    @property
    def storage_url(self) -> str:
        return f"{self.settings.storage_url.rstrip('/')}/tenants/{self.tenant}"

    def submit(self, config: dict[str, Any], num_gpus: float | None = None) -> dict[str, Any]:
        spec, awaiting_env = self._normalise(config, num_gpus)
        pool = check_fits(self.settings, spec.resources.num_gpus)
        params = spec.model_dump(mode="json")
        if awaiting_env:
            params.pop("env")
        with prefect_client() as client:
            deployment = client.read_deployment_by_name(deployment_name(flow_for(params), pool))
            run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"spec": params, "job_id": spec.job_id, "tenant": self.tenant},
                tags=job_tags(self.tenant, spec.job_id), state=parked_state() if awaiting_env else None,
            )
        return self.describe(spec.job_id, run)

    def start(self, job_id: str, env: dict[str, Any], steps: int | None = None) -> dict[str, Any]:
        """Complete a parked job's spec with its environment (and step count) and queue it."""
        from prefect.states import Scheduled

        run = self._run(job_id)
        if not (run.state and run.state.name == AWAITING_ENV):
            raise JobConflict(f"job {job_id} is not waiting for its environment (state {job_state(run)[0]})")
        params = dict(run.parameters["spec"])
        params["env"] = env
        if steps is not None:
            params["optimization"] = {**params.get("optimization", {}), "steps": steps}
        spec = parse_spec(params)
        with prefect_client() as client:
            client.update_flow_run(run.id, parameters={**run.parameters, "spec": spec.model_dump(mode="json")})
            client.set_flow_run_state(run.id, Scheduled(), force=True)
        return self.status(job_id)

    # --- read -----------------------------------------------------------------------------
    def describe(self, job_id: str, run: Any) -> dict[str, Any]:
        state, reason = job_state(run)
        spec = run.parameters.get("spec") or {}
        out = {
            "job_id": job_id, "state": state, "reason": reason,
            "num_gpus": (spec.get("resources") or {}).get("num_gpus", 0),
            "total_steps": (spec.get("optimization") or {}).get("steps"),
            "created": run.created.isoformat() if run.created else None,
            "server_url": f"{self.settings.gateway_url}/v1/jobs/{job_id}",
            "links": {"prefect": f"{self.settings.prefect_ui_url}/runs/flow-run/{run.id}"},
        }
        if inference.KIND_TAG in (run.tags or []):
            out |= inference.endpoint(self, job_id, run)  # its URL while it serves
        return out

    def list(self) -> list[dict[str, Any]]:
        seen: dict[str, dict[str, Any]] = {}
        for run in self._runs():
            job_id = next((t.split(":", 1)[1] for t in run.tags if t.startswith("job:")), None)
            if job_id and job_id not in seen:
                seen[job_id] = self.describe(job_id, run)
        return list(seen.values())

    def status(self, job_id: str) -> dict[str, Any]:
        out = self.describe(job_id, self._run(job_id))
        ml = self._mlflow_run(job_id)
        out |= {"step": 0, "metrics": {}, "checkpoint": None}
        if ml is not None:
            client, run = ml
            out["metrics"] = dict(run.data.metrics)
            history = client.get_metric_history(run.info.run_id, headline_key(run.data.metrics, "rollout/reward_mean"))
            out["step"] = max((m.step for m in history), default=0)
            out["checkpoint"] = run.data.tags.get("opentinker.checkpoint")
            out["links"]["mlflow"] = f"{self.settings.mlflow_url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
        return out

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Queued jobs become CANCELLED at once; running ones go through CANCELLING (the worker
        stops the process, the slots' lease is released)."""
        from prefect.states import Cancelled, Cancelling

        run = self._run(job_id)
        state, _ = job_state(run)
        if state in ("COMPLETED", "FAILED", "CANCELLED"):
            raise JobConflict(f"job {job_id} already ended ({state})")
        running = run.state is not None and run.state.type.value in ("RUNNING", "PENDING")
        with prefect_client() as client:
            client.update_flow_run(run.id, tags=[*(run.tags or []), CANCEL_REQUESTED_TAG])
            client.set_flow_run_state(run.id, Cancelling() if running else Cancelled(message="cancelled while queued"), force=True)
        return self.status(job_id)

    # --- MLflow ---------------------------------------------------------------------------
    def _mlflow_run(self, job_id: str):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.settings.mlflow_url)
        experiment = client.get_experiment_by_name(self.tenant)
        if experiment is None:
            return None
        runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
        return (client, runs[0]) if runs else None

    def metrics(self, job_id: str) -> dict[str, list[list[float]]]:
        self._run(job_id)
        ml = self._mlflow_run(job_id)
        if ml is None:
            return {}
        client, run = ml
        return {key: [[m.step, m.value] for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
                for key in run.data.metrics}

    def artifacts(self, job_id: str, path: str | None = None) -> list[dict[str, Any]]:
        self._run(job_id)
        ml = self._mlflow_run(job_id)
        if ml is None:
            return []
        client, run = ml
        return [{"path": f.path, "is_dir": f.is_dir, "size": f.file_size} for f in client.list_artifacts(run.info.run_id, path)]

    def download_artifact(self, job_id: str, path: str, dst: str) -> str:
        self._run(job_id)
        ml = self._mlflow_run(job_id)
        if ml is None:
            raise JobNotFound(f"{job_id}: no artifacts yet")
        client, run = ml
        return client.download_artifacts(run.info.run_id, path, dst)


def spec_error_lines(err: SpecError) -> list[str]:
    return [line.strip() for line in str(err).splitlines() if line.strip()]
