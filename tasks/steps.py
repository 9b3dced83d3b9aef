"""The RL step as Prefect tasks. Weights, optimizer state and trajectories stay in the actors
(or move actor-to-actor through Ray); tasks pass handles in and small metric dicts out.

Retries: `evaluate` and `checkpoint` are safe to repeat (they do not change the policy; a
checkpoint commits atomically). `rollout` and `update` are not retried: a repeated update would
apply a second optimizer step, and a repeated rollout would draw different tasks; the flow
instead resumes from the last checkpoint.
"""

from __future__ import annotations

from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from opentinker.actors import JobActors

# Handles are not hashable inputs: no caching. Results are small dicts: no persistence.
_COMMON = {"cache_policy": NO_CACHE, "persist_result": False, "log_prints": False}


@task(name="rollout", task_run_name="rollout-{job_id}-step{step}", **_COMMON)
def rollout(actors: JobActors, job_id: str, step: int) -> dict[str, float]:
    """Sample a batch of episodes with the current policy; the batch stays in the rollout actor."""
    return ray.get(actors.rollout.rollout.remote(step))


@task(name="update", task_run_name="update-{job_id}-step{step}", **_COMMON)
def update(actors: JobActors, job_id: str, step: int) -> dict[str, float]:
    """One policy update on the step's batch, then the weight-sync handshake with the rollout engine."""
    if actors.colocated:
        return ray.get(actors.trainer.update_from_last_batch.remote(step))
    metrics = ray.get(actors.trainer.update.remote(actors.rollout.batch.remote(step)))
    ray.get(actors.rollout.sync.remote(actors.trainer.weights.remote()))
    return metrics


@task(name="evaluate", task_run_name="evaluate-{job_id}-step{step}", retries=1, **_COMMON)
def evaluate(actors: JobActors, job_id: str, step: int) -> dict[str, Any]:
    """Validation episodes (greedy by default): metrics and readable transcripts."""
    return ray.get(actors.rollout.evaluate.remote(step))


@task(name="checkpoint", task_run_name="checkpoint-{job_id}-step{step}", retries=2, **_COMMON)
def checkpoint(actors: JobActors, job_id: str, step: int, metrics: list | None = None) -> str:
    """Commit weights, optimizer, RNG, data position and the not yet logged `metrics` for `step`;
    returns the checkpoint URL."""
    if actors.colocated:
        return ray.get(actors.trainer.checkpoint_now.remote(step, metrics or []))
    return ray.get(actors.trainer.checkpoint.remote(step, actors.rollout.env_state.remote(), metrics or []))
