"""Two-or-more-player matches where every seat is a policy: the multi-agent agent loop.

Each seat keeps its own append-only token record per match (what that player saw and sampled),
exactly like the single-agent loop: its prompt is tokenized once, its moves enter with mask 1
and their sampling logprobs, and everything it is shown afterwards (the opponent's move, the
board, an illegal-move message) enters as a chat-template observation delta with mask 0.
Every match is a stream of its own: a move goes to its seat's engine as soon as it is that
player's turn, and the engine batches the moves that wait together (continuous batching).

Rewards are the match's zero-sum result, put on each player's last turn: +1 win, -1 loss, 0
draw (`AbstractMatch.result_for`). A match that breaks (its code raises) or runs out of turns/tokens is
a draw for everyone, with the reason in `info`; it never stops the other matches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from opentinker.agent.chat import ChatFormat
from opentinker.agent.guard import call_with_timeout
from opentinker.agent.loop import EpisodeLimits, each, episode_generators
from opentinker.backend.rollout import RolloutEngine, SamplingParams
from opentinker.core.trajectory import Trajectory
from opentinker.env.base import AbstractMatch as Match

log = logging.getLogger(__name__)


@dataclass
class Seat:
    """A player's policy: its inference engine and chat format (its own adapter or model)."""

    engine: RolloutEngine
    chat: ChatFormat


def play_matches(seats: dict[str, Seat], matches: list[Match], params: SamplingParams, limits: EpisodeLimits,
                 group_ids: list[int] | None = None, generators: list[Any] | None = None) -> dict[str, list[Trajectory | None]]:
    """Play every match to its end, each on its own (a thread each: a match waits for its own
    players' moves only, the engines batch the moves that wait together); returns, per player, one
    record per match (None if that player never had to move). `generators[i]`: where match i's
    draws come from."""
    n = len(matches)
    groups = group_ids or list(range(n))
    records: dict[str, list[Trajectory | None]] = {p: [None] * n for p in seats}
    aborted: dict[int, str] = {}
    gens = generators or episode_generators(n, next(iter(seats.values())).engine)
    each(list(range(n)), lambda i: _play(seats, matches[i], i, params, limits, groups[i], records, aborted, gens[i]))
    for i, match in enumerate(matches):
        for player in seats:
            traj = records[player][i]
            if traj is None or not traj.turns:
                continue
            if i in aborted:
                traj.info.update({"result": "draw", "aborted": aborted[i]})
                traj.stop_reason = "aborted"
                continue
            traj.turns[-1].reward = float(match.result_for(player))
            traj.info.update(match.info_for(player))
            traj.stop_reason = traj.stop_reason or "done"
    return records


def _play(seats: dict[str, Seat], match: Match, i: int, params: SamplingParams, limits: EpisodeLimits, group: int,
          records: dict[str, list[Trajectory | None]], aborted: dict[int, str], generator: Any) -> None:
    """One match, move after move, until it finishes or breaks."""
    pending: dict[tuple[int, str], str | None] = {}  # a message the player must see next (illegal move)
    stopped: dict[tuple[int, str], bool] = {}
    extra = {"generators": [generator]}
    while not match.finished and i not in aborted:
        player = match.current_player
        seat = seats[player]
        try:
            shown = _show(seat, match, player, records, pending, stopped, aborted, limits, group, i)
        except Exception as err:  # noqa: BLE001 - the match's text or code raised: it costs this match, not the job
            log.exception("match %d: showing %s its turn raised", i, player)
            aborted[i] = f"observation for {player}: {type(err).__name__}: {str(err)[:300]}"
            return
        if not shown:
            return
        traj = records[player][i]
        (comp,) = seat.engine.generate([traj.token_ids], params, [limits.max_total_tokens - len(traj)], **extra)
        action = seat.chat.decode(comp.token_ids)
        traj.append_sampled(comp.token_ids, comp.logprobs, action, comp.versions or [seat.engine.policy_version] * len(comp.token_ids))
        traj.messages.append({"role": "assistant", "content": action})
        stopped[(i, player)] = comp.finish_reason == "stop"
        # a match that raises or hangs costs that match only (a hung call is abandoned, the match never touched again)
        outcome = call_with_timeout(match.apply, limits.step_timeout_s, player, action)
        if outcome.error is not None:
            aborted[i] = f"apply: {outcome.error}"
            return
        legal, message = outcome.value
        pending[(i, player)] = None if legal else message


def _show(seat: Seat, match: Match, player: str, records, pending, stopped, aborted, limits: EpisodeLimits, group: int, i: int) -> bool:
    """Give `player` what it sees now (its prompt, or an observation delta); False if the match
    had to end instead (turn or token budget spent)."""
    traj = records[player][i]
    message = pending.get((i, player))
    observation = message if message is not None else match.observation_for(player)
    if traj is None:
        examples = match.example_turns(player) if hasattr(match, "example_turns") else []
        messages = [{"role": "system", "content": match.system_prompt(player)}, *examples, {"role": "user", "content": observation}]
        records[player][i] = Trajectory(prompt_ids=seat.chat.prompt_ids(messages), group_id=group, messages=messages,
                                        task={"match": i, "player": player})
        return True
    if len(traj.turns) >= limits.max_turns:
        aborted[i] = f"{player} reached max_turns={limits.max_turns}"
        return False
    ids = seat.chat.observation_ids(observation, stopped.get((i, player), False))
    if len(traj) + len(ids) >= limits.max_total_tokens:
        aborted[i] = f"{player} reached max_total_tokens={limits.max_total_tokens}"
        return False
    traj.append_observation(ids, observation)
    traj.messages.append({"role": "user", "content": observation})
    return True
