"""An RL job in one process: the policy and the sampler share one model.

This is the colocated layout, the default everywhere: no second copy of the weights, and weight
sync is only the version handshake. Off-policy (`algorithm.max_staleness` > 0) the sampler's
producer plays while the trainer updates, so it samples from a copy of its own that takes the
policy's weights after each update. The same object runs a job in this process (`run`: the CLI's
`opentinker run`, tests, benchmarks, notebooks) and, hosted in a Ray actor, the steps of a flow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentinker.backend.device import check_gpus
from opentinker.core.ids import job_id_for
from opentinker.core.seeding import seed_everything
from opentinker.core.spec import JobSpec
from opentinker.rl.engine_choice import choose_engine
from opentinker.rl.loop import LoopHooks, LoopResult, StepMetrics, StepReport, run_steps
from opentinker.rl.policy import Policy, Restored, with_pinned_init_from
from opentinker.rl.sampler import EarlyStart, Evaluation, Sampler, StartServer, abandon
from opentinker.storage import checkpoint as ckpt
from opentinker.storage.preflight import check_job_storage


class RLJob:
    """A `StepRunner` (see opentinker.rl.loop) over a policy and a sampler sharing one model."""

    def __init__(self, spec: JobSpec, job_id: str | None = None, start_server: StartServer | None = None,
                 tenant: str | None = None, model: Any = None, tokenizer: Any = None, rollout_engine: Any = None):
        """`start_server` starts the job's own inference server for `rollout.engine: vllm` or
        `server` (opentinker.inference.launch.rollout_server; the runtime's callers pass it; without
        it `auto` chooses `local`). `tenant` is
        whose job it is (its checkpoints are signed as such; None: the operator's). A host that
        shares a base gives the job's `model` (an AdapterModel), `tokenizer` and `rollout_engine`;
        the job then leaves the process's global seeds alone (other jobs draw from them): it samples
        from the engine's own generator, which its checkpoints keep. A job id
        that is not one folder name (core/ids.py) is refused first: InvalidJobId, nothing written."""
        job_id = job_id_for(spec, job_id)
        spec, self.engine_choice = choose_engine(spec, starts_servers=start_server is not None and rollout_engine is None)
        check_job_storage(spec)  # before the model loads: a wrong bucket fails in one line, at once
        check_gpus(spec.resources.num_gpus)
        spec = with_pinned_init_from(spec, job_id, tenant)  # one base for the policy, its server and its sampler
        self.spec = spec
        self.job_id = job_id
        if model is None:
            seed_everything(spec.seed)
        own_rng = getattr(rollout_engine, "generator", None)  # a hosted job's own sampling stream (AdapterRollouts)
        # a hosted job's checkpoints keep its own generators: its sampling stream and its adapter's dropout
        own_rngs = None if own_rng is None else {"own": own_rng, "dropout": model.dropout_generator}
        start_server = EarlyStart.of(start_server, spec, job_id, rollout_engine)  # the server starts beside the policy's load
        try:
            self.policy = Policy(spec, job_id=self.job_id, model=model, tokenizer=tokenizer, tenant=tenant, own_rngs=own_rngs)
            # Off-policy (max_staleness > 0) the producer samples while the trainer updates: from a model copy of its own
            self.own_copy = spec.algorithm.max_staleness > 0
            shared = (None, None) if self.own_copy else (self.policy.model, self.policy.tokenizer)
            self.sampler = Sampler(spec, *shared, job_id=self.job_id, where=self.policy.placement, start_server=start_server,
                                   engine=rollout_engine)
        except BaseException:
            abandon(start_server)
            raise
        if self.own_copy:
            self.sampler.sync(self.policy.weights())  # identical starting weights (LoRA init is random)

    def precision(self) -> str:
        return self.policy.precision()

    def _sync(self) -> None:
        """The policy's version to the sampler (and its weights, to a copy of its own)."""
        self.sampler.sync(self.policy.weights() if self.own_copy else self.policy.version)

    def restore(self) -> Restored | None:
        restored = self.policy.restore_latest()
        if restored is not None and restored.resumed:
            self.sampler.load_env_state(restored.env_state)
            self._sync()
        return restored

    def rollout(self, step: int) -> dict[str, float]:
        return self.sampler.rollout(step)

    def restart_server(self) -> None:
        self.sampler.restart_server()

    def update(self, step: int) -> dict[str, float]:
        metrics = self.policy.update(self.sampler.batch(step))
        self._sync()
        return metrics

    def evaluate(self, step: int) -> Evaluation:
        return self.sampler.evaluate(step)

    def checkpoint(self, step: int, metrics: StepMetrics = ()) -> ckpt.CheckpointRef:
        return self.policy.save(step, self.sampler.env_state(), metrics)

    def run(self, on_step: Callable[[StepReport], Any] | None = None,
            on_eval: Callable[[Evaluation], Any] | None = None) -> LoopResult:
        """Train to `optimization.steps` in this process, resuming from the latest checkpoint."""
        return run_steps(self.spec, self, LoopHooks(on_step=on_step, on_eval=on_eval))

    def close(self) -> None:
        """Stop what the job started (its own inference server, with `rollout.engine: server`)."""
        self.sampler.close()
