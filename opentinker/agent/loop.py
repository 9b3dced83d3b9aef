"""The agent loop: PENDING → GENERATING → INTERACTING → (GENERATING … | TERMINATED), per episode.

Every episode is a stream of its own: its turn goes to the engine as soon as it is ready, its
environment steps as soon as its turn ends, whatever the other episodes are doing (one thread
each, at most `max_in_flight` at once). The engine batches the turns that wait at the same
moment (opentinker/backend/stream.py: continuous batching), so a slow tool or a long answer
costs its own episode only. The token record of each episode is append-only (see
`opentinker.core.trajectory`); every sampled token records the policy version that drew it.
Environment failures (an exception, a step past `step_timeout_s`, garbage) end one episode, never
the others; so does anything raised while a turn's text is handled (the model's text reaches
parsers, tools and templates there): that episode fails, counted, with its traceback in the log.
The engine's own failures are the job's.
"""

from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from opentinker.agent.chat import ChatFormat
from opentinker.agent.guard import call_with_timeout, check_step_result
from opentinker.agent.tool_turns import answer_tool_turn, episode_tools, final_counts
from opentinker.backend.rollout import RolloutEngine, SamplingParams
from opentinker.core.trajectory import Trajectory
from opentinker.env.base import AbstractGame
from opentinker.env.hosting import start_episode
from opentinker.env.messages import initial_messages, user_content
from opentinker.env.observation import Observation
from opentinker.tools.declared import Tool
from opentinker.tools.toolbox import ToolBox

log = logging.getLogger(__name__)

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
    tools: list[Tool] = field(default_factory=list)  # the job's own (env.tools), beside each game's get_tools()
    max_tool_calls_per_turn: int = 4


@dataclass
class Episode:
    game: AbstractGame
    task: dict[str, Any]
    group_id: int
    generator: Any = None  # the torch.Generator its draws come from (None: the engine's own choice)
    state: EpisodeState = EpisodeState.PENDING
    traj: Trajectory | None = None
    last_stopped: bool = False
    tools: ToolBox | None = None
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
    generators: list[Any] | None = None,
    max_in_flight: int | None = None,
) -> list[Trajectory]:
    """Play one episode per (game, task) to the end, each on its own, and return their token
    records in order. `generators[i]`: where episode i's draws come from (default: one per episode
    from `episode_generators`), so its tokens do not depend on when its turns meet the others'."""
    gens = generators or episode_generators(len(games), engine)
    episodes = [Episode(g, t, gid, gen) for g, t, gid, gen in zip(games, tasks, group_ids or range(len(games)), gens)]
    try:
        each(episodes, lambda ep: _play(ep, engine, chat, params, limits), max_in_flight)
    finally:
        for ep in episodes:
            final_counts(ep.tools, ep.traj)
            try:
                ep.game.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
    return [e.traj for e in episodes]  # type: ignore[misc]


def episode_generators(n: int, engine: Any, source: torch.Generator | None = None) -> list[torch.Generator]:
    """One generator per episode on the engine's device, seeded in episode order from `source`
    (default: torch's global generator, so a seeded process replays its episodes)."""
    placement = getattr(engine, "placement", None)
    device = placement.device if placement is not None else torch.device("cpu")
    base = int(torch.randint(0, 2**62, (1,), generator=source, device=source.device if source is not None else "cpu").item())
    return [torch.Generator(device=device).manual_seed(base + i) for i in range(n)]


def each(items: list[Any], play: Callable[[Any], Any], max_in_flight: int | None = None) -> None:
    """`play(item)` for every item, each in a thread of its own, at most `max_in_flight` at once;
    the first exception (the engine's, never an environment's: those end their episode) is raised
    once all are done."""
    if not items:
        return
    with ThreadPoolExecutor(max(1, min(len(items), max_in_flight or len(items))), thread_name_prefix="episode") as pool:
        futures = [pool.submit(play, item) for item in items]
    for future in futures:
        future.result()


def _play(ep: Episode, engine: RolloutEngine, chat: ChatFormat, params: SamplingParams, limits: EpisodeLimits) -> None:
    _start(ep, chat, limits)
    while ep.state is EpisodeState.GENERATING:
        _generate(ep, engine, chat, params, limits)
        try:
            _interact(ep, chat, limits)
        except Exception as err:  # noqa: BLE001 - a turn's text raised somewhere: it costs this episode, not the job
            log.exception("episode of group %s: handling turn %d raised", ep.group_id, len(ep.traj.turns))
            _fail(ep, f"turn {len(ep.traj.turns)}: {type(err).__name__}: {str(err)[:300]}")


def _start(ep: Episode, chat: ChatFormat, limits: EpisodeLimits) -> None:
    """PENDING: reset the game and tokenize its prompt once (not at all when its text alone is
    longer than the episode may be: a prompt of a million characters costs nothing to refuse)."""

    def reset() -> tuple[list[dict[str, Any]], Any]:
        messages = initial_messages(ep.game, start_episode(ep.game, ep.task))
        ep.tools = episode_tools(ep.game, limits.tools, limits.max_tool_calls_per_turn)
        schemas = ep.tools.schemas() if ep.tools is not None else None
        least = chat.min_tokens(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)))
        return messages, (least if least >= limits.max_total_tokens else chat.encode_prompt(messages, schemas))

    out = call_with_timeout(reset, limits.step_timeout_s)
    if out.error:
        _fail(ep, f"reset: {out.error}")
        return
    messages, chunk = out.value
    if isinstance(chunk, int):  # not encoded: at least `chunk` tokens
        ep.traj = Trajectory(prompt_ids=[], group_id=ep.group_id, task=ep.task, messages=_clipped(messages))
        _cut(ep, f"the prompt is at least {chunk:,} tokens, over rollout.max_total_tokens {limits.max_total_tokens:,}")
        return
    ep.traj = Trajectory(prompt_ids=chunk.ids, group_id=ep.group_id, task=ep.task, messages=list(messages))
    if chunk.visual is not None:
        ep.traj.images.append(chunk.visual)
    if len(ep.traj) >= limits.max_total_tokens:
        _cut(ep, f"the prompt is {len(ep.traj):,} tokens, over rollout.max_total_tokens {limits.max_total_tokens:,}")
    else:
        ep.move(EpisodeState.GENERATING)


def _cut(ep: Episode, why: str) -> None:
    """End an episode whose record cannot grow further within max_total_tokens (truncated, not failed)."""
    ep.traj.stop_reason = "max_total_tokens"
    ep.traj.truncation = why
    ep.move(EpisodeState.TERMINATED)


CLIP_CHARS = 2000  # what a record keeps of a text that did not fit it (transcripts show the start)


def _clip(text: str) -> str:
    return text if len(text) <= CLIP_CHARS else f"{text[:CLIP_CHARS]}… ({len(text):,} characters)"


def _clipped(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": _clip(m["content"])} if isinstance(m.get("content"), str) else m for m in messages]


def _generate(ep: Episode, engine: RolloutEngine, chat: ChatFormat, params: SamplingParams, limits: EpisodeLimits) -> None:
    """GENERATING: the episode's turn from the engine; sampled tokens enter the record with mask 1."""
    traj = ep.traj
    extra: dict[str, Any] = {"generators": [ep.generator]} if ep.generator is not None else {}
    if traj.images:  # a VLM's record: the pixels of its images too
        extra["images"] = [traj.images]
    t0 = time.perf_counter()
    (comp,) = engine.generate([traj.token_ids], params, [limits.max_total_tokens - len(traj)], **extra)
    traj.turn_seconds.append(time.perf_counter() - t0)
    action = chat.decode(comp.token_ids)
    traj.append_sampled(comp.token_ids, comp.logprobs, action, comp.versions or [engine.policy_version] * len(comp.token_ids))
    traj.messages.append({"role": "assistant", "content": action})
    ep.last_stopped = comp.finish_reason == "stop"
    ep.move(EpisodeState.INTERACTING)


def _interact(ep: Episode, chat: ChatFormat, limits: EpisodeLimits) -> None:
    """INTERACTING: the turn's tool calls answered by the tools, or else the environment stepped;
    what comes back enters with mask 0."""
    traj = ep.traj
    t0 = time.perf_counter()
    try:
        answered = answer_tool_turn(ep.tools, chat, traj, ep.last_stopped) if ep.tools is not None else None
    except ValueError as err:  # a template that cannot render tool results turn by turn
        _fail(ep, f"tools: {err}")
        return
    if answered is not None:
        traj.env_seconds.append(time.perf_counter() - t0)
        ids, text, messages = answered
        traj.turns[-1].observation = _clip(text)

        def appended_results(_: Any) -> None:
            traj.append_observation(ids, text)
            traj.messages.extend(messages)

        _go_on(ep, chat, limits, text, lambda: ids, appended_results)
        return
    out = call_with_timeout(ep.game.step, limits.step_timeout_s, traj.turns[-1].action)
    traj.env_seconds.append(time.perf_counter() - t0)
    if out.error:
        _fail(ep, f"step: {out.error}")
        return
    try:
        result = check_step_result(out.value)
    except (TypeError, ValueError) as err:
        _fail(ep, f"step: {err}")
        return
    observation = result.observation
    text, images = (observation.text, observation.images) if isinstance(observation, Observation) else (observation, [])
    traj.turns[-1].reward = result.reward
    traj.turns[-1].observation = _clip(text)
    state = result.info.pop("state", None)  # the turn's, not the episode's (algo.turn_credit); the info is the guard's copy
    traj.turns[-1].state = None if state is None else _clip(str(state))
    traj.info.update(result.info)
    if result.done:
        traj.stop_reason = "done"
        ep.move(EpisodeState.TERMINATED)
        return

    def appended(chunk: Any) -> None:
        traj.append_observation(chunk.ids, text, chunk.visual)
        traj.messages.append({"role": "user", "content": user_content(text, images)})

    _go_on(ep, chat, limits, text, lambda: chat.encode_observation(observation, ep.last_stopped), appended)


def _go_on(ep: Episode, chat: ChatFormat, limits: EpisodeLimits, text: str, encode: Callable[[], Any],
           append: Callable[[Any], None]) -> None:
    """After an answered turn: the next turn when the episode has turns and tokens left for it
    (`encode()` the answer's tokens, `append(them)` to the record), else the episode's end."""
    traj = ep.traj
    if len(traj.turns) >= limits.max_turns:
        traj.stop_reason = "max_turns"
        ep.move(EpisodeState.TERMINATED)
        return
    left = limits.max_total_tokens - len(traj)
    if (least := chat.min_tokens(len(text))) >= left:  # not encoded: it cannot fit
        _cut(ep, f"turn {len(traj.turns)}'s observation is at least {least:,} tokens; {left:,} of rollout.max_total_tokens "
                 f"{limits.max_total_tokens:,} were left")
        return
    try:
        chunk = encode()
    except ValueError as err:  # images for a language model, an image the processor refuses
        _fail(ep, f"step: {err}")
        return
    ids = chunk if isinstance(chunk, list) else chunk.ids
    if len(ids) >= left:
        _cut(ep, f"turn {len(traj.turns)}'s observation is {len(ids):,} tokens; {left:,} of rollout.max_total_tokens "
                 f"{limits.max_total_tokens:,} were left")
        return
    append(chunk)
    ep.move(EpisodeState.GENERATING)
