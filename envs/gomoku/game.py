"""Gomoku as text: the move parser, a two-player match (self-play) and a game against a scripted opponent.

Moves are written `row,col` (0-based, row first), also `row col` or `(row, col)`, ideally as
`Move: row,col`; the last such pair in a reply counts. An unreadable, off-board or occupied move
is answered with the reason and the board again; more than `max_illegal` of them in one game
lose it, so bad text ends the game instead of raising.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from envs.gomoku.board import BLACK, SYMBOLS, WHITE, Board
from envs.gomoku.examples import game_example
from envs.gomoku.opponents import OPPONENTS
from opentinker.env import AbstractGame, AbstractMatch, StepResult

# Two integers of at most 4 digits (no int() of a huge number) joined by a comma or spaces, not
# part of a longer word or decimal number.
_MOVE_RE = re.compile(r"(?<![\w.-])(-?\d{1,4})(?:[ \t]*,[ \t]*|[ \t]+)(-?\d{1,4})(?!\w|\.\d)")


def parse_move(text: str) -> tuple[int, int] | None:
    """The last `row,col` pair in the text (negative numbers kept, so they can be reported as
    off the board), or None when there is none."""
    found = _MOVE_RE.findall(text or "")
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def rules(size: int, win_length: int, max_illegal: int) -> str:
    """The system prompt: rules, board legend and the exact move format."""
    mid = size // 2
    return (
        f"You are playing Gomoku on a {size}x{size} board. X moves first, then the players alternate, each placing "
        f"one stone on an empty cell. The first to get {win_length} stones in an unbroken line (horizontal, vertical "
        "or diagonal) wins; a full board without one is a draw. On the board '.' is empty, X and O are stones; rows "
        f"(left) and columns (top) are numbered 0 to {size - 1}. Reply with your move as 'Move: row,col', e.g. "
        f"'Move: {mid},{mid}'; only the last row,col pair in your reply counts. An invalid move (unreadable, off the "
        f"board or on a stone) must be retried; more than {max_illegal} invalid moves lose the game."
    )


def _side(player: int | str) -> int:
    """Accept 1/2 or "X"/"O" for a player."""
    side = {"X": BLACK, "O": WHITE, BLACK: BLACK, WHITE: WHITE}.get(player.upper() if isinstance(player, str) else player)
    if side is None:
        raise ValueError(f"player must be 1, 2, 'X' or 'O', got {player!r}")
    return side


class GomokuMatch(AbstractMatch):
    """One board and whose turn it is: the primitive two players (or a model and a script) share.

    The text interface (`observation_for`, `apply`) never raises on bad model text; calling out
    of turn or after the end is a caller's bug and raises ValueError. Players are 1 / "X" (moves
    first) and 2 / "O"; `illegal_moves` counts per player, keyed 1 and 2.
    """

    def __init__(self, size: int = 9, win_length: int = 5, max_illegal: int = 2):
        if max_illegal < 0:
            raise ValueError("max_illegal must be >= 0")
        self.board = Board(size, win_length)
        self.max_illegal = max_illegal
        self.turn = BLACK
        self.illegal_moves = {BLACK: 0, WHITE: 0}
        self.forfeit = 0  # the player who lost by too many illegal moves, if any

    @property
    def finished(self) -> bool:
        return bool(self.winner) or self.board.full()

    @property
    def winner(self) -> int:
        """1 or 2 once decided (line or forfeit), 0 while playing or on a draw."""
        return 3 - self.forfeit if self.forfeit else self.board.winner()

    def result_for(self, player: int | str) -> int:
        """+1 win, -1 loss, 0 draw or unfinished: zero-sum between the two players."""
        if not self.winner:
            return 0
        return 1 if self.winner == _side(player) else -1

    def system_prompt(self) -> str:
        return rules(self.board.size, self.board.win_length, self.max_illegal)

    def result_text(self, player: int | str) -> str:
        p = _side(player)
        if not self.finished:
            return ""
        if not self.winner:
            return "Draw: the board is full."
        if self.forfeit:
            return "You lose: too many invalid moves." if self.forfeit == p else "You win: your opponent made too many invalid moves."
        k = self.board.win_length
        return f"You win: {k} in a row." if self.winner == p else f"You lose: {SYMBOLS[self.winner]} has {k} in a row."

    def observation_for(self, player: int | str) -> str:
        """What `player` sees: its symbol, the board, and whose turn it is (or the result)."""
        p = _side(player)
        if self.finished:
            tail = self.result_text(p)
        elif self.turn == p:
            tail = f"Your move ({SYMBOLS[p]})."
        else:
            tail = f"Waiting for {SYMBOLS[3 - p]} to move."
        return f"You play {SYMBOLS[p]}.\n\n{self.board.render()}\n\n{tail}"

    def play(self, player: int | str, row: int, col: int) -> None:
        """Place a validated move (scripted players); raises ValueError when illegal or out of turn."""
        p = self._check_turn(player)
        self.board.play(row, col, p)
        self.turn = 3 - p

    def apply(self, player: int | str, text: str) -> tuple[bool, str]:
        """Parse and play `player`'s reply. Returns (legal, message for that player): on an
        illegal move the reason, attempts left and the board; past `max_illegal` a loss."""
        p = self._check_turn(player)
        move = parse_move(text)
        problem = self._problem(move)
        if problem is None:
            self.play(p, *move)
            done = f"\n\n{self.board.render()}\n\n{self.result_text(p)}" if self.finished else ""
            return True, f"You played {move[0]},{move[1]}.{done}"
        self.illegal_moves[p] += 1
        left = self.max_illegal - self.illegal_moves[p]
        if left < 0:
            self.forfeit = p
            return False, f"Invalid move: {problem}. {self.result_text(p)}"
        warning = f"{left} more invalid move{'s' if left != 1 else ''} allowed" if left else "One more invalid move loses"
        return False, (
            f"Invalid move: {problem}. {warning}.\n\n"
            f"{self.board.render()}\n\nYour move ({SYMBOLS[p]}): reply with Move: row,col"
        )

    def _problem(self, move: tuple[int, int] | None) -> str | None:
        if move is None:
            return "no move found; write it as Move: row,col"
        r, c = move
        if not self.board.on_board(r, c):
            return f"{r},{c} is off the board (rows and columns go from 0 to {self.board.size - 1})"
        if self.board.cells[r][c]:
            return f"{r},{c} is already taken by {SYMBOLS[self.board.cells[r][c]]}"
        return None

    def _check_turn(self, player: int | str) -> int:
        p = _side(player)
        if self.finished:
            raise ValueError("the match is over")
        if p != self.turn:
            raise ValueError(f"it is {SYMBOLS[self.turn]}'s turn, not {SYMBOLS[p]}'s")
        return p


class GomokuGame(AbstractGame):
    """The model plays one side against a scripted opponent inside the environment.

    Reward at the end: +1 win, -1 loss (including too many invalid moves), 0 draw; 0 on every
    other step. `info["correct"]` is True only on a win, so the generic accuracy is the win rate.
    The opponent's rng comes from the task's `seed` (or `opponent_seed`, when set, for all tasks).
    `model_plays` here overrides the task's; None leaves it to the task (X when absent).
    `few_shot=1` shows one example exchange before the game (see envs.gomoku.examples).
    """

    def __init__(
        self,
        size: int = 9,
        win_length: int = 5,
        opponent: str = "random",
        model_plays: str | None = None,
        max_illegal: int = 2,
        opponent_seed: int | None = None,
        few_shot: int = 0,
    ):
        if opponent not in OPPONENTS:
            raise ValueError(f"unknown opponent {opponent!r}; use one of {sorted(OPPONENTS)}")
        if model_plays not in (None, "X", "O", "random"):
            raise ValueError(f"model_plays must be 'X', 'O' or 'random', got {model_plays!r}")
        if few_shot not in (0, 1):
            raise ValueError(f"few_shot must be 0 or 1 (one example exchange), got {few_shot!r}")
        Board(size, win_length)  # validates the geometry now, not at the first reset
        self.size, self.win_length, self.max_illegal = size, win_length, max_illegal
        self.opponent = OPPONENTS[opponent]
        self.model_plays, self.opponent_seed = model_plays, opponent_seed
        self._example = game_example(size, win_length, max_illegal) if few_shot else []
        self.match: GomokuMatch | None = None
        self.me = BLACK
        self.rng: np.random.Generator | None = None
        self.moves = 0

    @classmethod
    def generate_task(cls, rng: Any, model_plays: str = "X", **_: Any) -> dict[str, Any]:
        if model_plays not in ("X", "O", "random"):
            raise ValueError(f"model_plays must be 'X', 'O' or 'random', got {model_plays!r}")
        seed = int(rng.integers(2**31))
        side = ("X", "O")[int(rng.integers(2))] if model_plays == "random" else model_plays
        return {"seed": seed, "model_plays": side}

    def get_system_prompt(self) -> str:
        return rules(self.size, self.win_length, self.max_illegal)

    def get_example_turns(self) -> list[dict[str, str]]:
        """`few_shot=1`: an earlier game's first two moves, with this environment's replies."""
        return [dict(m) for m in self._example]

    def reset(self, seed: int = 0, model_plays: str | None = None, **_: Any) -> str:
        self.match = GomokuMatch(self.size, self.win_length, self.max_illegal)
        self.rng = np.random.default_rng(self.opponent_seed if self.opponent_seed is not None else int(seed))
        side = self.model_plays or model_plays or "X"
        if side == "random":
            side = ("X", "O")[int(self.rng.integers(2))]
        self.me, self.moves = _side(side), 0
        if self.me == WHITE:
            r, c = self._opponent_move()
            return f"You play O; the opponent (X) opened at {r},{c}.\n\n{self.match.board.render()}\n\nYour move (O)."
        return f"You play X and move first.\n\n{self.match.board.render()}\n\nYour move (X)."

    def step(self, action: str) -> StepResult:
        match = self.match
        if match is None:
            raise RuntimeError("step() before reset()")
        if match.finished:  # only reachable on degenerate boards where the opening move wins
            return self._result(match.observation_for(self.me))
        legal, message = match.apply(self.me, action)
        if legal:
            self.moves += 1
        if not legal or match.finished:
            return self._result(message)
        r, c = self._opponent_move()
        tail = match.result_text(self.me) if match.finished else f"Your move ({SYMBOLS[self.me]})."
        return self._result(f"{message} The opponent ({SYMBOLS[3 - self.me]}) played {r},{c}.\n\n{match.board.render()}\n\n{tail}")

    def _opponent_move(self) -> tuple[int, int]:
        r, c = self.opponent(self.match.board, 3 - self.me, self.rng)
        self.match.play(3 - self.me, r, c)
        return r, c

    def _result(self, observation: str) -> StepResult:
        match = self.match
        result = None
        if match.finished:
            result = {1: "win", -1: "loss", 0: "draw"}[match.result_for(self.me)]
        info = {
            "illegal_moves": match.illegal_moves[self.me],
            "moves": self.moves,
            "result": result,
            "correct": result == "win",
            "game_length": len(match.board.moves),
            "state": match.board.render(),  # the board the next move is made on (step-level groups: algorithm.advantage gigpo)
        }
        return StepResult(observation=observation, reward=float(match.result_for(self.me)), done=match.finished, info=info)
