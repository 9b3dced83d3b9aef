"""Job health: failed episodes are a signal, not a footnote. A step whose failure rate is above
`health.max_failure_rate` is unhealthy; `health.unhealthy_steps` of them in a row fail the job
with the most common reason; a job whose last step or last evaluation is unhealthy is not
registered (and so never promoted)."""

from __future__ import annotations

from typing import Any

from opentinker.core.spec import HealthSpec


class JobUnhealthy(RuntimeError):
    """Episodes keep failing: the message says how many and why."""


def _rate(metrics: dict[str, Any], prefix: str) -> float:
    episodes = float(metrics.get(f"{prefix}/episodes", 0) or 0)
    return float(metrics.get(f"{prefix}/failed_episodes", 0)) / episodes if episodes else 0.0


def _why(metrics: dict[str, Any], prefix: str) -> str:
    return str(metrics.get(f"{prefix}/first_failure") or "no reason recorded")


class Health:
    def __init__(self, spec: HealthSpec):
        self.spec = spec
        self.unhealthy_in_a_row = 0
        self.last: dict[str, Any] = {}

    def after_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Count the step; JobUnhealthy once `unhealthy_steps` steps in a row were unhealthy."""
        self.last = metrics
        rate = _rate(metrics, "rollout")
        self.unhealthy_in_a_row = self.unhealthy_in_a_row + 1 if rate > self.spec.max_failure_rate else 0
        if self.unhealthy_in_a_row >= self.spec.unhealthy_steps:
            raise JobUnhealthy(f"episodes keep failing: {rate:.0%} of step {step}'s episodes failed, {self.unhealthy_in_a_row} steps "
                               f"in a row above health.max_failure_rate={self.spec.max_failure_rate:g}; {_why(metrics, 'rollout')}")

    def registrable(self, evaluation: dict[str, Any] | None) -> str | None:
        """Why the job's final checkpoint must not be registered, or None."""
        if self.last and _rate(self.last, "rollout") > self.spec.max_failure_rate:
            return f"not registered: {_rate(self.last, 'rollout'):.0%} of the last step's episodes failed; {_why(self.last, 'rollout')}"
        if evaluation and _rate(evaluation, "eval") > self.spec.max_failure_rate:
            return f"not registered: {_rate(evaluation, 'eval'):.0%} of the final evaluation's episodes failed; {_why(evaluation, 'eval')}"
        return None
