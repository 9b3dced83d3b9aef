"""Run a job in this process: rollout → update → (evaluate) → (checkpoint), resumable.

This is the step sequence the Prefect flow runs as tasks; here it runs as plain calls, for the
demo, benchmarks, tests and notebooks. Progress goes to a callback so the caller picks the UI.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from opentinker import checkpoint as ckpt
from opentinker.spec import JobSpec
from opentinker.storage import check_job_storage
from opentinker.workers import EvalResult, PolicyWorker, RolloutWorker, seed_everything


@dataclass
class StepReport:
    step: int
    total_steps: int
    metrics: dict[str, float]
    evaluation: EvalResult | None = None
    checkpoint: ckpt.CheckpointRef | None = None


@dataclass
class JobResult:
    job_id: str
    steps_done: int
    resumed_from: int
    history: list[dict[str, float]] = field(default_factory=list)
    evaluations: list[EvalResult] = field(default_factory=list)
    checkpoint: ckpt.CheckpointRef | None = None
    seconds: float = 0.0


def new_job_id(spec: JobSpec) -> str:
    return spec.job_id or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class LocalJob:
    """Policy and rollout workers sharing one model in this process."""

    def __init__(self, spec: JobSpec, job_id: str | None = None):
        check_job_storage(spec)  # before the model loads: a wrong bucket fails in one line, at once
        self.spec = spec
        self.job_id = job_id or new_job_id(spec)
        seed_everything(spec.seed)
        self.policy = PolicyWorker(spec, job_id=self.job_id)
        self.rollout = RolloutWorker(spec, self.policy.model, self.policy.tokenizer)

    def restore_latest(self) -> int:
        """Continue from the job's latest complete checkpoint; returns the step to start from."""
        restored = self.policy.restore_latest(self.job_id)
        if restored is None:
            return 0
        _, loaded = restored
        self.rollout.load_env_state(loaded.state["env"])
        self.rollout.set_version(self.policy.version)
        return loaded.step

    def rollout_step(self, step: int):
        return self.rollout.rollout(step)

    def update_step(self, batch) -> dict[str, float]:
        metrics = self.policy.update(batch)
        self.rollout.set_version(self.policy.version)  # shared model: the handshake is the version
        return metrics

    def checkpoint_step(self, step: int) -> ckpt.CheckpointRef:
        return self.policy.save(step, self.job_id, self.rollout.env_state())

    def run(self, on_step: Callable[[StepReport], Any] | None = None, on_eval: Callable[[EvalResult], Any] | None = None) -> JobResult:
        spec = self.spec
        t_start = time.perf_counter()
        start = self.restore_latest()
        result = JobResult(job_id=self.job_id, steps_done=start, resumed_from=start)
        total = spec.optimization.steps
        if start == 0 and total > 0:
            ev = self.rollout.evaluate(0)
            result.evaluations.append(ev)
            if on_eval:
                on_eval(ev)
        for step in range(start, total):
            t0 = time.perf_counter()
            batch = self.rollout_step(step)
            metrics = dict(batch.metrics) | self.update_step(batch)
            done = step + 1
            evaluation = None
            if spec.evaluates_at(done):
                evaluation = self.rollout.evaluate(done)
                metrics |= evaluation.metrics
                result.evaluations.append(evaluation)
                if on_eval:
                    on_eval(evaluation)
            ref = None
            if spec.checkpoints_at(done):
                ref = self.checkpoint_step(done)
                result.checkpoint = ref
            metrics["step/seconds"] = time.perf_counter() - t0
            result.history.append({"step": float(done), **metrics})
            result.steps_done = done
            if on_step:
                on_step(StepReport(done, total, metrics, evaluation, ref))
        if result.checkpoint is None:
            result.checkpoint = ckpt.latest_checkpoint(spec.checkpoint.base_url, self.job_id)
        result.seconds = time.perf_counter() - t_start
        return result
