"""Scripted opponents: `fn(board, player, rng) -> (row, col)`, a legal move for `player`.

Deterministic given the rng (a numpy Generator or a `random.Random`), so a task's seed fixes how
the opponent plays. They never modify the board.
"""

from __future__ import annotations

from typing import Any

from envs.gomoku.board import Board


def _pick(moves: list[tuple[int, int]], rng: Any) -> tuple[int, int]:
    """One of `moves` (in board order) chosen by rng, whichever rng API it has."""
    if not moves:
        raise ValueError("no legal move: the board is full")
    i = int(rng.integers(len(moves))) if hasattr(rng, "integers") else rng.randrange(len(moves))
    return moves[i]


def random_opponent(board: Board, player: int, rng: Any) -> tuple[int, int]:
    """A uniformly random empty cell: the weakest baseline, and a source of varied positions."""
    return _pick(board.empty_cells(), rng)


def _neighbours(board: Board, row: int, col: int) -> int:
    return sum(
        1
        for dr in (-1, 0, 1)
        for dc in (-1, 0, 1)
        if (dr or dc) and board.on_board(row + dr, col + dc) and board.cells[row + dr][col + dc]
    )


def greedy_opponent(board: Board, player: int, rng: Any) -> tuple[int, int]:
    """Win now if possible, else block the other side's immediate win, else play the cell that
    makes its own longest line, then blocks the other's longest, then touches the most stones."""
    cells = board.empty_cells()
    other = 3 - player
    for side in (player, other):  # winning first, blocking second
        hits = [m for m in cells if board.line_length(*m, side) >= board.win_length]
        if hits:
            return _pick(hits, rng)
    scores = {m: (board.line_length(*m, player), board.line_length(*m, other), _neighbours(board, *m)) for m in cells}
    best = max(scores.values(), default=None)
    return _pick([m for m in cells if scores[m] == best], rng)


OPPONENTS = {"random": random_opponent, "greedy": greedy_opponent}
