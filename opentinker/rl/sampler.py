"""The sampler: the job's environment played by an inference engine on the policy's model.

It plays the job's groups of episodes through a producer (opentinker.rl.producer): continuously,
each episode a stream of its own, at most `algorithm.max_staleness` policy versions ahead of the
trainer (0: a step's groups start once the previous update is published); `rollout(step)` takes
the step's groups and keeps them for the update. Validation episodes (greedy by default) play on
the same engine. Beside the policy in one process it shares its model, and weight sync is only the
version handshake; with its own model (in a process of its own, or any job with max_staleness > 0)
it takes the policy's trainable weights after each update, between two decode steps, so an
episode in flight goes on with the new weights and its tokens record the version that drew them.

With `rollout.engine: server` (or `vllm`) the episodes are sampled by the job's inference servers
instead (`rollout.servers` of them, sharing the requests by load: opentinker/backend/server_pool.py):
before a group plays, the newest version goes to every server and is verified there (see
opentinker/backend/server_engine.py); the model here is then the trainer's reference for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.agent import EpisodeLimits, chat_format, run_episodes
from opentinker.agent.guard import stuck_calls
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.backend.device import Placement, placement, sampling_dtype
from opentinker.backend.rollout import score_tokens
from opentinker.backend.server_engine import Probe, ServerHandle
from opentinker.backend.server_pool import ServerPool
from opentinker.core.settings import get_settings
from opentinker.core.spec import JobSpec, LoraSpec
from opentinker.core.trajectory import Trajectory
from opentinker.rl.producer import Producer
from opentinker.env import GameEnvironment, environment_from_spec
from opentinker.model import adapter_files
from opentinker.model.adapters import lora_factors, policy_weights
from opentinker.tools.job_tools import JobTools
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


# What starts a job's own inference server number `index` of `rollout.servers` (opentinker.inference.launch.rollout_server).
StartServer = Callable[[JobSpec, "str | None", Placement, int], ServerHandle]


def starts_own_server(spec: JobSpec) -> bool:
    """Does the job sample through a server it starts itself (`rollout.engine: vllm`, or `server`
    naming no `server_url`)?"""
    r = spec.rollout
    return r.engine == "vllm" or (r.engine == "server" and not r.server_url)


class EarlyStart:
    """A job's own servers, begun in threads as soon as the job starts (all `rollout.servers` at
    once), so that their start (vLLM's takes 16-20 s on a CPU, most of it two Python imports) runs
    beside the model's load instead of after it. Called as a StartServer it waits for that server
    (or raises what its start raised); `abandon` stops each once it is up, for a job that failed
    before taking them."""

    def __init__(self, start_server: StartServer, spec: JobSpec, job_id: str | None):
        self.start_server = start_server  # what starts another (a restart after one died)
        n, where = spec.rollout.servers, placement(spec.resources.num_gpus, spec.model.dtype)
        pool = ThreadPoolExecutor(n, thread_name_prefix="server-start")
        self.started: list[Future[ServerHandle]] = [pool.submit(start_server, spec, job_id, where, i) for i in range(n)]
        pool.shutdown(wait=False)
        self.abandoned = False

    @classmethod
    def of(cls, start_server: StartServer | None, spec: JobSpec, job_id: str | None, engine: Any = None) -> StartServer | None:
        """`start_server`, begun now where the job will start a server of its own."""
        if start_server is None or isinstance(start_server, cls) or engine is not None or not starts_own_server(spec):
            return start_server
        return cls(start_server, spec, job_id)

    def __call__(self, spec: JobSpec, job_id: str | None, where: Placement, index: int = 0) -> ServerHandle:
        return self.started[index].result()

    def abandon(self) -> None:
        if not self.abandoned:  # the sampler and the job around it may both give up on them
            self.abandoned = True
            for started in self.started:
                started.add_done_callback(lambda done: done.exception() is None and done.result().stop())


def abandon(start_server: StartServer | None) -> None:
    """Stop a server begun early that nothing took (the job failed on its way to it)."""
    if isinstance(start_server, EarlyStart):
        start_server.abandon()


PROBE_TEXT = "Weight sync probe. The quick brown fox jumps over the lazy dog, and then"


def sync_tolerance(spec: JobSpec, where: Placement) -> float:
    """`rollout.sync_tolerance`, or what the compute precision allows (see backend/device.py)."""
    if spec.rollout.sync_tolerance is not None:
        return spec.rollout.sync_tolerance
    return 1e-3 if where.compute_dtype == torch.float32 and sampling_dtype(spec.rollout.sampler_dtype, where) == torch.float32 else 0.1


EVAL_EPISODES = 2**40  # validation episodes are numbered apart from training ones (their generators' seeds)


class Sampler:
    def __init__(self, spec: JobSpec, model=None, tokenizer=None, env: GameEnvironment | None = None, job_id: str | None = None,
                 where: Placement | None = None, start_server: StartServer | None = None, engine: Any = None):
        """`engine`: what samples the episodes, given by the host (a base-model worker's shared
        engine, opentinker.inference.engine_multi_lora.AdapterRollouts, or a server that holds the
        weights already, which needs no model here: only the tokenizer); None: per `rollout.engine`."""
        where = where or placement(spec.resources.num_gpus, spec.model.dtype)
        start_server = EarlyStart.of(start_server, spec, job_id, engine)  # beside the model's load
        try:
            self._build(spec, model, tokenizer, env, job_id, where, start_server, engine)
        except BaseException:
            abandon(start_server)
            raise

    def _build(self, spec: JobSpec, model, tokenizer, env: GameEnvironment | None, job_id: str | None, where: Placement,
               start_server: StartServer | None, engine: Any) -> None:
        if model is None and engine is None:
            model, tokenizer = own_model(spec, job_id, where)
        self.spec, self.model, self.where, self.job_id = spec, model, where, job_id
        self._start_server = start_server.start_server if isinstance(start_server, EarlyStart) else start_server
        r = spec.rollout
        self.tools = JobTools(spec.env.tools, get_settings().env_hosts)  # env.tools: MCP servers listed, the sandbox checked, first
        self.wanted_version = 0  # the policy version episodes should be sampled from
        if engine is not None:
            self.engine = engine
        elif r.engine in ("server", "vllm"):
            if getattr(tokenizer, "processor", None) is not None:
                raise ValueError(f"rollout.engine: '{r.engine}' samples text only; a vision-language model samples with engine 'local'")
            self.engine = ServerPool(self._servers(start_server, job_id), sync_tolerance(spec, where))
            self.probe = Probe(tokenizer(PROBE_TEXT)["input_ids"], lambda prompt, tokens: score_tokens(self.model, where, prompt, tokens))
        else:
            self.engine = HFRolloutEngine(model, tokenizer, max_batch_size=max(64, r.prompts_per_step * r.group_size),
                                          prefix_cache_tokens=r.prefix_cache_tokens if r.max_turns > 1 else 0,  # one turn: nothing to reuse
                                          placement=where)
        self.sync_metrics: dict[str, float] = {}
        self._model_in_use = threading.Lock()  # a server engine's sync reads the model: no new weights land meanwhile
        self._publishing = threading.Lock()  # one sync at a time
        self.chat = chat_format(tokenizer)
        self.env = env or environment_from_spec(spec, job_id)
        self.limits = EpisodeLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, step_timeout_s=r.step_timeout_s,
                                    tools=self.tools.tools, max_tool_calls_per_turn=spec.env.tool_calls_per_turn)
        self.train_params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
        self._batch: RolloutBatch | None = None
        self.producer: Producer | None = None  # plays the job's groups (started by the first rollout)
        self._last_take: tuple[float, tuple[float, int, int, int]] | None = None  # (time, the engine's counters) at the last take

    def _servers(self, start_server: StartServer | None, job_id: str | None) -> list[ServerHandle]:
        """The servers the job samples through: `server_url`'s, or the `rollout.servers` it starts
        (each waited for, so that one that fails to start fails the job, the others stopped)."""
        r = self.spec.rollout
        if not starts_own_server(self.spec):
            return [ServerHandle(url=r.server_url, model=self.spec.model.name)]
        if start_server is None:
            raise ValueError("rollout.engine: 'server' needs rollout.server_url here (jobs run by opentinker start their own server)"
                             if r.engine == "server" else "rollout.engine: 'vllm': jobs run by opentinker start their vLLM server, this one cannot")
        started: list[ServerHandle] = []
        try:
            for i in range(r.servers):
                started.append(start_server(self.spec, job_id, self.where, i))
        except BaseException:
            if not isinstance(start_server, EarlyStart):  # an early start's are stopped by its abandon (see __init__)
                for server in started:
                    server.stop()
            raise
        return started

    @property
    def version(self) -> int:
        return self.wanted_version

    def _publish(self) -> None:
        """Server engine: put the wanted version on the server before episodes play (an adapter
        verified first; weights taken in place verified beside the episodes, `_verified`)."""
        if not isinstance(self.engine, ServerPool) or self.engine.synced_version == self.wanted_version:
            return
        # one sync at a time, the weights read by the one that moves them (a step's groups all ask at their start and
        # wait for its reload, not its probe); the model holds that version until the probe has checked it against
        # the server (at k > 0 the trainer's next weights wait for it)
        with self._publishing:
            if self.engine.synced_version == self.wanted_version:
                return
            t0 = time.perf_counter()
            self._model_in_use.acquire()
            verdict = None
            try:
                if self.engine.weights == "merged":  # the LoRA's factors merged by the server, or a full fine-tune's weights
                    weights = lora_factors if isinstance(self.spec.adapter, LoraSpec) else policy_weights
                    verdict = self.engine.sync_weights(self.wanted_version, lambda: weights(self.model), self.probe)
                else:
                    gap = self.engine.sync_adapter(self.wanted_version, lambda: adapter_files(self.model), self.probe)
                    self.sync_metrics = {"rollout/sync_logprob_gap": gap} if gap is not None else {}
            finally:
                if verdict is None:
                    self._model_in_use.release()
                else:  # the model keeps this version until the probe beside the episodes has checked it
                    verdict.add_done_callback(lambda _: self._model_in_use.release())
            self.sync_metrics["rollout/sync_seconds"] = time.perf_counter() - t0

    def _verified(self) -> None:
        """Wait for the newest in-place sync's probe (it runs beside the episodes drawn after the
        reload): its SyncError fails the step before anything trains on those episodes."""
        if isinstance(self.engine, ServerPool) and (gap := self.engine.verified()) is not None:
            self.sync_metrics["rollout/sync_logprob_gap"] = gap

    def restart_server(self) -> None:
        """After one of the job's own servers died (ServerGone): stop its producer and start a new
        server in place of the dead one (the others live on). The step loop then restores the job's
        last checkpoint, whose version and weights reach every server at the next sync (so versions
        may go down once)."""
        if not starts_own_server(self.spec) or self._start_server is None:
            raise RuntimeError("this job's inference server is not its own: it cannot start another")
        if self.producer is not None:
            self.producer.stop()
        self.producer, self._batch, self._last_take = None, None, None
        start = self._start_server
        self.engine.restart(lambda i: start(self.spec, self.job_id, self.where, i))
        self.wanted_version = 0

    def close(self) -> None:
        """Stop what the sampler started (its producer, its engine's thread, a server engine's own server)."""
        if self.producer is not None:
            self.producer.stop()
        self.engine.close()
        self.tools.close()

    def sync(self, version: int | tuple[int, dict[str, torch.Tensor]], weights: dict[str, torch.Tensor] | None = None) -> int:
        """Weight-sync handshake: adopt the policy's version (and its trainable weights, when the
        model is not shared; `(version, weights)` as `Policy.weights` returns them). Versions
        only go up."""
        if isinstance(version, tuple):
            version, weights = version
        if weights is not None and version < self.wanted_version:
            raise ValueError(f"refusing policy version {version}: the sampler is already at {self.wanted_version}")

        def load() -> None:  # between two decode steps: a sequence in flight goes on with the new weights
            if weights is not None:
                named = dict(self.model.named_parameters())
                with torch.no_grad():
                    for name, tensor in weights.items():
                        named[name].copy_(tensor)
            self.wanted_version = version
            if not isinstance(self.engine, ServerPool):  # samples from self.model: nothing to move
                self.engine.policy_version = version

        stream = getattr(self.engine, "stream", None)
        if stream is not None:
            stream.between_steps(load)
        else:
            with self._model_in_use:  # not while a server engine's sync reads this model and checks its probe against it
                load()
        if self.producer is not None:
            self.producer.publish(version)
        return version

    def rollout(self, step: int) -> dict[str, float]:
        """The step's groups from the producer (started at the first call: opentinker.rl.producer),
        each played as streams; the batch stays here for `batch(step)`, the metrics are returned
        (`rollout/seconds`: how long the trainer waited for them)."""
        t0 = time.perf_counter()
        r, k = self.spec.rollout, self.spec.algorithm.max_staleness
        if self.producer is None:
            self.producer = Producer(self._draw, self._play_group, r.prompts_per_step, k, step * r.prompts_per_step, self.wanted_version)
        # the engine's counters since the previous take: with k > 0 the producer plays between takes
        since, before = self._last_take or (t0, self._engine_counters())
        groups = self.producer.take(step)
        self._verified()  # the weights that drew them answered the probe as the trainer's
        kept = [g for g in groups if self._lag(g.trajectories) <= k]
        trajs = [t for g in kept for t in g.trajectories]
        waiting, playing = self.producer.waiting()
        now, after = time.perf_counter(), self._engine_counters()
        self._last_take = (now, after)
        gen_seconds, engine_tokens, decoded, useful = (a - b for a, b in zip(after, before))
        lags = [self.wanted_version - v for t in trajs for v in t.sampled_versions] or [0]
        env_seconds = sorted(s for t in trajs for s in t.env_seconds) or [0.0]
        turn_seconds = [s for t in trajs for s in t.turn_seconds]
        finished = sorted(g.finished for g in kept if g.finished is not None) or [0.0]
        metrics = episode_stats(trajs, "rollout") | {
            "rollout/generated_tokens": float(sum(t.num_sampled for t in trajs)),
            "rollout/tokens_per_s": engine_tokens / gen_seconds if gen_seconds else 0.0,  # the engine's, all its sequences
            "rollout/seconds": now - t0,
            "rollout/decode_positions": float(decoded),
            "rollout/useful_positions": float(useful),
            "rollout/policy_version": float(self.wanted_version),
            "rollout/version_lag_mean": sum(lags) / len(lags), "rollout/version_lag_max": float(max(lags)),
            **{f"rollout/version_lag_share_{n}": lags.count(n) / len(lags) for n in range(k + 1)},
            "rollout/groups_dropped": float(len(groups) - len(kept)),
            "rollout/buffer_groups": float(waiting), "rollout/groups_in_flight": float(playing),
            "rollout/producer_busy": min(1.0, gen_seconds / max(now - since, 1e-9)),
            "rollout/env_step_p50": env_seconds[len(env_seconds) // 2],
            "rollout/env_step_p95": env_seconds[min(len(env_seconds) - 1, int(0.95 * len(env_seconds)))],
            "rollout/env_calls_stuck": float(stuck_calls()),  # past their deadline, still running (capped: agent/guard.py)
            # where a step's time goes: the engine computing, a turn waiting for its reply, an episode waiting on its
            # tools, and the step's last group after its median one (the straggler the trainer waits for at k = 0)
            "rollout/engine_seconds": gen_seconds,
            "rollout/turn_seconds_mean": sum(turn_seconds) / len(turn_seconds) if turn_seconds else 0.0,
            "rollout/episode_tool_seconds": sum(sum(t.env_seconds) for t in trajs) / len(trajs) if trajs else 0.0,
            "rollout/straggler_seconds": finished[-1] - finished[len(finished) // 2],
        } | self.sync_metrics | (self.engine.shared_metrics() if hasattr(self.engine, "shared_metrics") else {}) \
          | (self.engine.server_metrics() if hasattr(self.engine, "server_metrics") else {})
        self._batch = RolloutBatch(step=step, policy_version=self.wanted_version, trajectories=trajs, metrics=metrics)
        return metrics

    def _engine_counters(self) -> tuple[float, int, int, int]:
        """The engine's compute seconds, tokens, decoded and useful positions so far (the last two: a local engine's only)."""
        e = self.engine
        return e.generate_seconds, e.generated_tokens, getattr(e, "decode_positions", 0), getattr(e, "useful_positions", 0)

    def _lag(self, trajs: list[Trajectory]) -> int:
        """How many versions behind the trainer a group's oldest sampled token is (0 when it sampled none)."""
        versions = [v for t in trajs for v in t.sampled_versions]
        return self.wanted_version - min(versions) if versions else 0

    def _draw(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The producer's next task, and the environment's state before it was drawn."""
        before = self.env.state()
        return self.env.train_tasks(1)[0], before

    def _play_group(self, group: Any) -> list[Trajectory]:
        """One group's episodes (group size of its task), as streams."""
        self._publish()
        n = self.spec.rollout.group_size
        return run_episodes(self.engine, self.chat, [self.env.make_game() for _ in range(n)], [group.task] * n, self.train_params, self.limits,
                            [group.index] * n, self._generators(group.index * n, n))

    def _generators(self, first: int, n: int) -> list[torch.Generator]:
        """Episodes first..first+n-1's generators, seeded by (job seed, episode number): an episode
        drawn by the same weights draws the same tokens whenever it plays (before or after a resume,
        beside whatever else)."""
        device = getattr(getattr(self.engine, "placement", None), "device", None) or torch.device("cpu")
        return [torch.Generator(device=device).manual_seed((self.spec.seed * 1_000_003 + first + i) % 2**63) for i in range(n)]

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
        trajs = run_episodes(self.engine, self.chat, [self.env.make_game() for _ in tasks], tasks, params, self.limits,
                             generators=self._generators(EVAL_EPISODES + step * len(tasks), len(tasks)))
        self._verified()
        metrics = episode_stats(trajs, "eval") | {"eval/seconds": time.perf_counter() - t0}
        return Evaluation(step=step, metrics=metrics, transcripts=transcripts(trajs, self.chat.tokenizer))

    def env_state(self) -> dict[str, Any]:
        """The environment's state for a checkpoint: before the first task not trained on was drawn."""
        if self.producer is None or self._batch is None:
            return self.env.state()
        return self.producer.env_state_after(self._batch.step, self.env.state)

    def load_env_state(self, state: dict[str, Any]) -> None:
        self.env.load_state(state)
