"""Long-lived workers that hold model state; the step functions are thin calls into them.

`PolicyWorker` owns the policy, optimizer and reference (update, checkpoint, restore).
`RolloutWorker` owns the inference engine and the environment (rollout, evaluate).
A workflow engine may host each in its own process (a Ray actor) or both in one; on a CPU
machine they share one model object and weight sync is only a version handshake.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from opentinker import checkpoint as ckpt
from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams
from opentinker.env import GameEnvironment, environment_from_spec
from opentinker.metrics import episode_stats, transcripts
from opentinker.models import POLICY_FILE, load_model, policy_info, read_policy_info, resolve_checkpoint
from opentinker.spec import JobSpec, LoraSpec, dump_spec
from opentinker.trajectory import Trajectory


@dataclass
class RolloutBatch:
    step: int
    policy_version: int
    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EvalResult:
    step: int
    metrics: dict[str, float]
    transcripts: list[dict[str, Any]]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pinned_init_from(spec: JobSpec, job_id: str | None) -> str | None:
    """The checkpoint `model.init_from` means for this job, resolved once: a resumed job reuses
    what its latest checkpoint recorded, so a registry alias that moved since cannot change the
    base under trained weights."""
    if not spec.model.init_from:
        return None
    latest = ckpt.latest_checkpoint(spec.checkpoint.base_url, job_id) if job_id else None
    if latest is not None:
        recorded = read_policy_info(latest.url).get("init_from")
        if recorded:
            return recorded
    return resolve_checkpoint(spec.model.init_from)


class PolicyWorker:
    def __init__(self, spec: JobSpec, model=None, tokenizer=None, job_id: str | None = None):
        self.spec = spec
        self.init_from = pinned_init_from(spec, job_id)
        if model is None:
            model, tokenizer = load_model(spec.model.name, spec.model.dtype, init_from=self.init_from)
        self.tokenizer = tokenizer
        self.trainer = PolicyTrainer(model, tokenizer, spec.adapter, spec.algorithm, spec.optimization, spec.rollout.temperature)

    @property
    def model(self):
        return self.trainer.model

    @property
    def version(self) -> int:
        return self.trainer.version

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        return self.trainer.update(batch.trajectories)

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Trainable weights and their version, for a rollout engine in another process."""
        return self.trainer.version, self.trainer.trainable_state()

    def save(self, step: int, job_id: str, env_state: dict[str, Any],
             metrics: list[tuple[int, dict[str, float]]] = ()) -> ckpt.CheckpointRef:
        """Commit the policy at `step`. `metrics` are the steps' metrics this checkpoint covers:
        they travel with it so a resume can log any that a crash kept from reaching MLflow."""
        extra = {"spec.yaml": dump_spec(self.spec).encode(),
                 POLICY_FILE: json.dumps(policy_info(self.spec, self.init_from)).encode()}
        if isinstance(self.spec.adapter, LoraSpec):
            extra |= _adapter_files(self.trainer.model)
        return ckpt.save_checkpoint(
            self.spec.checkpoint.base_url, job_id, step,
            weights=self.trainer.trainable_state(),
            optimizer_state=self.trainer.optimizer.state_dict(),
            state={"policy_version": self.trainer.version, "env": env_state,
                   "metrics": [[int(s), {k: float(v) for k, v in m.items()}] for s, m in metrics]},
            extra_files=extra,
            keep_last=self.spec.checkpoint.keep_last,
        )

    def restore_latest(self, job_id: str) -> tuple[ckpt.CheckpointRef, ckpt.LoadedCheckpoint] | None:
        """Load the job's latest complete checkpoint, if any (weights, optimizer, version, RNG)."""
        ref = ckpt.latest_checkpoint(self.spec.checkpoint.base_url, job_id)
        return None if ref is None else (ref, self.restore(ref.url))

    def restore(self, url: str) -> ckpt.LoadedCheckpoint:
        loaded = ckpt.load_checkpoint(url)
        self.trainer.load_trainable_state(loaded.weights)
        self.trainer.optimizer.load_state_dict(loaded.optimizer_state)
        self.trainer.version = int(loaded.state["policy_version"])
        ckpt.set_rng_state(loaded.rng)
        return loaded


def _adapter_files(model) -> dict[str, bytes]:
    """The LoRA adapter in peft's own layout, so the checkpoint loads with PeftModel.from_pretrained."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return {f"adapter/{p.name}": p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


class RolloutWorker:
    def __init__(self, spec: JobSpec, model, tokenizer, env: GameEnvironment | None = None):
        self.spec = spec
        r = spec.rollout
        self.engine = HFRolloutEngine(model, tokenizer, max_batch_size=max(64, r.prompts_per_step * r.group_size),
                                      prefix_cache_tokens=r.prefix_cache_tokens if r.max_turns > 1 else 0)  # one turn: nothing to reuse
        self.chat = ChatFormat(tokenizer)
        self.env = env or environment_from_spec(spec)
        self.limits = EpisodeLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, step_timeout_s=r.step_timeout_s)
        self.train_params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)

    def set_version(self, version: int, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Weight sync handshake: load new weights (if the model is not shared) and adopt the version."""
        if weights is not None:
            named = dict(self.engine.model.named_parameters())
            with torch.no_grad():
                for name, tensor in weights.items():
                    named[name].copy_(tensor)
        self.engine.policy_version = version

    def rollout(self, step: int) -> RolloutBatch:
        t0 = time.perf_counter()
        r = self.spec.rollout
        tasks = self.env.train_tasks(r.prompts_per_step)
        expanded = [t for t in tasks for _ in range(r.group_size)]
        groups = [step * r.prompts_per_step + i for i in range(len(tasks)) for _ in range(r.group_size)]
        tokens0, gen0 = self.engine.generated_tokens, self.engine.generate_seconds
        trajs = run_episodes(self.engine, self.chat, [self.env.make_game() for _ in expanded], expanded, self.train_params, self.limits, groups)
        self.engine.prefix_cache.clear()  # the episodes are over: free their states before the update
        gen_tokens = self.engine.generated_tokens - tokens0
        gen_seconds = self.engine.generate_seconds - gen0
        metrics = episode_stats(trajs, "rollout") | {
            "rollout/generated_tokens": float(gen_tokens),
            "rollout/tokens_per_s": gen_tokens / gen_seconds if gen_seconds else 0.0,
            "rollout/seconds": time.perf_counter() - t0,
        }
        return RolloutBatch(step=step, policy_version=self.engine.policy_version, trajectories=trajs, metrics=metrics)

    def evaluate(self, step: int) -> EvalResult:
        t0 = time.perf_counter()
        e, r = self.spec.evaluation, self.spec.rollout
        tasks = self.env.validation_tasks(e.n_samples)
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, greedy=e.greedy)
        trajs = run_episodes(self.engine, self.chat, [self.env.make_game() for _ in tasks], tasks, params, self.limits)
        self.engine.prefix_cache.clear()
        metrics = episode_stats(trajs, "eval") | {"eval/seconds": time.perf_counter() - t0}
        return EvalResult(step=step, metrics=metrics, transcripts=transcripts(trajs))

    def env_state(self) -> dict[str, Any]:
        return self.env.state()

    def load_env_state(self, state: dict[str, Any]) -> None:
        self.env.load_state(state)
