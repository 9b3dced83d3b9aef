"""The policy a job trains: the model with its adapter and optimizer (a `PolicyTrainer`), and its
checkpoints (save, restore)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.backend import PolicyTrainer
from opentinker.backend.critic import CRITIC_FILE
from opentinker.backend.sharded import ShardedPolicyTrainer
from opentinker.backend.device import placement, precision_line, sampling_dtype
from opentinker.core.ids import check_folder_name
from opentinker.core.spec import JobSpec, LoraSpec, dump_spec
from opentinker.model import POLICY_FILE, adapter_files, load_model, policy_info, read_policy_info
from opentinker.storage import checkpoint as ckpt
from opentinker.storage.resolve import resolve_checkpoint


@dataclass
class Restored:
    """What a job got back from its newest intact checkpoint; with `checkpoint` None, only the
    folders it skipped (none was intact: the job starts over)."""

    step: int
    checkpoint: Any  # a CheckpointRef (per agent for self-play: {agent: CheckpointRef})
    env_state: dict[str, Any] | None  # None when nothing was restored (see `resumed`)
    metrics: list = field(default_factory=list)  # the (step, metrics) the checkpoint covers
    skipped: list[str] = field(default_factory=list)  # one line per newer folder refused (see newest_intact)

    @property
    def resumed(self) -> bool:
        """False when folders were there but none was intact: the job starts over (checkpoint None)."""
        return self.checkpoint is not None


def pinned_init_from(spec: JobSpec, job_id: str | None, tenant: str | None = None) -> str | None:
    """The checkpoint `model.init_from` means for this job, resolved once: a resumed job reuses
    what its latest own checkpoint recorded, so a registry alias that moved since cannot change the
    base under trained weights."""
    if not spec.model.init_from:
        return None
    latest = ckpt.latest_checkpoint(spec.checkpoint.base_url, job_id, ckpt.Owner(job_id, tenant)) if job_id else None
    if latest is not None:
        recorded = read_policy_info(latest.url).get("init_from")
        if recorded:
            return recorded
    return resolve_checkpoint(spec.model.init_from)


def with_pinned_init_from(spec: JobSpec, job_id: str | None, tenant: str | None = None) -> JobSpec:
    """The spec with `model.init_from` pinned (pinned_init_from, as `tenant` signs the job's
    checkpoints), for a job whose parts load it apart: its server and a sampler of its own know
    no tenant, and resolved again without one they would miss a tenant's recorded base and take
    whatever a moved alias names now."""
    pinned = pinned_init_from(spec, job_id, tenant)
    if pinned == spec.model.init_from:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"init_from": pinned})})


class Policy:
    """Model, adapter, optimizer and (for KL) reference of one learner, and its checkpoints under
    `<checkpoint.base_url>/<job_id>/`, signed as `tenant`'s (None: the operator's). Loads its
    model unless one is given. `own_rngs`: a hosted job's own generators by name (its sampling
    draws, its adapter's LoRA dropout), which its checkpoints keep and restore instead of the
    process's generators (other jobs draw from those)."""

    def __init__(self, spec: JobSpec, job_id: str | None = None, model=None, tokenizer=None, tenant: str | None = None,
                 own_rngs: dict[str, torch.Generator] | None = None):
        if job_id is not None:  # one folder name (a self-play learner's `<job_id>.<player>` may be longer than a job id)
            check_folder_name(job_id, "job id")
        self.spec, self.job_id, self.tenant, self.own_rngs = spec, job_id, tenant, own_rngs
        if spec.resources.trainer_ranks > 1 and not torch.distributed.is_initialized():
            raise ValueError(f"resources.trainer_ranks: {spec.resources.trainer_ranks} ranks train as a job on the stack "
                             "(opentinker train), not in one process (opentinker run)")
        self.init_from = pinned_init_from(spec, job_id, tenant)
        if model is None:
            model, tokenizer = load_model(spec.model.name, spec.model.dtype, init_from=self.init_from)
        self.tokenizer = tokenizer
        where = placement(spec.resources.num_gpus, spec.model.dtype)
        # vLLM's logprobs are this trainer's within 1e-4 only when both run float32; otherwise (another
        # program's bfloat16 kernels, merged weights rounded) they are the behaviour policy's
        apart = spec.rollout.engine == "vllm" and {sampling_dtype(spec.rollout.sampler_dtype, where), where.compute_dtype} != {torch.float32}
        # a job over several ranks: this process is one of them (opentinker.orchestration.ranks hosts it)
        trainer_class = ShardedPolicyTrainer if spec.resources.trainer_ranks > 1 else PolicyTrainer
        self.trainer = trainer_class(model, tokenizer, spec.adapter, spec.algorithm, spec.optimization, spec.rollout.temperature,
                                     where, sampled_apart=apart)
        if spec.algorithm.advantage == "gae":  # its value model, beside the policy (backend/critic.py)
            from opentinker.backend.critic import job_critic

            self.trainer.critic = job_critic(spec, where)

    @property
    def model(self):
        return self.trainer.model

    @property
    def placement(self):
        return self.trainer.placement

    @property
    def version(self) -> int:
        return self.trainer.version

    def precision(self) -> str:
        """How the trainer computes, and why where `auto` chose (for the job's log: it decides where it runs)."""
        return precision_line(self.spec.model.dtype, self.trainer.placement)

    def update(self, batch) -> dict[str, float]:
        """One optimizer step on a RolloutBatch (then the critic's, on the returns it computed)."""
        metrics = self.trainer.update(batch.trajectories)
        return metrics | (self.trainer.critic.fit() if self.trainer.critic is not None else {})

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Trainable weights and their version, for a sampler in another process."""
        return self.trainer.version, self.trainer.trainable_state()

    def save(self, step: int, env_state: dict[str, Any], metrics: list = ()) -> ckpt.CheckpointRef | None:
        """Commit the policy at `step`. `metrics` are the steps' metrics this checkpoint covers:
        they travel with it so a resume can log any that a crash kept from reaching MLflow. A
        sharded trainer's ranks gather the weights and each writes its share of the optimizer's
        state; rank 0 writes the rest and commits (the others return None)."""
        url, written, optimizer_state = ckpt.step_url(self.spec.checkpoint.base_url, self.job_id, step), None, None
        weights = self.trainer.trainable_state()
        if isinstance(self.trainer, ShardedPolicyTrainer):  # each rank writes its share of the optimizer's state
            written = self.trainer.write_optimizer_state(url)
        else:
            optimizer_state = self.trainer.optimizer_state()
        if self.trainer.rank != 0:
            return None
        extra = {"spec.yaml": dump_spec(self.spec).encode(),
                 POLICY_FILE: json.dumps(policy_info(self.spec, self.init_from)).encode()}
        if isinstance(self.spec.adapter, LoraSpec):
            extra |= adapter_files(self.trainer.model, state_dict=weights)
        if self.trainer.critic is not None:
            extra[CRITIC_FILE] = self.trainer.critic.state()
        return ckpt.save_checkpoint(
            self.spec.checkpoint.base_url, self.job_id, step,
            weights=weights,
            optimizer_state=optimizer_state,
            state={"policy_version": self.trainer.version, "env": env_state,
                   "metrics": [[int(s), {k: v if isinstance(v, str) else float(v) for k, v in m.items()}] for s, m in metrics]},
            extra_files=extra,
            keep_last=self.spec.checkpoint.keep_last,
            tenant=self.tenant,
            rng=self.own_rngs,
            written=written,
        )

    @property
    def owner(self) -> ckpt.Owner:
        return ckpt.Owner(self.job_id, self.tenant)

    def restore_latest(self) -> Restored | None:
        """Load the job's newest intact checkpoint (weights, optimizer, version, RNG), skipping newer
        folders that are not (each named in `skipped`); None when the job has no step folder."""
        found = ckpt.newest_intact(self.spec.checkpoint.base_url, self.job_id, self.owner)
        if found.ref is None:
            return Restored(step=0, checkpoint=None, env_state=None, skipped=found.skipped) if found.skipped else None
        loaded = self.apply(found.loaded, found.ref.url)
        return Restored(step=loaded.step, checkpoint=found.ref, env_state=loaded.state["env"],
                        metrics=loaded.state.get("metrics", []), skipped=found.skipped)

    def restore(self, url: str) -> ckpt.LoadedCheckpoint:
        """Load this job's checkpoint at `url` (refused unless it is this job's, intact)."""
        return self.apply(ckpt.load_checkpoint(url, self.owner), url)

    def apply(self, loaded: ckpt.LoadedCheckpoint, url: str | None = None) -> ckpt.LoadedCheckpoint:
        """Put a loaded checkpoint's state in place (its critic's too, read from `url`, for a job with one)."""
        if self.trainer.critic is not None:  # a checkpoint without one is refused (CheckpointError): the critic resumes too
            self.trainer.critic.load_state(ckpt.read_file(url, CRITIC_FILE, owner=self.owner))
        self.trainer.load_trainable_state(loaded.weights)
        self.trainer.load_optimizer_state(loaded.optimizer_state)
        self.trainer.version = int(loaded.state["policy_version"])
        ckpt.set_rng_state(loaded.rng, self.own_rngs)
        return loaded
