"""Self-play: a policy (model + adapter + optimizer) per learning agent, stepped by the
coordinator's phases (the matches played jointly, then one rollout and one update per agent).

`SelfPlayJob` is a `StepRunner` (opentinker.rl.loop) like `RLJob`: in this process its rollout
and update phases run the agents' work in threads behind the coordinator's barriers; the
self-play flow hosts it in a Ray actor and runs each agent's part of a phase as its own Prefect
task (`play`, `collect`, `update_agent`), with the same barriers.

Seats and policies (`multiagent.opponent`):
- `agents`: every player is its own agent with its own policy, all trained on their own records;
- `self`: one policy plays every seat and learns from all of them;
- `snapshot`: the first player learns against a frozen copy of itself (the other seats), which is
  refreshed from the learner every `snapshot_every` steps.

The environment's game is a match class (see `opentinker.agent.selfplay.Match`) with
`generate_task` and `reset(**task)`, wrapped by GameEnvironment for seeded tasks and a held-out
set, like any single-agent game.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from opentinker.agent import ChatFormat, EpisodeLimits
from opentinker.agent.coordinator import Coordinator
from opentinker.agent.selfplay import Seat, play_matches
from opentinker.backend import HFRolloutEngine, SamplingParams
from opentinker.env import environment_from_spec
from opentinker.env.environment import check_players
from opentinker.env.hosting import start_episode
from opentinker.core.ids import check_folder_name, job_id_for
from opentinker.core.seeding import seed_everything
from opentinker.core.spec import JobSpec
from opentinker.core.trajectory import Trajectory
from opentinker.rl.loop import LoopHooks, LoopResult, StepMetrics, run_steps
from opentinker.rl.policy import Policy, Restored
from opentinker.rl.sampler import Evaluation, RolloutBatch
from opentinker.storage import checkpoint as ckpt
from opentinker.tracking.metrics import episode_stats

SNAPSHOT = "snapshot"


def match_stats(trajs: list[Trajectory], outcomes: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Per-agent metrics: the generic episode ones over its records, and game results over every
    match it sat in (`outcomes`: `Match.info_for`), including those it never had to move in
    (the opponent forfeited first)."""
    out = episode_stats(trajs, prefix)
    if not outcomes:
        return out
    for name in ("win", "loss", "draw"):
        out[f"{prefix}/{name}_rate"] = sum(o.get("result") == name for o in outcomes) / len(outcomes)
    moves = sum(len(t.turns) for t in trajs)
    illegal = sum(int(o.get("illegal_moves", 0)) for o in outcomes)
    out[f"{prefix}/illegal_move_rate"] = illegal / moves if moves else 0.0
    out[f"{prefix}/game_length"] = sum(float(o.get("game_length", 0)) for o in outcomes) / len(outcomes)
    return out


def learner_names(multiagent) -> list[str]:
    """The learning agents: every player under `opponent: agents`, else the first player."""
    return list(multiagent.players) if multiagent.opponent == "agents" else [multiagent.players[0]]


class SelfPlayJob:
    def __init__(self, spec: JobSpec, job_id: str | None = None, tenant: str | None = None):
        """`tenant`: whose job it is (each learner's checkpoints are signed as such; None: the operator's)."""
        if spec.multiagent is None:
            raise ValueError("multiagent: this job has no multiagent section")
        self.spec, self.ma = spec, spec.multiagent
        self.job_id = job_id_for(spec, job_id)
        for player in self.ma.players:  # each learner's checkpoints go to <job_id>.<player>/
            check_folder_name(player, "multiagent.players: player")
        seed_everything(spec.seed)
        self.env = environment_from_spec(spec, self.job_id)
        check_players(self.env.game_class, self.ma.players)
        players = self.ma.players
        self.learners = learner_names(self.ma)
        self.policies = {name: Policy(spec, job_id=self.agent_job_id(name), tenant=tenant) for name in self.learners}
        if self.ma.opponent == "snapshot":
            self.policies[SNAPSHOT] = Policy(spec)
            self.refresh_snapshot()
        seat_policy = {
            "agents": {p: p for p in players},
            "self": {p: players[0] for p in players},
            "snapshot": {p: (players[0] if i == 0 else SNAPSHOT) for i, p in enumerate(players)},
        }[self.ma.opponent]
        r = spec.rollout
        batch = max(64, r.prompts_per_step * r.group_size)
        self.engines = {name: HFRolloutEngine(w.model, w.tokenizer, max_batch_size=batch, prefix_cache_tokens=r.prefix_cache_tokens,
                                              placement=w.placement) for name, w in self.policies.items()}
        self.seats = {p: Seat(self.engines[seat_policy[p]], ChatFormat(self.policies[seat_policy[p]].tokenizer)) for p in players}
        self.seat_policy = seat_policy
        self.limits = EpisodeLimits(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, step_timeout_s=r.step_timeout_s)
        self.params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p)
        self.coordinator = Coordinator(phase_timeout_s=self.ma.phase_timeout_s)
        self._played: tuple | None = None  # (step, records, outcomes, seconds) of the last play
        self._batches: dict[str, RolloutBatch] = {}  # each learner's batch of the last collected step

    def refresh_snapshot(self) -> None:
        learner = self.policies[self.learners[0]].trainer
        frozen = self.policies[SNAPSHOT].trainer
        frozen.load_trainable_state({k: v.clone() for k, v in learner.trainable_state().items()})
        frozen.version = learner.version

    # --- phases ---------------------------------------------------------------------------
    def _play_matches(self, step: int, tasks: list[dict[str, Any]], group_size: int, params: SamplingParams):
        """Play the tasks' matches; returns (records per player, outcomes per player)."""
        expanded = [t for t in tasks for _ in range(group_size)]
        groups = [step * len(tasks) + i for i in range(len(tasks)) for _ in range(group_size)]
        matches = []
        for task in expanded:
            match = self.env.make_game()
            start_episode(match, task)
            matches.append(match)
        records = play_matches(self.seats, matches, params, self.limits, groups)
        for engine in self.engines.values():  # the matches are over: free their states before the updates
            engine.prefix_cache.clear()
        outcomes = {p: [m.info_for(p) for m in matches] for p in self.ma.players}
        return records, outcomes

    def _agent_view(self, agent: str, records, outcomes) -> tuple[list[Trajectory], list[dict[str, Any]]]:
        seats = [p for p in self.ma.players if self.seat_policy[p] == agent]
        return [t for p in seats for t in records[p] if t is not None], [o for p in seats for o in outcomes[p]]

    def play(self, step: int) -> dict[str, float]:
        """The joint part of the rollout phase: every training match of the step played to its
        end (the seats take turns, so no agent can play its side alone). Kept for `collect`."""
        t0 = time.perf_counter()
        r = self.spec.rollout
        records, outcomes = self._play_matches(step, self.env.train_tasks(r.prompts_per_step), r.group_size, self.params)
        seconds = time.perf_counter() - t0
        self._played = (step, records, outcomes, seconds)
        self._batches = {}
        return {"rollout/matches": float(len(next(iter(records.values())))), "rollout/play_seconds": seconds}

    def collect(self, agent: str, step: int) -> dict[str, float]:
        """An agent's part of the rollout phase: its records of the played step, tagged with its
        policy version, kept for its update (per-turn credit is the trainer's: algorithm.advantage); returns its metrics."""
        if self._played is None or self._played[0] != step:
            last = "none" if self._played is None else f"step {self._played[0]}"
            raise RuntimeError(f"rollout of {agent} for step {step}, but the last matches played were {last}")
        _, records, outcomes, seconds = self._played
        trajs, seen = self._agent_view(agent, records, outcomes)
        metrics = match_stats(trajs, seen, f"{agent}/rollout") | {f"{agent}/rollout/seconds": seconds}
        self._batches[agent] = RolloutBatch(step, self.engines[agent].policy_version, trajs, metrics)
        return metrics

    def update_agent(self, agent: str, step: int) -> dict[str, float]:
        """An agent's part of the update phase: one update on its batch of `step`."""
        batch = self._batches.get(agent)
        if batch is None or batch.step != step:
            raise RuntimeError(f"update of {agent} for step {step}, but its last rollout was {'none' if batch is None else f'step {batch.step}'}")
        metrics = self.policies[agent].update(batch)
        self.engines[agent].policy_version = self.policies[agent].version  # shared model: the handshake
        return {f"{agent}/{k}": v for k, v in metrics.items()}

    # --- the step loop's calls (in this process: phases of threads behind barriers) ----------
    def rollout(self, step: int) -> dict[str, float]:
        """The rollout phase: the matches, then every learner's batch."""
        phase = self.coordinator.run_phase
        metrics = phase("rollout", step, {"matches": lambda: self.play(step)})["matches"]
        for m in phase("rollout", step, {a: (lambda a=a: self.collect(a, step)) for a in self.learners}).values():
            metrics |= m
        return metrics

    def update(self, step: int) -> dict[str, float]:
        """The update phase: one update per learner, then the snapshot refresh."""
        metrics: dict[str, float] = {}
        for m in self.coordinator.run_phase("update", step, {a: (lambda a=a: self.update_agent(a, step)) for a in self.learners}).values():
            metrics |= m
        self.after_updates(step)
        return metrics

    def after_updates(self, step: int) -> None:
        """The snapshot opponent follows its learner every `snapshot_every` steps."""
        if self.ma.opponent == "snapshot" and (step + 1) % self.ma.snapshot_every == 0:
            self.refresh_snapshot()

    def evaluate(self, step: int) -> Evaluation:
        """Greedy matches on the held-out tasks (one per task), metrics per learning agent."""
        e, r = self.spec.evaluation, self.spec.rollout
        params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, greedy=e.greedy)
        with torch.no_grad():
            records, outcomes = self._play_matches(step, self.env.validation_tasks(e.n_samples), 1, params)
        out = {}
        for agent in self.learners:
            out |= match_stats(*self._agent_view(agent, records, outcomes), f"{agent}/eval")
        return Evaluation(step, out)

    # --- checkpoints ----------------------------------------------------------------------
    def agent_job_id(self, agent: str) -> str:
        return f"{self.job_id}.{agent}"

    def checkpoint(self, step: int, metrics: StepMetrics = ()) -> dict[str, ckpt.CheckpointRef]:
        """One checkpoint per learning agent (its weights, optimizer, version), each with the
        environment's position and the metrics it covers; resume takes the newest step that
        every agent completed."""
        state = self.env.state()
        return {agent: self.policies[agent].save(step, state, metrics) for agent in self.learners}

    def restore(self) -> Restored | None:
        """Restore every learner (and the snapshot) at the newest step all of them have intact;
        a newer step where one agent's checkpoint is refused is skipped, with the reason."""
        base = self.spec.checkpoint.base_url
        steps = [{ref.step: ref for ref in ckpt.step_folders(base, self.agent_job_id(a))} for a in self.learners]
        common = set.intersection(*(set(s) for s in steps)) if steps else set()
        skipped, found = [], None
        for step in sorted(common, reverse=True):
            try:
                found = {a: ckpt.load_checkpoint(refs[step].url, self.policies[a].owner) for a, refs in zip(self.learners, steps)}
                break
            except ckpt.CheckpointError as err:
                skipped.append(str(err))
                ckpt.log.warning("resume skips %s", err)
        if found is None:
            return Restored(step=0, checkpoint=None, env_state=None, skipped=skipped) if skipped else None
        for agent, one in found.items():
            loaded = self.policies[agent].apply(one)
            self.engines[agent].policy_version = self.policies[agent].version
        self.env.load_state(loaded.state["env"])
        if self.ma.opponent == "snapshot":
            self.refresh_snapshot()
        return Restored(step=step, checkpoint={a: refs[step] for a, refs in zip(self.learners, steps)},
                        env_state=loaded.state["env"], metrics=loaded.state.get("metrics", []), skipped=skipped)

    def run(self, hooks: LoopHooks | None = None) -> LoopResult:
        """Train to `optimization.steps` in this process, resuming from the latest checkpoints."""
        return run_steps(self.spec, self, hooks)
