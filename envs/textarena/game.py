"""A TextArena game as an AbstractGame: a one-player game played by the model, or a two-player
game with the model in one seat and a scripted opponent (envs.textarena.opponents) in the other.

The model's reply is the TextArena action as it is (the game's own format, e.g. "[4]" or
"[guess] x"); the game's own instructions are the first observation. Reward at the end: a
one-player game's TextArena reward (often 1 on success, a fraction or -1 otherwise), a
two-player game's result for the model (+1 win, -1 loss, 0 draw); 0 on other steps.
"""

from __future__ import annotations

import random
from typing import Any

from envs.textarena.common import check_env, check_env_config, draw_seed, outcome, system_prompt
from envs.textarena.opponents import OPPONENTS
from envs.textarena.registry import VERIFIED
from envs.textarena.session import Session
from opentinker.env import AbstractGame, StepResult

MAX_OPPONENT_MOVES = 200  # in a row: past it the game is broken (one failed episode, not a hung one)


class TextArenaGame(AbstractGame):
    """`env.game: envs.textarena:TextArenaGame`, `env.config: {env_id: "GuessTheNumber-v0"}`.

    Tasks are `{env_id, seed}` (and `model_plays`, 0 or 1, for a two-player game: `model_plays`
    in env.config fixes it, default random); TextArena's `reset(seed)` makes the same game from
    the same task. `game_kwargs`: `opponent` ("random"); `env_id` here (direct use) overrides the tasks'.
    """

    def __init__(self, env_id: str | None = None, opponent: str = "random"):
        if opponent not in OPPONENTS:
            raise ValueError(f"unknown opponent {opponent!r}; use one of {sorted(OPPONENTS)}")
        if env_id is not None:
            check_env(env_id, None)
        self.env_id, self.opponent = env_id, OPPONENTS[opponent]
        self.session: Session | None = None
        self.me = 0
        self.moves = 0
        self._rng = random.Random(0)
        self._opponent_seen: list[str] = []

    @classmethod
    def check_config(cls, config: dict[str, Any] | None) -> None:
        """Refuse an env id that cannot run here, before the job starts (see registry)."""
        check_env_config(config, None)

    @classmethod
    def generate_task(cls, rng: Any, env_id: str | None = None, model_plays: Any = "random", **_: Any) -> dict[str, Any]:
        check_env(env_id, None)
        task: dict[str, Any] = {"env_id": env_id, "seed": draw_seed(rng)}
        if VERIFIED[env_id] == 2:
            if model_plays not in (0, 1, "random"):
                raise ValueError(f"model_plays must be 0, 1 or 'random', got {model_plays!r}")
            task["model_plays"] = int(rng.integers(2)) if model_plays == "random" else int(model_plays)
        return task

    def get_system_prompt(self) -> str:
        return system_prompt()

    def reset(self, env_id: str | None = None, seed: int = 0, model_plays: int = 0, **_: Any) -> str:
        env_id = self.env_id or env_id
        players = VERIFIED.get(env_id, 0) if isinstance(env_id, str) else 0
        check_env(env_id, players or None)
        self.session = Session(env_id, players, seed)
        self.me = int(model_plays) if players == 2 else 0
        self.moves = 0
        self._rng = random.Random(f"opponent-{seed}")
        self._opponent_seen = []
        self._play_opponent()
        return self.session.render(self.me)

    def step(self, action: str) -> StepResult:
        session = self.session
        if session is None:
            raise RuntimeError("step() before reset()")
        if not session.done:
            self.moves += session.step(action if isinstance(action, str) else str(action))
            self._play_opponent()
        return self._result(session.render(self.me))

    def close(self) -> None:
        self.session = None

    def _play_opponent(self) -> None:
        """The scripted seat moves until it is the model's turn again (or the game ends)."""
        session = self.session
        for _ in range(MAX_OPPONENT_MOVES):
            if session.done or session.current == self.me:
                return
            them = session.current
            self._opponent_seen = (self._opponent_seen[:1] + [session.render(them)])  # the rules, then what is new
            session.step(self.opponent(session, "\n".join(self._opponent_seen), self._rng))
        raise RuntimeError(f"{session.env_id}: the opponent moved {MAX_OPPONENT_MOVES} times in a row")

    def _result(self, observation: str) -> StepResult:
        session = self.session
        two = session.num_players == 2
        reward, result = 0.0, None
        if session.done:
            if two:
                reward = float(session.result(self.me))
                result = outcome(int(reward))
            else:
                reward = float((session.rewards or {}).get(0, 0.0))
                result = "win" if reward >= 1 else "loss"
        info = {"env_id": session.env_id, "result": result, "correct": result == "win", "illegal_moves": session.refused[self.me],
                "moves": self.moves, "game_length": int(getattr(session.state, "turn", 0)), "reason": session.reason,
                "game_errors": session.errors}
        return StepResult(observation=observation or "(no new messages)", reward=reward, done=session.done, info=info)

