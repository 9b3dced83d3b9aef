"""One TextArena game in progress, seen the way the chat loops need it.

- Built like `textarena.make(env_id)` with the registry's action wrappers (e.g. `[...]` added to a
  bare action) but none of its observation wrappers: those re-send the whole history every turn,
  while a chat record already holds it, so each player is shown only what is new to it.
- Randomness: TextArena games draw from Python's global `random` (seeded by `reset`). Each game
  keeps its own stream and swaps it in under a lock for every call, so concurrent episodes do
  not shift each other's draws and a seed gives the same game every time.
- A move TextArena refuses costs the turn the way the game rules it (`set_invalid_move`: a retry,
  then a loss); game code that raises on a move is charged the same way, never raised further.
"""

from __future__ import annotations

import copy
import importlib
import random
import threading
from contextlib import contextmanager
from typing import Any, Iterator

_RANDOM = threading.Lock()


def _make(env_id: str) -> Any:
    """The TextArena env for `env_id` with its registered action wrappers only."""
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY

    spec = ENV_REGISTRY[env_id]
    entry = spec.entry_point
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    env = entry(**spec.kwargs)
    env.env_id, env.entry_point = env_id, spec.entry_point
    for wrapper in spec.default_wrappers or []:
        if issubclass(wrapper, ta.ActionWrapper):
            env = wrapper(env)
    return env


class Session:
    """A TextArena env with per-player message queues, refusal detection and a result."""

    def __init__(self, env_id: str, num_players: int, seed: int):
        self.env_id, self.num_players, self.seed = env_id, num_players, int(seed)
        self.env = _make(env_id)
        self.inbox: dict[int, list[tuple[int, str, Any]]] = {p: [] for p in range(num_players)}
        self.refused = {p: 0 for p in range(num_players)}  # moves the game refused, per player
        self.errors = 0  # moves on which the game's own code raised
        self.done = False
        self.rewards: dict[int, float] | None = None
        self.reason = ""
        self._random = random.Random(self.seed).getstate()
        with self.own_random():
            self.env.reset(num_players=num_players, seed=self.seed)
        self._collect()

    @property
    def state(self) -> Any:
        return self.env.state

    @property
    def current(self) -> int:
        return int(self.state.current_player_id)

    @contextmanager
    def own_random(self) -> Iterator[None]:
        """Python's global generator set to this game's stream for the duration."""
        with _RANDOM:
            outside = random.getstate()
            random.setstate(self._random)
            try:
                yield
            finally:
                self._random = random.getstate()
                random.setstate(outside)

    def _collect(self) -> None:
        """Move what TextArena queued for each player into our inboxes."""
        queued = self.state.observations
        for p in range(self.num_players):
            self.inbox[p].extend(queued.get(p, []))
            queued[p] = []

    def render(self, player: int, consume: bool = True) -> str:
        """What is new to `player` since it was last shown (its own moves left out: its chat has
        them), as TextArena's LLM wrapper writes messages: `[GAME] ...`, `[Player 1] ...`.
        `consume=False` peeks: the same text is shown again next time."""
        from textarena.core import GAME_ID

        names = getattr(self.state, "role_mapping", {}) or {}
        lines = []
        for sender, message, _ in self.inbox[player]:
            if sender == player:
                continue
            name = "GAME" if sender == GAME_ID else names.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {message}".strip())
        if consume:
            self.inbox[player] = []
        if self.done and self.reason:
            lines.append(f"[GAME] Game over: {self.reason}")
        return "\n".join(lines)

    def step(self, action: str) -> bool:
        """Play the current player's `action`; True when the game took it, False when it refused
        it (that player's turn is spent as TextArena rules: retry, or lose past its allowance)."""
        player = self.current
        with self.own_random():
            done, refused, error = _step(self.env, action)
        self.errors += error
        self.refused[player] += refused
        self._collect()
        if done:
            self._finish()
        return not refused

    def _finish(self) -> None:
        rewards, game_info = self.env.close()
        self.done = True
        self.rewards = {int(p): float(r) for p, r in (rewards or {}).items()}
        reasons = {str(i.get("reason")) for i in (game_info or {}).values() if isinstance(i, dict) and i.get("reason")}
        self.reason = "; ".join(sorted(reasons))

    def result(self, player: int) -> int:
        """Two players: +1 when `player`'s reward beats the other's, -1 below, 0 equal or unfinished."""
        if not self.done or not self.rewards:
            return 0
        mine = self.rewards.get(player, 0.0)
        other = max((r for p, r in self.rewards.items() if p != player), default=0.0)
        return (mine > other) - (mine < other)

    def trial(self, action: str) -> bool:
        """Would the game take `action` now? Asked of a copy, so this game is untouched."""
        twin = copy.deepcopy(self.env)
        with self.own_random():
            state = random.getstate()
            try:
                _, refused, error = _step(twin, action)
                return not (refused or error)
            finally:
                random.setstate(state)


def _step(env: Any, action: str) -> tuple[bool, bool, bool]:
    """(done, refused, the game raised) for one TextArena step. Refused: the game called its
    state's `set_invalid_move` (the only way TextArena refuses a move); game code that raises is
    charged as such a call, with the error as the reason."""
    state = env.state
    calls: list[bool] = []
    original = state.set_invalid_move

    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        return original(*args, **kwargs)

    state.set_invalid_move = recorded  # this state object only, for this step only
    error = False
    try:
        done, _ = env.step(action=action)
    except Exception as err:  # noqa: BLE001 - the game's bug on this text: an invalid move, as TextArena rules one
        error = True
        state.set_invalid_move(reason=f"the game could not process this move ({type(err).__name__}: {err})")
        done, _ = state.step()
    finally:
        state.__dict__.pop("set_invalid_move", None)
    return bool(done), bool(calls), error
