"""An RL job's steps as Prefect tasks on the job's Ray actors, and `TaskSteps`, which gives the
step loop (opentinker.rl.loop) those tasks as its rollout / update / evaluate / checkpoint calls.

Weights, optimizer state and trajectories stay in the actors (or move actor to actor through
Ray); tasks pass handles in and small metric dicts out. Retries: `evaluate` and `checkpoint` are
safe to repeat (they do not change the policy; a checkpoint commits atomically). `rollout` and
`update` are not retried: a repeated update would apply a second optimizer step, and a repeated
rollout would draw different tasks; the flow instead resumes from the last checkpoint.
"""

from __future__ import annotations

from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect_ray.context import remote_options

from opentinker.orchestration.actors import JobActors
from opentinker.rl import Evaluation, Restored

# Handles are not hashable inputs: no caching. Results are small: no persistence.
_COMMON = {"cache_policy": NO_CACHE, "persist_result": False, "log_prints": False}


@task(name="rollout", task_run_name="rollout-{job_id}-step{step}", **_COMMON)
def rollout(actors: JobActors, job_id: str, step: int) -> dict[str, float]:
    """Sample a batch of episodes with the current policy; the batch stays in the actor."""
    return ray.get(actors.sample("rollout", step))


@task(name="update", task_run_name="update-{job_id}-step{step}", **_COMMON)
def update(actors: JobActors, job_id: str, step: int) -> dict[str, float]:
    """One policy update on the step's batch, then the weight-sync handshake with the sampler."""
    if actors.colocated:
        return ray.get(actors.call("update", step))
    metrics = ray.get(actors.train("update", actors.sampler.batch.remote(step)))
    ray.get(actors.sampler.sync.remote(actors.train("weights")))
    return metrics


@task(name="evaluate", task_run_name="evaluate-{job_id}-step{step}", retries=1, **_COMMON)
def evaluate(actors: JobActors, job_id: str, step: int) -> Evaluation:
    """Validation episodes (greedy by default): metrics and readable transcripts."""
    return ray.get(actors.sample("evaluate", step))


@task(name="checkpoint", task_run_name="checkpoint-{job_id}-step{step}", retries=2, **_COMMON)
def checkpoint(actors: JobActors, job_id: str, step: int, metrics: list | None = None) -> Any:
    """Commit weights, optimizer, RNG, data position and the not yet logged `metrics` for `step`."""
    if actors.colocated:
        return ray.get(actors.call("checkpoint", step, metrics or []))
    return ray.get(actors.train("save", step, actors.sampler.env_state.remote(), metrics or []))


class TaskSteps:
    """The step loop's calls for one job, each a Prefect task dispatched through RayTaskRunner.
    Thin tasks reserve no CPU: the actors hold the cores, and a task that cannot be placed would
    wait forever without a task run to show for it."""

    def __init__(self, actors: JobActors, job_id: str):
        self.actors, self.job_id = actors, job_id

    def _run(self, step_task, step: int, **kwargs: Any) -> Any:
        with remote_options(num_cpus=0, max_retries=0):
            return step_task.submit(actors=self.actors, job_id=self.job_id, step=step, **kwargs).result()

    def restore(self) -> Restored | None:
        a = self.actors
        if a.colocated:
            return ray.get(a.call("restore"))
        restored = ray.get(a.train("restore_latest"))
        if restored is not None and restored.resumed:
            ray.get(a.sampler.load_env_state.remote(restored.env_state))
            ray.get(a.sampler.sync.remote(a.train("weights")))
        return restored

    def rollout(self, step: int) -> dict[str, float]:
        return self._run(rollout, step)

    def restart_server(self) -> None:
        """A new inference server for the job's sampler (its own died); the loop restores next."""
        ray.get(self.actors.sample("restart_server"))

    def update(self, step: int) -> dict[str, float]:
        return self._run(update, step)

    def evaluate(self, step: int) -> Evaluation:
        return self._run(evaluate, step)

    def checkpoint(self, step: int, metrics: list) -> Any:
        return self._run(checkpoint, step, metrics=metrics)
