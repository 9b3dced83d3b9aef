"""Prefect tasks: one per kind of step, each a thin call into the job's actors by handle."""

from tasks.steps import TaskSteps, checkpoint, evaluate, rollout, update

__all__ = ["TaskSteps", "rollout", "update", "evaluate", "checkpoint"]
