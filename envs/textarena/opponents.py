"""Scripted TextArena players: `fn(session, seen, rng) -> action`, for the seat the model does not play.

`random_opponent` plays a uniformly random move the game takes: the candidates are the bracketed
moves in what the game has shown that player (most TextArena games list them: "Available Moves:
'[0]', '[4]'", "[fold]", "[Bet] 3"), plus `EXTRA` for games that only describe their format;
each is tried on a copy of the game and the first one it takes is played. With none taken it
plays the first candidate (or "[pass]"), which the game refuses as it would any invalid move.
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable

# Bracketed moves, with an optional argument after the bracket ("[Bet] 2", "[guess] 12").
_CANDIDATE = re.compile(r"\[[^\[\]\n]{1,40}\](?: ?[\w\-]{1,12})?")


def _breakthrough(state: Any) -> list[str]:
    """The forward steps of the mover's pieces (files a.., ranks 1.. as the game writes them)."""
    board, files = state.game_state["board"], "abcdefghijklmnop"
    me, ahead, n = ("W", 1, len(board)) if state.current_player_id == 0 else ("B", -1, len(board))
    return [f"[{files[c]}{r + 1}{files[c + d]}{r + 1 + ahead}]" for r in range(n) for c in range(n) if board[r][c] == me
            for d in (-1, 0, 1) if 0 <= c + d < n and 0 <= r + ahead < n]


# Games whose messages do not list every move form: env family -> extra candidates (or a
# function of the game's state that lists them).
EXTRA: dict[str, list[str] | Callable[[Any], list[str]]] = {
    "Breakthrough": _breakthrough,
    "Othello": [f"[{r}, {c}]" for r in range(8) for c in range(8)],
    "ConnectFour": [f"[col {c}]" for c in range(15)],
    "Nim": [f"[{p} {n}]" for p in range(6) for n in range(1, 10)],
    "ColonelBlotto": ["[A4 B4 C12]", "[A10 B5 C5]", "[A7 B7 C6]", "[A10 B10 C10 D10 E10]", "[A20 B5 C15 D5 E5]",
                      "[A11 B11 C11 D11 E11 F10 G10]", "[A5 B20 C5 D20 E5 F10 G10]"],
    "IteratedPrisonersDilemma": ["[cooperate]", "[defect]"],
    "IteratedRockPaperScissors": ["[rock]", "[paper]", "[scissors]"],
    "IteratedMatchingPennies": ["[heads]", "[tails]"],
    "TowerOfHanoi": [f"[{a} {b}]" for a in "ABC" for b in "ABC" if a != b],
    "SimpleTak": [f"[{i}]" for i in range(36)],
    "UltimateTicTacToe": [f"[{m} {r} {c}]" for m in range(9) for r in range(3) for c in range(3)],
}


def candidates(text: str, family: str, state: Any = None) -> list[str]:
    """Distinct bracketed moves found in `text`, then the family's extras."""
    extra = EXTRA.get(family, [])
    found: list[str] = []
    for raw in _CANDIDATE.findall(text) + (extra(state) if callable(extra) else extra):
        move = raw.strip().strip("'\"")
        if move and move not in found and not move.startswith(("[GAME]", "[Player")):
            found.append(move)
    return found


def random_opponent(session: Any, seen: str, rng: random.Random) -> str:
    """A random move the game takes now, among the candidates in `seen` (all the player has been shown)."""
    from envs.textarena.registry import family

    moves = candidates(seen, family(session.env_id), session.state)
    order = rng.sample(moves, len(moves))
    for move in order:
        if session.trial(move):
            return move
    return order[0] if order else "[pass]"


OPPONENTS: dict[str, Callable[[Any, str, random.Random], str]] = {"random": random_opponent}
