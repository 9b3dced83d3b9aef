"""The operator's path to the stack (the CLI on the stack's machine; tenants go through the
gateway): apply the deployments, submit a job to its deployment, and follow it through its
Prefect state and its MLflow metrics. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from opentinker.core.polling import wait_for
from opentinker.core.settings import Settings
from opentinker.core.states import TERMINAL
from opentinker.tracking.metrics import headline_key
from opentinker.tracking.runs import JOB_TAG


def check_ray_address(address: str | None, timeout: float = 3.0) -> None:
    """Fail in one line when a configured Ray cluster cannot be reached (Ray itself retries for long)."""
    import socket

    if not address:
        return
    if address == "auto":
        if not Path("/tmp/ray/ray_current_cluster").exists():
            raise ConnectionError("ray_address is 'auto' but no Ray cluster runs on this machine (start one with `ray start --head`)")
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as err:
        raise ConnectionError(f"Ray cluster at {address} is not reachable: {err}") from None


def deploy(settings: Settings) -> list[str]:
    """Pools, slot limits and every deployment of deployments/prefect.yaml (idempotent)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.scheduler import apply_deployments, ensure_pools

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        ensure_pools(settings)
        return apply_deployments(settings)


def deployed(settings: Settings) -> bool:
    from opentinker.control.scheduler import deployment_exists, deployment_names

    return all(deployment_exists(name) for name in deployment_names())


def submit_job(spec_data: dict[str, Any], job_id: str, settings: Settings) -> str:
    """Create a flow run of the deployment for the spec's kind (rl-train, self-play or sft, see
    `flow_for`) on the job's pool; returns the flow-run id."""
    from prefect.deployments import run_deployment

    from opentinker.control.scheduler import check_fits, deployment_name, flow_for, job_tags

    pool = check_fits(settings, float((spec_data.get("resources") or {}).get("num_gpus", 0)))
    run = run_deployment(deployment_name(flow_for(spec_data), pool), parameters={"spec": spec_data, "job_id": job_id},
                         timeout=0, tags=job_tags(None, job_id))
    return str(run.id)


@dataclass
class Progress:
    state: str
    step: int = 0
    reward: float | None = None
    accuracy: float | None = None
    accuracy_step: int | None = None
    mlflow_run_id: str | None = None
    mlflow_run_url: str | None = None
    message: str | None = None
    result: dict[str, Any] = field(default_factory=dict)


def _latest(client, run_id: str, key: str) -> tuple[int, float] | None:
    history = client.get_metric_history(run_id, key)
    if not history:
        return None
    last = max(history, key=lambda m: (m.step, m.timestamp))
    return last.step, last.value


def poll(flow_run_id: str, job_id: str, settings: Settings) -> Progress:
    """One look at a job: its Prefect state and its newest MLflow metrics."""
    from mlflow.tracking import MlflowClient
    from opentinker.control.scheduler import job_state, prefect_client

    with prefect_client() as client:
        run = client.read_flow_run(flow_run_id)

    state, reason = job_state(run)
    progress = Progress(state=state, message=reason)
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    experiment = ml.get_experiment_by_name(settings.project)
    if experiment is None:
        return progress
    runs = ml.search_runs([experiment.experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job_id}'", max_results=1)
    if not runs:
        return progress
    run_id = runs[0].info.run_id
    progress.mlflow_run_id = run_id
    progress.mlflow_run_url = f"{settings.mlflow_url}/#/experiments/{experiment.experiment_id}/runs/{run_id}"
    keys = runs[0].data.metrics
    if reward := _latest(ml, run_id, headline_key(keys, "rollout/reward_mean")):
        progress.step, progress.reward = reward
    if acc := _latest(ml, run_id, headline_key(keys, "eval/accuracy")):
        progress.accuracy_step, progress.accuracy = acc
    tags = runs[0].data.tags
    progress.result = {"checkpoint": tags.get("opentinker.checkpoint")}
    if per_agent := {k.rpartition(".")[2]: v for k, v in tags.items() if k.startswith("opentinker.checkpoint.")}:
        progress.result["checkpoints"] = per_agent  # a self-play job: one final checkpoint per learning agent
    return progress


def follow(flow_run_id: str, job_id: str, settings: Settings, on_update: Callable[[Progress], None], interval: float = 2.0) -> Progress:
    """Poll until the flow run ends, calling `on_update` after every look."""

    def look() -> Progress | None:
        progress = poll(flow_run_id, job_id, settings)
        on_update(progress)
        return progress if progress.state in TERMINAL else None

    return wait_for(look, interval=interval, what=f"job {job_id} to end")
