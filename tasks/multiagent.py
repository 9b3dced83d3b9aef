"""Self-play steps as Prefect tasks: one joint rollout per step, one update per agent (so each
agent's update shows in the UI on its own), evaluation and checkpoint. The flow waits for all
tasks of a phase before it starts the next phase (the coordinator's barrier)."""

from __future__ import annotations

from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

_COMMON = {"cache_policy": NO_CACHE, "persist_result": False, "log_prints": False}


@task(name="selfplay-rollout", task_run_name="rollout-{job_id}-step{step}", **_COMMON)
def selfplay_rollout(actor: Any, job_id: str, step: int) -> dict[str, float]:
    """Every match of the step played to its end by the current seats."""
    return ray.get(actor.rollout.remote(step))


@task(name="agent-update", task_run_name="update-{job_id}-{agent}-step{step}", **_COMMON)
def agent_update(actor: Any, job_id: str, agent: str, step: int) -> dict[str, float]:
    """One policy update of one agent on its own records of the step."""
    return ray.get(actor.update.remote(agent, step))


@task(name="selfplay-evaluate", task_run_name="evaluate-{job_id}-step{step}", retries=1, **_COMMON)
def selfplay_evaluate(actor: Any, job_id: str, step: int) -> dict[str, float]:
    return ray.get(actor.evaluate.remote(step))


@task(name="selfplay-checkpoint", task_run_name="checkpoint-{job_id}-step{step}", retries=2, **_COMMON)
def selfplay_checkpoint(actor: Any, job_id: str, step: int, metrics: list | None = None) -> dict[str, str]:
    """Every learner's checkpoint for `step`, each carrying the not yet logged `metrics`."""
    return ray.get(actor.checkpoint.remote(step, metrics or []))
