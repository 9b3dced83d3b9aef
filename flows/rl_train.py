"""RL training as a Prefect flow: rollout → update → evaluate (every k) → checkpoint (every k).

The flow is the controller of one job. Its steps are Prefect tasks dispatched through
RayTaskRunner; the model lives in the job's Ray actors for the whole run. On start the flow
resumes from the job's latest complete checkpoint, so a retried or re-submitted run with the same
job id continues where it stopped. A step's metrics go to MLflow once the checkpoint that covers
it has committed, so after a crash and resume MLflow holds each step exactly once.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from prefect_ray.context import remote_options

from opentinker.actors import JobActors, check_placeable, create_actors
from opentinker.scheduler import SLOTS_HELD_TAG, pool_for, slot_limit, slots_for
from opentinker.settings import get_settings
from opentinker.spec import JobSpec
from opentinker.submit import check_mlflow
from opentinker.task_runner import SettingsOnceRayTaskRunner
from opentinker.tracking import JobTracker
from tasks import checkpoint, evaluate, rollout, update


def ray_runner() -> SettingsOnceRayTaskRunner:
    """Local Ray by default (sized to this machine, no dashboard); an existing cluster when configured."""
    settings = get_settings()
    if settings.ray_address:
        return SettingsOnceRayTaskRunner(address=settings.ray_address)
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    return SettingsOnceRayTaskRunner(init_kwargs={
        "num_cpus": os.cpu_count() or 1,
        "include_dashboard": False,
        "object_store_memory": 512 * 1024**2,
        "logging_level": "WARNING",
        "log_to_driver": False,
        "runtime_env": {"env_vars": {"PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}},
        # Ray runs workers at nice 15 by default: the model actor then loses the CPU to every
        # server on the machine (measured: rollout and update ≈10% slower than in-process).
        "_system_config": {"worker_niceness": 0},
    })


def _run(task, actors: JobActors, job_id: str, step: int) -> Any:
    """Dispatch one step task through RayTaskRunner and wait for its (small) result."""
    # Thin tasks reserve no CPU: the actors hold the cores, and a task that cannot be placed
    # would wait forever without a task run to show for it.
    with remote_options(num_cpus=0, max_retries=0):
        return task.submit(actors=actors, job_id=job_id, step=step).result()


@contextmanager
def job_slots(spec: JobSpec) -> Iterator[None]:
    """Hold the job's slots of its pool's global concurrency limit for the whole run.

    Only deployment runs take slots (the scheduler's runs); a direct call, as in a notebook or a
    benchmark, runs unscheduled. The lease is renewed while the run lives and expires a minute
    after a crash; the flow-run tag tells clients the job left the queue.
    """
    if runtime.deployment.id is None:
        yield
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    num_gpus = spec.resources.num_gpus
    with concurrency(slot_limit(pool_for(num_gpus)), occupy=slots_for(num_gpus), strict=True, lease_duration=60):
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(runtime.flow_run.id)
            client.update_flow_run(run.id, tags=[*run.tags, SLOTS_HELD_TAG])
        yield


@flow(name="rl-train", task_runner=ray_runner(), persist_result=False, log_prints=True)
def rl_train(spec: JobSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """One RL job. `tenant` names its MLflow experiment (the settings' project when None)."""
    settings = get_settings()
    check_mlflow(settings.mlflow_url)
    check_placeable(spec)
    with job_slots(spec):
        return _train(spec, job_id, tenant or settings.project)


def _train(spec: JobSpec, job_id: str | None, experiment: str) -> dict[str, Any]:
    logger = get_run_logger()
    settings = get_settings()
    flow_run_id = str(runtime.flow_run.id or "local")
    job_id = job_id or spec.job_id or f"job-{flow_run_id[:8]}"
    actors = create_actors(spec, job_id)
    tracker = JobTracker(settings.mlflow_url, experiment, job_id, spec, tags={"prefect.flow_run_id": flow_run_id})
    create_markdown_artifact(
        key=re.sub(r"[^a-z0-9-]", "-", f"mlflow-{job_id}".lower()),
        markdown=f"**OpenTinker job `{job_id}`**\n\nMLflow run: [{tracker.run_id}]({tracker.run_url})",
        description="MLflow run of this job",
    )
    try:
        restored = ray.get(actors.trainer.restore_latest.remote())
        if restored and not actors.colocated:
            ray.get(actors.rollout.load_env_state.remote(restored["env"]))
            ray.get(actors.rollout.sync.remote(actors.trainer.weights.remote()))
        start = restored["step"] if restored else 0
        total = spec.optimization.steps
        logger.info(f"job {job_id}: {'resuming at step ' + str(start) if restored else 'starting'} of {total}; MLflow {tracker.run_url}")
        pending: list[tuple[int, dict[str, float]]] = []  # metrics not yet covered by a checkpoint
        history: list[dict[str, float]] = []
        if start == 0 and total > 0:
            ev = _run(evaluate, actors, job_id, 0)
            tracker.log_transcripts(0, ev["transcripts"])
            pending.append((0, ev["metrics"]))
        url = restored["url"] if restored else None
        loop_start = time.perf_counter()
        for step in range(start, total):
            done = step + 1
            t0 = time.perf_counter()
            metrics = _run(rollout, actors, job_id, step) | _run(update, actors, job_id, step)
            if spec.evaluates_at(done):
                ev = _run(evaluate, actors, job_id, done)
                tracker.log_transcripts(done, ev["transcripts"])
                metrics |= ev["metrics"]
            metrics["step/seconds"] = time.perf_counter() - t0
            pending.append((done, metrics))
            if spec.checkpoints_at(done):
                url = _run(checkpoint, actors, job_id, done)
                for s, m in pending:
                    tracker.log_metrics(s, m)
                    history.append({"step": s, **m})
                pending.clear()
            logger.info(f"step {done}/{total}: reward {metrics['rollout/reward_mean']:.3f}"
                        + (f", accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""))
        loop_seconds = time.perf_counter() - loop_start
        if url:
            tracker.log_checkpoint(url)
        tracker.finish("FINISHED")
        return {"job_id": job_id, "steps": total, "resumed_from": start, "checkpoint": url,
                "mlflow_run_id": tracker.run_id, "mlflow_run_url": tracker.run_url, "history": history, "loop_seconds": loop_seconds}
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        for handle in {id(actors.trainer): actors.trainer, id(actors.rollout): actors.rollout}.values():
            ray.kill(handle)
