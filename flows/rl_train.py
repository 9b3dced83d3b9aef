"""RL training as a Prefect flow: one job, its steps as Prefect tasks on Ray.

    restore → evaluate → (rollout → update → evaluate every k → checkpoint every k) × steps
    → register the final checkpoint

The flow is the controller of one job. The model lives in the job's Ray actors for the whole
run; each step's rollout, update, evaluation and checkpoint is a Prefect task (tasks/steps.py)
driven by the one RL step loop (opentinker/rl/loop.py). A retried or re-submitted run with the
same job id resumes from the job's newest intact checkpoint (signed for this job; newer folders
that are not are skipped, each named in the log). A step's metrics go to MLflow
once the checkpoint that covers it has committed, and travel inside that checkpoint: after a
crash and resume MLflow holds each step exactly once.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from opentinker.core.spec import JobSpec
from opentinker.orchestration.actors import create_actors
from opentinker.orchestration.job import ray_runner, register_final_checkpoint, scheduled_job
from opentinker.rl import LoopHooks, run_steps
from opentinker.rl.health import JobUnhealthy
from opentinker.storage.registry import model_name_for
from tasks import TaskSteps


@flow(name="rl-train", task_runner=ray_runner(), persist_result=False, log_prints=True)
def rl_train(spec: JobSpec, job_id: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """One RL job. `tenant` names its MLflow experiment (the settings' project when None)."""
    logger = get_run_logger()
    with scheduled_job(spec, job_id, tenant) as job, job.tracked(spec) as tracker:
        actors = create_actors(job.layout, job.job_id, job.tenant)
        job.say_where(actors.where, tracker)
        try:
            result = run_steps(spec, TaskSteps(actors, job.job_id), LoopHooks(
                on_restore=job.on_restore(tracker),
                on_eval=lambda ev: tracker.log_transcripts(ev.step, ev.transcripts),
                on_commit=tracker.log_steps,
                on_step=lambda report: logger.info(f"step {report.step}/{report.total_steps}: {_summary(report.metrics)}"),
            ))
        finally:
            actors.kill()
        url = result.checkpoint.url if result.checkpoint else None
        registered = None
        if url:
            tracker.log_checkpoint(url)
            if spec.registry.register and result.not_registrable:
                raise JobUnhealthy(result.not_registrable)
            if spec.registry.register:
                data = spec.model_dump(mode="json")
                registered = register_final_checkpoint(
                    job, tenant, url, tracker, kind="rl", spec_data=data, base_model=spec.model.name,
                    model_name=model_name_for(data, job.experiment, tenant), environment=spec.env.game or spec.env.label)
        return {"job_id": job.job_id, "steps": spec.optimization.steps, "resumed_from": result.resumed_from,
                "skipped_checkpoints": result.skipped, "checkpoint": url, "mlflow_run_id": tracker.run_id,
                "mlflow_run_url": tracker.run_url, "history": result.history, "loop_seconds": result.loop_seconds,
                "registered_model": registered}


def _summary(metrics: dict[str, float]) -> str:
    text = f"reward {metrics['rollout/reward_mean']:.3f}"
    return text + (f", accuracy {metrics['eval/accuracy']:.3f}" if "eval/accuracy" in metrics else "")
