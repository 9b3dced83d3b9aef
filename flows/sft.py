"""SFT as a Prefect flow: one `sft` task (TRL's SFTTrainer, on Ray with the job's CPUs/GPUs; or, with
`resources.share_base`, the job's steps on its pool's base-model worker: opentinker.sft.shared) between
the same start-up and bookkeeping as RL jobs: the job's pool slots held for its life, one MLflow run
(params = the spec; metrics per logging step; loss before/after; the final adapter or weights as
artifacts), then the checkpoint registered as a new model version when `registry.register`.

The whole training is one task: the model lives in that task's process from load to checkpoint,
and a retried run with the same job id and spec returns the checkpoint it already wrote.
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect_ray.context import remote_options

from opentinker.orchestration.job import ray_runner, register_final_checkpoint, scheduled_job
from opentinker.sft.spec import SFTSpec
from opentinker.storage.registry import model_name_for


@task(name="sft", task_run_name="sft-{job_id}", cache_policy=NO_CACHE, persist_result=False, log_prints=False)
def sft_train(spec: SFTSpec, job_id: str, tracking_uri: str, experiment: str, tenant: str | None = None) -> dict[str, Any]:
    """Train and checkpoint; metrics go straight to the job's MLflow run (found by its job id)."""
    from opentinker.sft.job import run_sft
    from opentinker.tracking.runs import JobTracker

    tracker = JobTracker(tracking_uri, experiment, job_id, spec)
    if spec.resources.share_base:
        return train_on_shared_base(spec, job_id, tenant, tracker.log_metrics)
    result = run_sft(spec, job_id, tracker_callback=tracker.log_metrics, tenant=tenant)
    result.pop("history", None)  # already in MLflow; the task result stays small
    return result


def train_on_shared_base(spec: SFTSpec, job_id: str, tenant: str | None, log_metrics) -> dict[str, Any]:
    """The job as an adapter of its pool's base-model worker, one optimizer step a call (so a
    cancelled flow stops it at the next step); taken off the worker whatever happens."""
    import time

    import ray

    from opentinker.core.settings import get_settings
    from opentinker.orchestration.on_base_worker import JobOnBaseWorker

    hosted = JobOnBaseWorker(spec, job_id, tenant, get_settings().tinker_worker_idle_s, host="host_sft")
    try:
        before, seconds = ray.get(hosted.call("begin")), 0.0
        if not before.get("reused"):
            log_metrics(0, before)
            start, done = time.perf_counter(), False
            while not done:
                point = ray.get(hosted.call("step"))
                done = point["done"]
                if point["metrics"]:
                    log_metrics(point["step"], point["metrics"])
            seconds = time.perf_counter() - start
        result = ray.get(hosted.call("finish", seconds))
        if not result.get("reused"):
            log_metrics(result["steps"], result["after"] | {"sft/train_seconds": result["train_seconds"]})
        return {**result, "where": hosted.line()}
    finally:
        hosted.kill()


@flow(name="sft", task_runner=ray_runner(), persist_result=False, log_prints=True)
def sft(spec: SFTSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """One SFT job. `tenant` names its MLflow experiment (the settings' project when None)."""
    logger = get_run_logger()
    with scheduled_job(spec, job_id, tenant) as job, job.tracked(spec) as tracker:
        r = spec.resources
        threads = str(r.torch_threads or os.cpu_count() or 1)
        logger.info(f"SFT job {job.job_id}: {spec.model.name} ({spec.adapter.kind}) on {spec.data.path}; MLflow {tracker.run_url}")
        # a job on a shared base only drives the base-model worker, which holds the resources
        with remote_options(num_cpus=0 if r.share_base else r.num_cpus, num_gpus=0 if r.share_base else r.num_gpus, max_retries=0,
                            runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}}):
            result = sft_train.submit(spec=spec, job_id=job.job_id, tracking_uri=tracker.tracking_uri, experiment=job.experiment,
                                    tenant=tenant).result()
        logger.info(f"SFT job {job.job_id}: {result['steps']} steps, loss {_loss_line(result)}; checkpoint {result['checkpoint']}")
        tracker.log_checkpoint(result["checkpoint"])
        result["registered_model"] = None
        if spec.registry.register:
            # default `<tenant or project>-sft`; a re-run of the job id (same spec) reuses the saved checkpoint and only registers
            named = {"registry": {"model_name": spec.registry.model_name or f"{job.experiment}-sft"}}
            result["registered_model"] = register_final_checkpoint(
                job, tenant, result["checkpoint"], tracker, kind="sft", spec_data=spec.model_dump(mode="json"),
                model_name=model_name_for(named, job.experiment, tenant), base_model=spec.model.name, environment=None)
        return {**result, "mlflow_run_id": tracker.run_id, "mlflow_run_url": tracker.run_url}


def _loss_line(result: dict[str, Any]) -> str:
    key = "eval/loss" if "eval/loss" in result["before"] else "train_set/loss"
    return f"{result['before'][key]:.3f} -> {result['after'][key]:.3f} ({key})"
