"""Prefect tasks: one per kind of step, each a thin call into the job's actors by handle."""

from tasks.steps import checkpoint, evaluate, rollout, update

__all__ = ["rollout", "update", "evaluate", "checkpoint"]
