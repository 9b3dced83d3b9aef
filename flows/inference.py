"""An inference job as a Prefect flow: serve a checkpoint behind an OpenAI-compatible API until cancelled.

The flow resolves the checkpoint and checks the engine first (a bad model path or a worker
without the engine fails the job before it takes a slot), then holds its pool's slots for as
long as it serves: on a CPU (`num_gpus=0`) from the flow's process, vLLM where it runs the model,
else the transformers engine (inference.launch.serving_engine); vLLM on GPUs, in a Ray actor
holding the job's GPUs (distinct devices, see orchestration/serving.py). Once the server answers, its address is published as a Prefect artifact (key `endpoint-<job>`; metadata `url`,
`openai_base_url`, `model`, `engine`, `checkpoint`), which the gateway reads back into the job's
status. Cancelling the job stops the process, the server with it, and frees the slots.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, runtime

from opentinker.orchestration.job import held_slots, ray_connection
from opentinker.orchestration.serving import serve_in_actor
from opentinker.inference.launch import check_engine, launch
from opentinker.inference.spec import InferenceSpec, endpoint_key
from opentinker.storage.resolve import resolve_checkpoint
from opentinker.core.ids import check_job_id
from opentinker.core.settings import get_settings
from opentinker.core.tokens import job_token


def _publish(job_id: str, server: Any, checkpoint: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    base = f"{server.url}/v1"
    markdown = (f"**Serving `{server.model}`** ({server.engine}) from `{checkpoint}`\n\n"
                f"OpenAI base URL: [{base}]({base})\n\n"
                f"```python\nfrom openai import OpenAI\nOpenAI(base_url=\"{base}\", api_key=<the job's api_key>)\n```")
    metadata = {"url": server.url, "openai_base_url": base, "model": server.model, "engine": server.engine, "checkpoint": checkpoint}
    with get_client(sync_client=True) as client:
        client.create_artifact(ArtifactCreate(
            key=endpoint_key(job_id), type="markdown", description="OpenAI-compatible endpoint of this inference job",
            data=markdown, metadata_=metadata, flow_run_id=runtime.flow_run.id,
        ))


@flow(name="serve-model", persist_result=False, log_prints=True)
def serve_model(spec: InferenceSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """Serve `spec.model_path` until cancelled (or for `spec.ttl_s`); `tenant` is bookkeeping only."""
    job_id = check_job_id(job_id or f"serve-{str(runtime.flow_run.id or 'local')[:8]}", "job_id")  # it names the server's folder
    logger = get_run_logger()
    checkpoint = resolve_checkpoint(spec.model_path)
    check_engine(spec)
    with held_slots(spec.num_gpus, tenant):
        logger.info(f"loading {checkpoint} (engine {spec.engine})")
        settings = get_settings()
        api_key = job_token(settings.stack_secret(), job_id)  # the tenant reads it from the job's status
        if spec.num_gpus > 0:  # on the job's own GPUs, wherever Ray places it
            import ray

            address, init_kwargs = ray_connection()
            ray.init(**(init_kwargs if address is None else {**init_kwargs, "address": address}))
            server = serve_in_actor(checkpoint, spec, job_id, api_key, settings.max_tokens_cap)
            logger.info(f"serving on GPU(s) {server.info['gpu_ids']} (CUDA_VISIBLE_DEVICES={server.info['cuda_visible_devices']})")
        else:
            server = launch(checkpoint, spec, settings.listen_host, 0, name=job_id, max_tokens_cap=settings.max_tokens_cap, api_key=api_key)
        started = time.monotonic()
        try:
            if runtime.flow_run.id is not None:
                _publish(job_id, server, checkpoint)
            logger.info(f"serving {server.model} ({server.engine}) at {server.url}/v1 (OpenAI-compatible); cancel the job to stop")
            while server.alive():
                if spec.ttl_s is not None and time.monotonic() - started >= spec.ttl_s:
                    logger.info(f"ttl of {spec.ttl_s:g}s reached: stopping")
                    break
                time.sleep(1.0)
            else:
                raise RuntimeError(f"the {server.engine} server for {checkpoint} stopped on its own")
        finally:
            server.stop()
            if spec.num_gpus > 0:
                import ray

                ray.shutdown()
    return {"job_id": job_id, "checkpoint": checkpoint, "url": server.url, "seconds": time.monotonic() - started}
