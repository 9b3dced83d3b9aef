"""The agent loop: PENDING → GENERATING → INTERACTING → (GENERATING … | TERMINATED).

Many episodes advance together: all GENERATING episodes share one batched generation call, then
all INTERACTING episodes step their environments concurrently. The token record of each episode
is append-only (see `opentinker.core.trajectory`). Environment failures end one episode, never the batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from opentinker.agent.chat import ChatFormat
from opentinker.agent.guard import call_many_with_timeout, check_step_result
from opentinker.backend.rollout import RolloutEngine, SamplingParams
from opentinker.env.base import AbstractGame
from opentinker.env.hosting import start_episode
from opentinker.env.messages import initial_messages, user_content
from opentinker.env.observation import Observation
from opentinker.core.trajectory import Trajectory


class EpisodeState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class EpisodeLimits:
    max_turns: int = 1
    max_total_tokens: int = 1024
    step_timeout_s: float = 10.0


@dataclass
class Episode:
    game: AbstractGame
    task: dict[str, Any]
    group_id: int
    state: EpisodeState = EpisodeState.PENDING
    traj: Trajectory | None = None
    last_stopped: bool = False
    history: list[EpisodeState] = field(default_factory=list)

    def move(self, state: EpisodeState) -> None:
        self.history.append(self.state)
        self.state = state


def _fail(ep: Episode, reason: str) -> None:
    if ep.traj is None:
        ep.traj = Trajectory(prompt_ids=[], group_id=ep.group_id, task=ep.task)
    ep.traj.failed = True
    ep.traj.failure = reason
    ep.traj.stop_reason = "failed"
    ep.move(EpisodeState.TERMINATED)


def run_episodes(
    engine: RolloutEngine,
    chat: ChatFormat,
    games: list[AbstractGame],
    tasks: list[dict[str, Any]],
    params: SamplingParams,
    limits: EpisodeLimits,
    group_ids: list[int] | None = None,
) -> list[Trajectory]:
    """Play one episode per (game, task) to the end and return their token records in order."""
    episodes = [Episode(g, t, gid) for g, t, gid in zip(games, tasks, group_ids or range(len(games)))]
    _start(episodes, chat, limits)
    while True:
        generating = [e for e in episodes if e.state is EpisodeState.GENERATING]
        if not generating:
            break
        _generate(generating, engine, chat, params, limits)
        _interact([e for e in episodes if e.state is EpisodeState.INTERACTING], chat, limits)
    for ep in episodes:
        try:
            ep.game.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
    return [e.traj for e in episodes]  # type: ignore[misc]


def _start(episodes: list[Episode], chat: ChatFormat, limits: EpisodeLimits) -> None:
    """PENDING: reset each game and tokenize its prompt once."""

    def reset(ep: Episode) -> tuple[list[dict[str, Any]], Any]:
        messages = initial_messages(ep.game, start_episode(ep.game, ep.task))
        return messages, chat.encode_prompt(messages)  # in the episode's thread: images are processed concurrently

    outcomes = call_many_with_timeout([(reset, (ep,), {}) for ep in episodes], limits.step_timeout_s)
    for ep, out in zip(episodes, outcomes):
        if out.error:
            _fail(ep, f"reset: {out.error}")
            continue
        messages, chunk = out.value
        ep.traj = Trajectory(prompt_ids=chunk.ids, group_id=ep.group_id, task=ep.task, messages=list(messages))
        if chunk.visual is not None:
            ep.traj.images.append(chunk.visual)
        if len(ep.traj) >= limits.max_total_tokens:
            ep.traj.stop_reason = "max_total_tokens"
            ep.move(EpisodeState.TERMINATED)
        else:
            ep.move(EpisodeState.GENERATING)


def _generate(episodes: list[Episode], engine: RolloutEngine, chat: ChatFormat, params: SamplingParams, limits: EpisodeLimits) -> None:
    """GENERATING: one batched call; sampled tokens enter the record with mask 1."""
    budgets = [limits.max_total_tokens - len(ep.traj) for ep in episodes]
    if any(ep.traj.images for ep in episodes):  # a VLM's records: the pixels of their images too
        completions = engine.generate([ep.traj.token_ids for ep in episodes], params, budgets, images=[ep.traj.images for ep in episodes])
    else:
        completions = engine.generate([ep.traj.token_ids for ep in episodes], params, budgets)
    for ep, comp in zip(episodes, completions):
        action = chat.decode(comp.token_ids)
        ep.traj.policy_version = engine.policy_version
        ep.traj.append_sampled(comp.token_ids, comp.logprobs, action)
        ep.traj.messages.append({"role": "assistant", "content": action})
        ep.last_stopped = comp.finish_reason == "stop"
        ep.move(EpisodeState.INTERACTING)


def _interact(episodes: list[Episode], chat: ChatFormat, limits: EpisodeLimits) -> None:
    """INTERACTING: step every environment concurrently; observations enter with mask 0."""
    outcomes = call_many_with_timeout([(ep.game.step, (ep.traj.turns[-1].action,), {}) for ep in episodes], limits.step_timeout_s)
    for ep, out in zip(episodes, outcomes):
        if out.error:
            _fail(ep, f"step: {out.error}")
            continue
        try:
            result = check_step_result(out.value)
        except (TypeError, ValueError) as err:
            _fail(ep, f"step: {err}")
            continue
        traj = ep.traj
        observation = result.observation
        text, images = (observation.text, observation.images) if isinstance(observation, Observation) else (observation, [])
        traj.turns[-1].reward = result.reward
        traj.turns[-1].observation = text
        traj.info.update(result.info)
        if result.done:
            traj.stop_reason = "done"
        elif len(traj.turns) >= limits.max_turns:
            traj.stop_reason = "max_turns"
        else:
            try:
                chunk = chat.encode_observation(observation, ep.last_stopped)
            except ValueError as err:  # images for a language model, an image the processor refuses
                _fail(ep, f"step: {err}")
                continue
            if len(traj) + len(chunk.ids) >= limits.max_total_tokens:
                traj.stop_reason = "max_total_tokens"
            else:
                traj.append_observation(chunk.ids, text, chunk.visual)
                traj.messages.append({"role": "user", "content": user_content(text, images)})
                ep.move(EpisodeState.GENERATING)
                continue
        ep.move(EpisodeState.TERMINATED)
