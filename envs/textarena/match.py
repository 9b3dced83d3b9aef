"""A two-player TextArena game as an AbstractMatch: each seat a policy (self-play, a snapshot
of the learner, or its own agent), played turn by turn by opentinker.agent.selfplay.

Players are "P0" and "P1" (TextArena's players 0 and 1; a spec's `multiagent.players` names
them so). Each is shown only what is new to it since its last move; a move the game refuses is
answered with TextArena's own message (retry, or lose past the game's allowance), never raised.
"""

from __future__ import annotations

from typing import Any

from envs.textarena.common import check_env, check_env_config, draw_seed, outcome, system_prompt
from envs.textarena.session import Session
from opentinker.env import AbstractMatch

PLAYERS = ("P0", "P1")


class TextArenaMatch(AbstractMatch):
    """`env.game: envs.textarena:TextArenaMatch`, `env.config: {env_id: "TicTacToe-v0"}`,
    `multiagent.players: [P0, P1]`. Tasks are `{env_id, seed}`."""

    players = PLAYERS

    def __init__(self, env_id: str | None = None):
        if env_id is not None:
            check_env(env_id, 2)
        self.env_id = env_id
        self.session: Session | None = None

    @classmethod
    def check_config(cls, config: dict[str, Any] | None) -> None:
        """Refuse an env id that cannot run here as a two-player match, before the job starts."""
        check_env_config(config, 2)

    @classmethod
    def generate_task(cls, rng: Any, env_id: str | None = None, **_: Any) -> dict[str, Any]:
        check_env(env_id, 2)
        return {"env_id": env_id, "seed": draw_seed(rng)}

    @classmethod
    def evaluation_env(cls, player: str, config: dict[str, Any]) -> dict[str, Any]:
        """One trained seat alone: that player against the scripted random opponent (what the
        registry's promotion evaluation replays)."""
        return {"game": "envs.textarena:TextArenaGame",
                "config": {"env_id": config.get("env_id"), "model_plays": PLAYERS.index(player), "val_size": config.get("val_size", 64),
                           "game_kwargs": {"opponent": "random"}}}

    def reset(self, env_id: str | None = None, seed: int = 0, **_: Any) -> str:
        env_id = self.env_id or env_id
        check_env(env_id, 2)
        self.session = Session(env_id, 2, seed)
        return self.session.render(self.session.current, consume=False)

    @property
    def finished(self) -> bool:
        return self.session is not None and self.session.done

    @property
    def current_player(self) -> str:
        return PLAYERS[self.session.current]

    def system_prompt(self, player: str | None = None) -> str:
        return system_prompt()

    def observation_for(self, player: str) -> str:
        """What is new to `player` (the game's rules the first time), then the result once over."""
        return self.session.render(_seat(player)) or "(no new messages)"

    def apply(self, player: str, action: str) -> tuple[bool, str]:
        """Play `player`'s reply. (True, "") when the game took it; (False, the game's message)
        when it refused it. Out of turn or after the end is the caller's bug: ValueError."""
        seat = _seat(player)
        if self.finished:
            raise ValueError("the match is over")
        if seat != self.session.current:
            raise ValueError(f"it is {self.current_player}'s turn, not {player}'s")
        if self.session.step(action if isinstance(action, str) else str(action)):
            return True, ""
        return False, self.session.render(seat) or "Your move was refused."

    def result_for(self, player: str) -> int:
        return self.session.result(_seat(player)) if self.session else 0

    def info_for(self, player: str) -> dict[str, Any]:
        session, seat = self.session, _seat(player)
        result = outcome(self.result_for(player))
        return {"env_id": session.env_id, "result": result, "correct": result == "win", "illegal_moves": session.refused[seat],
                "game_length": int(getattr(session.state, "turn", 0)), "reason": session.reason, "game_errors": session.errors}


def _seat(player: str | int) -> int:
    if player in (0, 1):
        return int(player)
    if player not in PLAYERS:
        raise ValueError(f"player must be one of {PLAYERS}, got {player!r}")
    return PLAYERS.index(player)
