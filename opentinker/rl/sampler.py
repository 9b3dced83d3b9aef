"""The sampler: the job's environment played by an inference engine on the policy's model.

It draws a step's tasks, runs the agent loop over them (training rollouts, or greedy validation
episodes) and keeps the step's batch for the update. Beside the policy in one process it shares
its model, and weight sync is only the version handshake; in a process of its own it loads its
model and takes the policy's trainable weights after each update.

With `rollout.engine: server` the episodes are sampled by an inference server instead: before a
phase plays, the newest version's adapter goes to the server and is verified there (see
opentinker/backend/server_engine.py); the model here is then the trainer's reference for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.agent import EpisodeLimits, chat_format, run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.backend.device import Placement, placement
from opentinker.backend.rollout import score_tokens
from opentinker.backend.server_engine import Probe, ServerHandle, ServerRolloutEngine
from opentinker.core.spec import JobSpec
from opentinker.core.trajectory import Trajectory
from opentinker.env import GameEnvironment, environment_from_spec
from opentinker.model import adapter_files
from opentinker.tracking.metrics import episode_stats
from opentinker.tracking.transcripts import transcripts


@dataclass
class RolloutBatch:
    step: int
    policy_version: int
    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Evaluation:
    step: int
    metrics: dict[str, float]
    transcripts: list[dict[str, Any]] = field(default_factory=list)


def own_model(spec: JobSpec, job_id: str | None, where: Placement):
    """(model, tokenizer) for a sampler in a process of its own: the job's base (its pinned
    `init_from`) with the same adapter layout, so parameter names match the policy's, on the
    job's device in its precision."""
    from opentinker.model import load_model, wrap_model
    from opentinker.rl.policy import pinned_init_from

    model, tokenizer = load_model(spec.model.name, spec.model.dtype, init_from=pinned_init_from(spec, job_id))
    if spec.adapter.kind == "lora":
        model = wrap_model(model.to(dtype=where.weights_dtype(trained=False)), spec.adapter)
    return model.to(where.device), tokenizer


# What starts a job's own inference server (opentinker.inference.launch.rollout_server).
StartServer = Callable[[JobSpec, "str | None", Placement], ServerHandle]

PROBE_TEXT = "Weight sync probe. The quick brown fox jumps over the lazy dog, and then"


def sync_tolerance(spec: JobSpec, where: Placement) -> float:
    """`rollout.sync_tolerance`, or what the compute precision allows (see backend/device.py)."""
    if spec.rollout.sync_tolerance is not None:
        return spec.rollout.sync_tolerance
    return 1e-3 if where.compute_dtype == torch.float32 else 0.1


class Sampler:
    def __init__(self, spec: JobSpec, model=None, tokenizer=None, env: GameEnvironment | None = None, job_id: str | None = None,
                 where: Placement | None = None, start_server: StartServer | None = None, engine: Any = None):
        """`engine`: what samples the episodes, given by the host (a base-model worker's shared
        engine, opentinker.inference.engine_multi_lora.AdapterRollouts); None: per `rollout.engine`."""
        where = where or placement(spec.resources.num_gpus, spec.model.dtype)
        if model is None:
            model, tokenizer = own_model(spec, job_id, where)
        self.spec, self.model, self.where = spec, model, where
        r = spec.rollout
        self.wanted_version = 0  # the policy version episodes should be sampled from
        if engine is not None:
            self.engine = engine
        elif r.engine == "server":
            if getattr(tokenizer, "processor", None) is not None:
                raise ValueError("rollout.engine: 'server' samples text only; a vision-language model samples with engine 'local'")
            self.engine = ServerRolloutEngine(self._server(start_server, job_id), sync_tolerance(spec, where))
            self.probe = Probe(tokenizer(PROBE_TEXT)["input_ids"], lambda prompt, tokens: score_tokens(self.model, where, prompt, tokens))
        else:
            self.engine = HFRolloutEngine(model, tokenizer, max_batch_size=max(64, r.prompts_per_step * r.group_size),
                                          prefix_cache_tokens=r.prefix_cache_tokens if r.max_turns > 1 else 0,  # one turn: nothing to reuse
                                          placement=where)
        self.sync_metrics: dict[str, float] = {}
        self.chat = chat_format(tokenizer)
        self.env = env or environment_from_spec(spec, job_id)
        self.limits = EpisodeLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, step_timeout_s=r.step_timeout_s)
        self.train_params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
        self._batch: RolloutBatch | None = None

    def _server(self, start_server: StartServer | None, job_id: str | None) -> ServerHandle:
        r = self.spec.rollout
        if r.server_url:
            return ServerHandle(url=r.server_url, model=self.spec.model.name)
        if start_server is None:
            raise ValueError("rollout.engine: 'server' needs rollout.server_url here (jobs run by opentinker start their own server)")
        return start_server(self.spec, job_id, self.where)

    @property
    def version(self) -> int:
        return self.wanted_version

    def _publish(self) -> None:
        """Server engine: put the wanted version on the server (verified) before episodes play."""
        if not isinstance(self.engine, ServerRolloutEngine) or self.engine.synced_version == self.wanted_version:
            return
        t0 = time.perf_counter()
        gap = self.engine.sync_adapter(self.wanted_version, adapter_files(self.model), self.probe)
        self.sync_metrics = {"rollout/sync_logprob_gap": gap, "rollout/sync_seconds": time.perf_counter() - t0}

    def close(self) -> None:
        """Stop what the sampler started (a server engine's own server), or leave the host's engine."""
        if not isinstance(self.engine, HFRolloutEngine):
            self.engine.close()

    def sync(self, version: int | tuple[int, dict[str, torch.Tensor]], weights: dict[str, torch.Tensor] | None = None) -> int:
        """Weight-sync handshake: adopt the policy's version (and its trainable weights, when the
        model is not shared; `(version, weights)` as `Policy.weights` returns them). Versions
        only go up."""
        if isinstance(version, tuple):
            version, weights = version
        if weights is not None:
            if version < self.wanted_version:
                raise ValueError(f"refusing policy version {version}: the sampler is already at {self.wanted_version}")
            named = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in weights.items():
                    named[name].copy_(tensor)
        self.wanted_version = version
        if not isinstance(self.engine, ServerRolloutEngine):  # samples from self.model: nothing to move
            self.engine.policy_version = version
        return version

    def rollout(self, step: int) -> dict[str, float]:
        """Play the step's training episodes (prompts × group size); the batch stays here for
        `batch(step)`, the metrics are returned."""
        t0 = time.perf_counter()
        self._publish()
        r = self.spec.rollout
        tasks = self.env.train_tasks(r.prompts_per_step)
        expanded = [t for t in tasks for _ in range(r.group_size)]
        groups = [step * r.prompts_per_step + i for i in range(len(tasks)) for _ in range(r.group_size)]
        tokens0, gen0 = self.engine.generated_tokens, self.engine.generate_seconds
        decoded0, useful0 = (getattr(self.engine, name, 0) for name in ("decode_positions", "useful_positions"))  # local engine only
        trajs = run_episodes(self.engine, self.chat, [self.env.make_game() for _ in expanded], expanded, self.train_params, self.limits, groups)
        self.engine.end_phase()  # the episodes are over: free their states before the update
        gen_tokens = self.engine.generated_tokens - tokens0
        gen_seconds = self.engine.generate_seconds - gen0
        metrics = episode_stats(trajs, "rollout") | {
            "rollout/generated_tokens": float(gen_tokens),
            "rollout/tokens_per_s": gen_tokens / gen_seconds if gen_seconds else 0.0,
            "rollout/seconds": time.perf_counter() - t0,
            "rollout/decode_positions": float(getattr(self.engine, "decode_positions", 0) - decoded0),
            "rollout/useful_positions": float(getattr(self.engine, "useful_positions", 0) - useful0),
            "rollout/policy_version": float(self.engine.policy_version),
        } | self.sync_metrics | (self.engine.shared_metrics() if hasattr(self.engine, "shared_metrics") else {})
        self._batch = RolloutBatch(step=step, policy_version=self.engine.policy_version, trajectories=trajs, metrics=metrics)
        return metrics

    def batch(self, step: int) -> RolloutBatch:
        """The batch `rollout(step)` played (only the newest is kept)."""
        if self._batch is None or self._batch.step != step:
            raise KeyError(f"no rollout batch for step {step} (have {'none' if self._batch is None else self._batch.step})")
        return self._batch

    def evaluate(self, step: int) -> Evaluation:
        """The validation episodes (greedy by default): metrics and readable transcripts."""
        t0 = time.perf_counter()
        self._publish()
        e, r = self.spec.evaluation, self.spec.rollout
        tasks = self.env.validation_tasks(e.n_samples)
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, greedy=e.greedy)
        trajs = run_episodes(self.engine, self.chat, [self.env.make_game() for _ in tasks], tasks, params, self.limits)
        self.engine.end_phase()
        metrics = episode_stats(trajs, "eval") | {"eval/seconds": time.perf_counter() - t0}
        return Evaluation(step=step, metrics=metrics, transcripts=transcripts(trajs))

    def env_state(self) -> dict[str, Any]:
        return self.env.state()

    def load_env_state(self, state: dict[str, Any]) -> None:
        self.env.load_state(state)
