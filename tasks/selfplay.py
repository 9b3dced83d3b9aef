"""Self-play steps as Prefect tasks, per agent and phase where the work is per agent: the step's
matches are played jointly (the seats take turns), then each agent's rollout (its records,
credit and metrics) and each agent's update are tasks of their own, so every agent shows in the
UI in both phases; then evaluation and checkpoint. `SelfPlayTaskSteps` waits for all tasks of a
phase before it starts the next phase (the coordinator's barrier)."""

from __future__ import annotations

from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect_ray.context import remote_options

from opentinker.agent.coordinator import collect_phase
from opentinker.rl import Evaluation, Restored

_COMMON = {"cache_policy": NO_CACHE, "persist_result": False, "log_prints": False}


@task(name="selfplay-play", task_run_name="play-{job_id}-step{step}", **_COMMON)
def selfplay_play(actor: Any, job_id: str, step: int) -> dict[str, float]:
    """Every match of the step played to its end by the current seats."""
    return ray.get(actor.play.remote(step))


@task(name="agent-rollout", task_run_name="rollout-{job_id}-{agent}-step{step}", **_COMMON)
def agent_rollout(actor: Any, job_id: str, agent: str, step: int) -> dict[str, float]:
    """One agent's training batch from the played matches (its seats' records and results)."""
    return ray.get(actor.collect.remote(agent, step))


@task(name="agent-update", task_run_name="update-{job_id}-{agent}-step{step}", **_COMMON)
def agent_update(actor: Any, job_id: str, agent: str, step: int) -> dict[str, float]:
    """One policy update of one agent on its own records of the step."""
    return ray.get(actor.update_agent.remote(agent, step))


@task(name="selfplay-evaluate", task_run_name="evaluate-{job_id}-step{step}", retries=1, **_COMMON)
def selfplay_evaluate(actor: Any, job_id: str, step: int) -> Evaluation:
    return ray.get(actor.evaluate.remote(step))


@task(name="selfplay-checkpoint", task_run_name="checkpoint-{job_id}-step{step}", retries=2, **_COMMON)
def selfplay_checkpoint(actor: Any, job_id: str, step: int, metrics: list | None = None) -> dict[str, Any]:
    """Every learner's checkpoint for `step`, each carrying the not yet logged `metrics`."""
    return ray.get(actor.checkpoint.remote(step, metrics or []))


class SelfPlayTaskSteps:
    """The step loop's calls for a self-play job: each phase's tasks submitted together and all
    awaited under the phase deadline (the barrier)."""

    def __init__(self, actor: Any, job_id: str, agents: list[str], phase_timeout_s: float):
        self.actor, self.job_id, self.agents, self.timeout = actor, job_id, agents, phase_timeout_s

    def _phase(self, phase: str, step: int, futures: dict[str, Any]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for m in collect_phase(phase, step, futures, self.timeout).values():
            metrics |= m
        return metrics

    def restore(self) -> Restored | None:
        return ray.get(self.actor.restore.remote())

    def rollout(self, step: int) -> dict[str, float]:
        with remote_options(num_cpus=0, max_retries=0):
            metrics = self._phase("rollout", step, {"matches": selfplay_play.submit(actor=self.actor, job_id=self.job_id, step=step)})
            return metrics | self._phase("rollout", step, {a: agent_rollout.submit(actor=self.actor, job_id=self.job_id, agent=a, step=step)
                                                           for a in self.agents})

    def update(self, step: int) -> dict[str, float]:
        with remote_options(num_cpus=0, max_retries=0):
            metrics = self._phase("update", step, {a: agent_update.submit(actor=self.actor, job_id=self.job_id, agent=a, step=step)
                                                   for a in self.agents})
        ray.get(self.actor.after_updates.remote(step))
        return metrics

    def evaluate(self, step: int) -> Evaluation:
        with remote_options(num_cpus=0, max_retries=0):
            return selfplay_evaluate.submit(actor=self.actor, job_id=self.job_id, step=step).result()

    def checkpoint(self, step: int, metrics: list) -> dict[str, Any]:
        with remote_options(num_cpus=0, max_retries=0):
            return selfplay_checkpoint.submit(actor=self.actor, job_id=self.job_id, step=step, metrics=metrics).result()
