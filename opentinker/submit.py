"""Submit jobs to the Prefect deployment and follow them through Prefect states and MLflow metrics.

Client side: imports no torch, so it runs on a laptop that only talks to the servers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from opentinker.settings import Settings
from opentinker.tracking import JOB_TAG, headline_key

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}


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


def check_mlflow(url: str, timeout: float = 5.0) -> None:
    """Fail in one line when the MLflow server is down (its client would retry for minutes)."""
    import httpx

    try:
        httpx.get(f"{url}/health", timeout=timeout).raise_for_status()
    except httpx.HTTPError as err:
        raise ConnectionError(f"MLflow server at {url} is not reachable ({type(err).__name__}); start the stack with `opentinker up`") from None


def deploy(settings: Settings) -> list[str]:
    """Pools, slot limits and every deployment of deployments/prefect.yaml (idempotent)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.scheduler import apply_deployments, ensure_pools

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        ensure_pools(settings)
        return apply_deployments(settings)


def deployed(settings: Settings) -> bool:
    from opentinker.scheduler import deployment_exists, deployment_names

    return all(deployment_exists(name) for name in deployment_names())


def submit_rl_job(spec_data: dict[str, Any], job_id: str, settings: Settings) -> str:
    """Create a flow run of the RL deployment on the job's pool; returns the flow-run id.
    The operator's path (the CLI on the stack's machine); tenants go through the gateway."""
    from prefect.deployments import run_deployment

    from opentinker.scheduler import check_fits, deployment_name, flow_for

    pool = check_fits(settings, float((spec_data.get("resources") or {}).get("num_gpus", 0)))
    run = run_deployment(deployment_name(flow_for(spec_data), pool), parameters={"spec": spec_data, "job_id": job_id},
                         timeout=0, tags=["opentinker", f"job:{job_id}"])
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
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
    from opentinker.scheduler import job_state

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
    while True:
        progress = poll(flow_run_id, job_id, settings)
        on_update(progress)
        if progress.state in TERMINAL:
            return progress
        time.sleep(interval)
