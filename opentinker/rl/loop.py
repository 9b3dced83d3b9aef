"""The RL step loop, the one place that says what a training step is.

    restore → evaluate (step 0) → for each step: rollout → update → evaluate (every k)
                                                → checkpoint (every k, with the metrics it covers)

The job's state lives behind a `StepRunner`: an `RLJob` or `SelfPlayJob` in this process (the
CLI's `run`, tests, benchmarks, notebooks), or the same objects in Ray actors reached through
Prefect tasks (the flows). What the caller does with progress (print it, log it to MLflow) comes
in through `LoopHooks`. A step's metrics are "committed" once a checkpoint covers them: a flow
logs them to MLflow then, so after a crash and resume each step reaches MLflow exactly once.
Failed episodes count (opentinker.rl.health): too many steps in a row with too many of them
fail the job with the reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentinker.core.own_servers import ServerGone
from opentinker.core.spec import JobSpec
from opentinker.rl.health import Health
from opentinker.rl.policy import Restored
from opentinker.rl.sampler import Evaluation

StepMetrics = list[tuple[int, dict[str, float]]]
log = logging.getLogger(__name__)


class StepRunner(Protocol):
    def restore(self) -> Restored | None:
        """Continue from the job's newest intact checkpoint, if any (see Restored.skipped)."""

    def rollout(self, step: int) -> dict[str, float]:
        """Play the step's episodes; the batch stays with the runner."""

    def update(self, step: int) -> dict[str, float]:
        """One policy update on the step's batch, then the weight-sync handshake."""

    def evaluate(self, step: int) -> Evaluation:
        """The validation episodes."""

    def checkpoint(self, step: int, metrics: StepMetrics) -> Any:
        """Commit the job's state at `step`, carrying `metrics`; returns what was written."""

    # optional: `restart_server()`, a new inference server for a job whose own died (ServerGone)


@dataclass
class StepReport:
    step: int
    total_steps: int
    metrics: dict[str, float]
    evaluation: Evaluation | None = None
    checkpoint: Any = None


@dataclass
class LoopHooks:
    """What the caller does as the loop goes; every hook is optional."""

    on_restore: Callable[[Restored], Any] | None = None
    on_eval: Callable[[Evaluation], Any] | None = None
    on_commit: Callable[[StepMetrics], Any] | None = None
    on_step: Callable[[StepReport], Any] | None = None


@dataclass
class LoopResult:
    resumed_from: int
    steps_done: int
    history: list[dict[str, float]] = field(default_factory=list)  # one entry per trained step, as committed
    evaluations: list[Evaluation] = field(default_factory=list)
    checkpoint: Any = None  # the newest checkpoint written or restored
    seconds: float = 0.0  # everything, restore and the first evaluation included
    loop_seconds: float = 0.0  # the steps alone
    not_registrable: str | None = None  # why the final checkpoint must not be registered (job health)
    skipped: list[str] = field(default_factory=list)  # checkpoint folders resume refused, one line each
    restarted: str | None = None  # why the job's inference server was started again mid-job (the ServerGone line), if it was


def _call(hook: Callable | None, *args: Any) -> None:
    if hook is not None:
        hook(*args)


def run_steps(spec: JobSpec, runner: StepRunner, hooks: LoopHooks | None = None) -> LoopResult:
    """Train `spec.optimization.steps` steps (resuming where the runner's checkpoints stop). A job
    whose own inference server dies (ServerGone) gets one new server and goes on from its last
    checkpoint (`restart_server`, then `restore`), within the job, before it fails."""
    hooks = hooks or LoopHooks()
    health = Health(spec.health)
    t_start = time.perf_counter()
    restored = runner.restore()
    start = restored.step if restored else 0
    if restored:
        _call(hooks.on_restore, restored)
    result = LoopResult(resumed_from=start, steps_done=start, checkpoint=restored.checkpoint if restored else None,
                        skipped=restored.skipped if restored else [])
    total = spec.optimization.steps
    pending: StepMetrics = []  # metrics no checkpoint covers yet
    updated = False  # the policy moved since the newest checkpoint (a restart needs one to go back to)

    def evaluate(done: int) -> Evaluation:
        evaluation = runner.evaluate(done)
        result.evaluations.append(evaluation)
        _call(hooks.on_eval, evaluation)
        return evaluation

    def steps_from(first: int) -> None:
        nonlocal updated
        if first == 0 and total > 0 and not pending:
            pending.append((0, evaluate(0).metrics))
        for step in range(first, total):
            done, t0 = step + 1, time.perf_counter()
            metrics = runner.rollout(step)
            t1 = time.perf_counter()
            metrics |= runner.update(step)
            updated = True
            t2 = time.perf_counter()
            evaluation = evaluate(done) if spec.evaluates_at(done) else None
            if evaluation is not None:
                metrics |= evaluation.metrics
            metrics["step/seconds"] = time.perf_counter() - t0
            metrics["step/trainer_busy"] = (t2 - t1) / max(t2 - t0, 1e-9)  # the update's share of rollout wait + update
            pending.append((done, metrics))
            written = None
            if spec.checkpoints_at(done):
                written = result.checkpoint = runner.checkpoint(done, list(pending))
                updated = False
                _call(hooks.on_commit, list(pending))
                result.history.extend({"step": float(s), **m} for s, m in pending if s > 0)
                pending.clear()
            result.steps_done = done
            _call(hooks.on_step, StepReport(done, total, metrics, evaluation, written))
            health.after_step(done, metrics)  # after the step is logged: a failing job still shows why

    loop_start = time.perf_counter()
    try:
        steps_from(start)
    except ServerGone as gone:
        restart = getattr(runner, "restart_server", None)
        if restart is None or (updated and result.checkpoint is None):  # no checkpoint to go back to
            raise
        log.warning("%s: starting a new server and resuming from the last checkpoint, once", gone)
        restart()
        restored = runner.restore()
        again = restored.step if restored and restored.resumed else 0
        del pending[len([s for s, _ in pending if s <= again]):]  # steps after the checkpoint are trained again
        result.restarted = str(gone)
        steps_from(again)  # a second ServerGone fails the job
    end = time.perf_counter()
    result.seconds, result.loop_seconds = end - t_start, end - loop_start
    result.not_registrable = health.registrable(result.evaluations[-1].metrics if result.evaluations else None)
    return result
