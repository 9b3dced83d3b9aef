"""Example exchanges shown before a game (`few_shot`), as MathGame shows a solved problem.

Without one, SmolLM2-135M-Instruct almost never writes a readable move: it talks about the game,
forfeits every game, and GRPO sees only -1 rewards (zero advantages, nothing to learn). The
example is an earlier game's opening played through the real rules, so every observation in it
is exactly what the environment would say.
"""

from __future__ import annotations

import numpy as np

from envs.gomoku.board import SYMBOLS
from envs.gomoku.opponents import random_opponent

Messages = list[dict[str, str]]


def _moves(size: int) -> list[tuple[int, int]]:
    """Two moves along a row near the centre: a readable pattern, legal on any board ≥ 2 wide."""
    r = c = max(size // 2 - 1, 0)
    return [(r, c), (r, c + 1)] if c + 1 < size else [(r, c)]


def game_example(size: int, win_length: int, max_illegal: int) -> Messages:
    """The model's (X's) first moves against the random opponent, with GomokuGame's replies;
    the first opponent seed that leaves the planned cells free."""
    from envs.gomoku.game import GomokuGame

    moves = _moves(size)
    turns: Messages = []
    for seed in range(100):
        game = GomokuGame(size=size, win_length=win_length, opponent="random", max_illegal=max_illegal)
        turns = [{"role": "user", "content": game.reset(seed=seed)}]
        for i, (row, col) in enumerate(moves):
            if game.match.finished or game.match.board.cells[row][col]:
                break
            result = game.step(f"Move: {row},{col}")
            turns.append({"role": "assistant", "content": f"Move: {row},{col}"})
            if i + 1 < len(moves):
                turns.append({"role": "user", "content": result.observation})
        else:
            return turns
    return turns[:2]


def selfplay_example(size: int, win_length: int, max_illegal: int, player: str) -> Messages:
    """`player`'s first moves in a match against a random other side, with what the match shows
    that player at each of its turns (GomokuMatch.observation_for)."""
    from envs.gomoku.game import GomokuMatch

    planned = _moves(size)
    for seed in range(100):
        rng = np.random.default_rng(seed)
        match = GomokuMatch(size, win_length, max_illegal)
        turns: Messages = []
        for row, col in planned:
            if SYMBOLS[match.turn] != player:
                match.play(match.turn, *random_opponent(match.board, match.turn, rng))
            if match.finished or match.board.cells[row][col]:
                break
            turns.append({"role": "user", "content": match.observation_for(player)})
            match.play(player, row, col)
            turns.append({"role": "assistant", "content": f"Move: {row},{col}"})
        else:
            return turns
    return turns

