"""Inference jobs at the gateway: submit a `serve-model` flow run, and read its endpoint back.

A tenant serves only what it owns: a checkpoint under its own storage (a path relative to it,
e.g. `<job_id>` or `<job_id>/step-00000004`, or a full URL inside it) or a registry URI. The
checkpoint is resolved here, so a missing path, version or alias is refused at once (HTTP 422)
and an alias is pinned to the version it names now; a checkpoint that exists but cannot be
loaded fails the job, with the loader's reason as the job's.
"""

from __future__ import annotations

import uuid
from typing import Any

from opentinker.control.gateway import confine
from opentinker.inference.spec import InferenceSpec, endpoint_key
from opentinker.control.scheduler import (check_fits, deployment_name, ensure_tenant_limit, ensure_tenant_queue, job_state, job_tags,
                                          prefect_client)
from opentinker.core.spec import SpecError
from opentinker.core.tokens import job_token

KIND_TAG = "kind:inference"
FLOW = "serve-model"


def tenant_checkpoint(settings, tenant: str, model_path: str) -> str:
    """The complete checkpoint `model_path` names for a tenant: a path in its storage (a job
    folder, a step folder, or a URL inside it) or a registered model it owns."""
    from opentinker.storage.resolve import resolve_checkpoint

    if model_path.startswith("models:/"):
        return confine.owned_checkpoint(settings, tenant, model_path, "model_path")
    url = confine.tenant_location(confine.tenant_storage(settings, tenant), model_path, "model_path")
    try:
        return resolve_checkpoint(url)
    except Exception as err:  # noqa: BLE001 - storage: the cause goes back to the user
        raise SpecError(f"model_path: {model_path}: {type(err).__name__}: {err}") from None


def submit(jobs: Any, model_path: str, num_gpus: float = 0, **options: Any) -> dict[str, Any]:
    """Queue a `serve-model` run for the tenant of `jobs` (a TenantJobs); returns its status."""
    pool = check_fits(jobs.settings, num_gpus)
    checkpoint = tenant_checkpoint(jobs.settings, jobs.tenant, model_path)
    ensure_tenant_limit(jobs.tenant, jobs.settings.tenant_max_running)
    queue = ensure_tenant_queue(jobs.settings, jobs.tenant, pool)
    try:
        spec = InferenceSpec(model_path=checkpoint, num_gpus=num_gpus, **{k: v for k, v in options.items() if v is not None})
    except ValueError as err:
        raise SpecError(str(err)) from None
    job_id = f"{jobs.tenant}-inf-{uuid.uuid4().hex[:8]}"
    with jobs.admission(), prefect_client() as client:  # counted with the tenant's waiting jobs
        deployment = client.read_deployment_by_name(deployment_name(FLOW, pool))
        run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"spec": spec.model_dump(mode="json"), "job_id": job_id, "tenant": jobs.tenant},
            tags=[*job_tags(jobs.tenant, job_id), KIND_TAG], work_queue_name=queue,
        )
    return jobs.describe(job_id, run) | {"requested_model_path": model_path}


def endpoint(jobs: Any, job_id: str, run: Any) -> dict[str, Any]:
    """The serving fields of an inference job's status; the URLs only while it serves."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    spec = run.parameters.get("spec") or {}
    out: dict[str, Any] = {"kind": "inference", "num_gpus": spec.get("num_gpus", 0), "total_steps": None,
                           "model_path": spec.get("model_path"), "vllm_server_url": None, "openai_base_url": None, "model": None}
    state, reason = job_state(run)
    if state != "RUNNING" or reason == "cancelling":
        return out
    with prefect_client() as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[endpoint_key(job_id)]), flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    if found:
        meta = found[-1].metadata_ or {}
        out |= {"vllm_server_url": meta.get("url"), "openai_base_url": meta.get("openai_base_url"),
                "model": meta.get("model"), "engine": meta.get("engine"),
                "api_key": job_token(jobs.settings.stack_secret(), job_id)}  # the server asks for the job's token
    else:
        out["reason"] = "loading the model"
    return out
