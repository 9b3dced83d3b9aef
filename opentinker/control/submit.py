"""The operator's path to the stack (the CLI on the stack's machine; tenants go through the
gateway): check the Ray cluster, apply the deployments, submit a job to its deployment.
Following it is opentinker.control.follow. Imports no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentinker.core.settings import Settings


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
    `flow_for`) on the job's pool; returns the flow-run id. A bad job id (core/ids.py) is refused
    before anything is queued: InvalidJobId."""
    from prefect.deployments import run_deployment

    from opentinker.control.scheduler import check_fits, deployment_name, flow_for, job_tags
    from opentinker.core.ids import check_job_id

    check_job_id(job_id, "job_id")

    pool = check_fits(settings, float((spec_data.get("resources") or {}).get("num_gpus", 0)))
    run = run_deployment(deployment_name(flow_for(spec_data), pool), parameters={"spec": spec_data, "job_id": job_id},
                         timeout=0, tags=job_tags(None, job_id))
    return str(run.id)
