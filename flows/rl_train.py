"""RL training as a Prefect flow: rollout → update → evaluate (every k) → checkpoint (every k).

The flow is the controller of one job. Its steps are Prefect tasks dispatched through
RayTaskRunner; the model lives in the job's Ray actors for the whole run. On start the flow
resumes from the job's latest complete checkpoint, so a retried or re-submitted run with the same
job id continues where it stopped. A step's metrics go to MLflow once the checkpoint that covers
it has committed, and travel inside that checkpoint: after a crash and resume MLflow holds each
step exactly once, even when the crash fell between the commit and the logging.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from prefect import flow, get_run_logger
from prefect_ray.context import remote_options

from flows.common import JobContext, ray_runner, register_final_checkpoint, scheduled_job
from opentinker.actors import JobActors, create_actors
from opentinker.spec import JobSpec
from tasks import checkpoint, evaluate, rollout, update


def _run(task, actors: JobActors, job_id: str, step: int, **kwargs) -> Any:
    """Dispatch one step task through RayTaskRunner and wait for its (small) result."""
    # Thin tasks reserve no CPU: the actors hold the cores, and a task that cannot be placed
    # would wait forever without a task run to show for it.
    with remote_options(num_cpus=0, max_retries=0):
        return task.submit(actors=actors, job_id=job_id, step=step, **kwargs).result()


@flow(name="rl-train", task_runner=ray_runner(), persist_result=False, log_prints=True)
def rl_train(spec: JobSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """One RL job. `tenant` names its MLflow experiment (the settings' project when None)."""
    with scheduled_job(spec, job_id, tenant) as job:
        return _train(spec, job, tenant)


def _register(spec: JobSpec, job: JobContext, tenant: str | None, url: str, tracker) -> dict[str, Any]:
    """The final checkpoint as a version of `registry.model_name` (default `<tenant or project>-<game>`)."""
    from opentinker.registry import model_name_for

    data = spec.model_dump(mode="json")
    return register_final_checkpoint(job, tenant, url, tracker, kind="rl", spec_data=data,
                                     model_name=model_name_for(data, job.experiment, tenant), base_model=spec.model.name,
                                     environment=spec.env.game or spec.env.label)


def _train(spec: JobSpec, job: JobContext, tenant: str | None = None) -> dict[str, Any]:
    logger = get_run_logger()
    job_id = job.job_id
    actors = create_actors(spec, job_id)
    tracker = job.tracker(spec)
    try:
        restored = ray.get(actors.trainer.restore_latest.remote())
        if restored and not actors.colocated:
            ray.get(actors.rollout.load_env_state.remote(restored["env"]))
            ray.get(actors.rollout.sync.remote(actors.trainer.weights.remote()))
        start = restored["step"] if restored else 0
        total = spec.optimization.steps
        logger.info(f"job {job_id}: {'resuming at step ' + str(start) if restored else 'starting'} of {total}; MLflow {tracker.run_url}")
        if restored and (late := tracker.log_missing_metrics(restored["metrics"])):
            logger.info(f"logged steps {late} that the checkpoint covered but MLflow missed")
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
                url = _run(checkpoint, actors, job_id, done, metrics=pending)
                for s, m in pending:
                    tracker.log_metrics(s, m)
                    history.append({"step": s, **m})
                pending.clear()
            logger.info(f"step {done}/{total}: reward {metrics['rollout/reward_mean']:.3f}"
                        + (f", accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else ""))
        loop_seconds = time.perf_counter() - loop_start
        if url:
            tracker.log_checkpoint(url)
        registered = _register(spec, job, tenant, url, tracker) if url and spec.registry.register else None
        tracker.finish("FINISHED")
        return {"job_id": job_id, "steps": total, "resumed_from": start, "checkpoint": url,
                "mlflow_run_id": tracker.run_id, "mlflow_run_url": tracker.run_url, "history": history, "loop_seconds": loop_seconds,
                "registered_model": registered}
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        for handle in {id(actors.trainer): actors.trainer, id(actors.rollout): actors.rollout}.values():
            ray.kill(handle)
