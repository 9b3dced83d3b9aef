"""Per-job Ray actors that hold model state for the whole job; Prefect tasks call them by handle.

- `TrainerActor`: policy + optimizer + reference (update, checkpoint, restore, weights).
- `RolloutActor`: inference engine + environment (rollout, evaluate); keeps the last batch so
  that trajectories travel actor-to-actor through Ray's object store, never through Prefect.
- `ColocatedActor`: both in one process sharing one model copy. This is the CPU default: there
  is no second copy of the weights, and weight sync is only the version handshake. On a GPU the
  same colocation shares the device memory between training and generation (no second copy);
  `resources.colocate: false` gives each its own process (and device), with trainable weights
  pushed trainer → rollout after every update, tagged with the policy version.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from opentinker.spec import JobSpec
from opentinker.workers import PolicyWorker, RolloutBatch, RolloutWorker, seed_everything


def _torch_threads(spec: JobSpec) -> None:
    import torch

    torch.set_num_threads(spec.resources.torch_threads or os.cpu_count() or 1)


class TrainerActor:
    def __init__(self, spec: JobSpec, job_id: str):
        _torch_threads(spec)
        seed_everything(spec.seed)
        self.spec, self.job_id = spec, job_id
        self.policy = PolicyWorker(spec, job_id=job_id)

    def ready(self) -> int:
        return self.policy.version

    def restore_latest(self) -> dict[str, Any] | None:
        """Load the job's latest complete checkpoint; returns its step and environment state."""
        restored = self.policy.restore_latest(self.job_id)
        if restored is None:
            return None
        ref, loaded = restored
        return {"step": loaded.step, "env": loaded.state["env"], "version": self.policy.version, "url": ref.url,
                "metrics": loaded.state.get("metrics", [])}

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        return self.policy.update(batch)

    def weights(self) -> tuple[int, dict]:
        return self.policy.weights()

    def checkpoint(self, step: int, env_state: dict[str, Any], metrics: list = ()) -> str:
        return self.policy.save(step, self.job_id, env_state, metrics).url


class RolloutActor:
    def __init__(self, spec: JobSpec, job_id: str, model=None, tokenizer=None):
        _torch_threads(spec)
        if model is None:
            from opentinker.models import load_model
            from opentinker.workers import pinned_init_from

            model, tokenizer = load_model(spec.model.name, spec.model.dtype, init_from=pinned_init_from(spec, job_id))
            if spec.adapter.kind == "lora":
                from opentinker.backend.trainer import wrap_model

                model = wrap_model(model, spec.adapter)  # same parameter names as the trainer's
        self.worker = RolloutWorker(spec, model, tokenizer)
        self._batches: dict[int, RolloutBatch] = {}

    def ready(self) -> int:
        return self.worker.engine.policy_version

    def rollout(self, step: int) -> dict[str, float]:
        batch = self.worker.rollout(step)
        self._batches = {step: batch}  # only the newest batch is kept
        return batch.metrics | {"rollout/policy_version": float(batch.policy_version)}

    def batch(self, step: int) -> RolloutBatch:
        if step not in self._batches:
            raise KeyError(f"no rollout batch for step {step} (have {sorted(self._batches)})")
        return self._batches[step]

    def evaluate(self, step: int) -> dict[str, Any]:
        result = self.worker.evaluate(step)
        return {"metrics": result.metrics, "transcripts": result.transcripts}

    def sync(self, weights: tuple[int, dict]) -> int:
        """Weight-sync handshake: adopt (version, weights) from the trainer; versions only go up."""
        version, state = weights
        if version < self.worker.engine.policy_version:
            raise ValueError(f"refusing policy version {version}: engine already at {self.worker.engine.policy_version}")
        self.worker.set_version(version, state)
        return version

    def env_state(self) -> dict[str, Any]:
        return self.worker.env_state()

    def load_env_state(self, state: dict[str, Any]) -> None:
        self.worker.load_env_state(state)


class ColocatedActor(TrainerActor, RolloutActor):
    """Trainer and rollout engine in one process, sharing one model object."""

    def __init__(self, spec: JobSpec, job_id: str):
        TrainerActor.__init__(self, spec, job_id)
        RolloutActor.__init__(self, spec, job_id, self.policy.model, self.policy.tokenizer)

    def ready(self) -> int:
        return self.policy.version

    def update_from_last_batch(self, step: int) -> dict[str, float]:
        metrics = self.update(self.batch(step))
        self.worker.set_version(self.policy.version)
        return metrics

    def checkpoint_now(self, step: int, metrics: list = ()) -> str:
        return self.checkpoint(step, self.env_state(), metrics)

    def restore_latest(self) -> dict[str, Any] | None:
        restored = TrainerActor.restore_latest(self)
        if restored:
            self.load_env_state(restored["env"])
            self.worker.set_version(restored["version"])
        return restored


@dataclass
class JobActors:
    """Handles of one job's actors (the same handle twice when colocated)."""

    trainer: Any
    rollout: Any
    colocated: bool


def create_actors(spec: JobSpec, job_id: str) -> JobActors:
    """Start the job's actors with the resources the spec asks for, and wait until they are up."""
    import ray

    r = spec.resources
    threads = str(r.torch_threads or os.cpu_count() or 1)
    options = {
        "num_cpus": r.num_cpus,
        "num_gpus": r.num_gpus,
        "max_restarts": 0,
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}},
    }
    if r.colocate:
        handle = ray.remote(ColocatedActor).options(name=f"{job_id}-colocated", **options).remote(spec, job_id)
        ray.get(handle.ready.remote())
        return JobActors(trainer=handle, rollout=handle, colocated=True)
    trainer = ray.remote(TrainerActor).options(name=f"{job_id}-trainer", **options).remote(spec, job_id)
    rollout = ray.remote(RolloutActor).options(name=f"{job_id}-rollout", **options).remote(spec, job_id)
    ray.get([trainer.ready.remote(), rollout.ready.remote()])
    ray.get(rollout.sync.remote(trainer.weights.remote()))  # identical starting weights (LoRA init is random)
    return JobActors(trainer=trainer, rollout=rollout, colocated=False)


def check_placeable(spec: JobSpec) -> None:
    """Fail now, with the numbers, when the cluster can never place the job's actors (Ray would wait forever)."""
    import ray

    total = ray.cluster_resources()
    r = spec.resources
    need_cpu = r.num_cpus * (1 if r.colocate else 2)
    need_gpu = r.num_gpus * (1 if r.colocate else 2)
    if need_gpu > total.get("GPU", 0):
        raise RuntimeError(f"resources.num_gpus: the job needs {need_gpu:g} GPU(s), the Ray cluster has {total.get('GPU', 0):g}")
    if need_cpu > total.get("CPU", 0):
        raise RuntimeError(f"resources.num_cpus: the job needs {need_cpu:g} CPU(s), the Ray cluster has {total.get('CPU', 0):g}")


class MultiAgentActor:
    """A self-play job's agents in one process (on CPU they share the cores anyway); the flow
    drives its phases as separate Prefect tasks per agent."""

    def __init__(self, spec: JobSpec, job_id: str):
        from opentinker.multiagent import MultiAgentJob

        _torch_threads(spec)
        self.job = MultiAgentJob(spec, job_id)
        self._batches: dict[str, Any] = {}

    def learners(self) -> list[str]:
        return list(self.job.learners)

    def restore_latest(self) -> tuple[int, list]:
        return self.job.restore_latest(), self.job.restored_metrics

    def play(self, step: int) -> dict[str, float]:
        self._batches = {}
        return self.job.play_step(step)

    def collect(self, agent: str, step: int) -> dict[str, float]:
        self._batches[agent] = batch = self.job.collect(agent, step)
        return batch.metrics

    def update(self, agent: str, step: int) -> dict[str, float]:
        batch = self._batches.get(agent)
        if batch is None or batch.step != step:
            raise RuntimeError(f"update of {agent} for step {step}, but its last rollout was {'none' if batch is None else f'step {batch.step}'}")
        return self.job.update(agent, batch)

    def after_updates(self, step: int) -> None:
        self.job.after_updates(step)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.job.evaluate(step)

    def checkpoint(self, step: int, metrics: list = ()) -> dict[str, str]:
        return self.job.checkpoint(step, metrics)


def create_multiagent_actor(spec: JobSpec, job_id: str):
    import ray

    r = spec.resources
    threads = str(r.torch_threads or os.cpu_count() or 1)
    handle = ray.remote(MultiAgentActor).options(
        name=f"{job_id}-agents", num_cpus=r.num_cpus, num_gpus=r.num_gpus, max_restarts=0,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}},
    ).remote(spec, job_id)
    ray.get(handle.learners.remote())
    return handle
