"""Job health: failed episodes are a signal, not a footnote. A step whose failure rate is above
`health.max_failure_rate` is unhealthy, and so is a step where every episode failed or was cut at
`rollout.max_total_tokens` (nothing in it reached its end: a job that trains nothing is not a
success); `health.unhealthy_steps` of them in a row fail the job with the most common reason; a
job whose last step or last evaluation is unhealthy is not registered (and so never promoted)."""

from __future__ import annotations

from typing import Any

from opentinker.core.spec import HealthSpec


class JobUnhealthy(RuntimeError):
    """Episodes keep failing: the message says how many and why."""


def _rate(metrics: dict[str, Any], prefix: str) -> float:
    episodes = float(metrics.get(f"{prefix}/episodes", 0) or 0)
    return float(metrics.get(f"{prefix}/failed_episodes", 0)) / episodes if episodes else 0.0


def _none_ended(metrics: dict[str, Any], prefix: str) -> bool:
    """Every episode failed or was truncated (at max_total_tokens), some truncated (failures alone
    are judged by the rate, which an operator may set to tolerate them all)."""
    episodes = float(metrics.get(f"{prefix}/episodes", 0) or 0)
    truncated = float(metrics.get(f"{prefix}/truncated_episodes", 0))
    return episodes > 0 and truncated > 0 and float(metrics.get(f"{prefix}/failed_episodes", 0)) + truncated >= episodes


def _unhealthy(metrics: dict[str, Any], prefix: str, spec: HealthSpec) -> bool:
    return _rate(metrics, prefix) > spec.max_failure_rate or _none_ended(metrics, prefix)


def _why(metrics: dict[str, Any], prefix: str) -> str:
    reasons = [str(metrics[k]) for k in (f"{prefix}/first_failure", f"{prefix}/first_truncation") if metrics.get(k)]
    return "; ".join(reasons) or "no reason recorded"


def _what(metrics: dict[str, Any], prefix: str, where: str) -> str:
    """`60% of step 3's episodes failed`, or for a step none of whose episodes ended: that."""
    rate = _rate(metrics, prefix)
    if _none_ended(metrics, prefix):
        return f"every episode of {where} failed or was cut at rollout.max_total_tokens"
    return f"{rate:.0%} of {where}'s episodes failed"


class Health:
    def __init__(self, spec: HealthSpec):
        self.spec = spec
        self.unhealthy_in_a_row = 0
        self.last: dict[str, Any] = {}

    def after_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Count the step; JobUnhealthy once `unhealthy_steps` steps in a row were unhealthy."""
        self.last = metrics
        self.unhealthy_in_a_row = self.unhealthy_in_a_row + 1 if _unhealthy(metrics, "rollout", self.spec) else 0
        if self.unhealthy_in_a_row >= self.spec.unhealthy_steps:
            raise JobUnhealthy(f"episodes keep failing: {_what(metrics, 'rollout', f'step {step}')}, {self.unhealthy_in_a_row} steps "
                               f"in a row unhealthy (health.max_failure_rate={self.spec.max_failure_rate:g}); {_why(metrics, 'rollout')}")

    def registrable(self, evaluation: dict[str, Any] | None) -> str | None:
        """Why the job's final checkpoint must not be registered, or None."""
        if self.last and _unhealthy(self.last, "rollout", self.spec):
            return f"not registered: {_what(self.last, 'rollout', 'the last step')}; {_why(self.last, 'rollout')}"
        if evaluation and _unhealthy(evaluation, "eval", self.spec):
            return f"not registered: {_what(evaluation, 'eval', 'the final evaluation')}; {_why(evaluation, 'eval')}"
        return None
