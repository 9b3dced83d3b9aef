"""The Gomoku rules engine: a square board, stones, k-in-a-row detection and a text rendering.

Freestyle rules: a line of `win_length` *or more* stones wins (overlines count). Rows and columns
are 0-based, `(row, col)` with row 0 at the top. No model or text-parsing concerns live here.
"""

from __future__ import annotations

EMPTY, BLACK, WHITE = 0, 1, 2
SYMBOLS = {EMPTY: ".", BLACK: "X", WHITE: "O"}
_DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))  # horizontal, vertical, diagonal, anti-diagonal


class Board:
    """Cells hold 0 (empty), 1 (black, X, moves first) or 2 (white, O)."""

    def __init__(self, size: int = 9, win_length: int = 5):
        if size < 1 or not 1 <= win_length <= size:
            raise ValueError(f"need size >= 1 and 1 <= win_length <= size, got {size}, {win_length}")
        self.size, self.win_length = size, win_length
        self.cells = [[EMPTY] * size for _ in range(size)]
        self.moves: list[tuple[int, int, int]] = []  # (row, col, player) in play order
        self._winner = EMPTY

    def on_board(self, row: int, col: int) -> bool:
        return 0 <= row < self.size and 0 <= col < self.size

    def legal(self, row: int, col: int) -> bool:
        return self.on_board(row, col) and self.cells[row][col] == EMPTY

    def empty_cells(self) -> list[tuple[int, int]]:
        return [(r, c) for r in range(self.size) for c in range(self.size) if self.cells[r][c] == EMPTY]

    def line_length(self, row: int, col: int, player: int) -> int:
        """The longest line of `player` through (row, col), counting that cell as `player`'s.

        Only the four lines through one cell can change with a move there, so win detection
        after each move (and the greedy opponent's look-ahead) scans just those.
        """
        best = 0
        for dr, dc in _DIRECTIONS:
            run = 1
            for sign in (1, -1):
                r, c = row + sign * dr, col + sign * dc
                while self.on_board(r, c) and self.cells[r][c] == player:
                    run += 1
                    r, c = r + sign * dr, c + sign * dc
            best = max(best, run)
        return best

    def play(self, row: int, col: int, player: int) -> None:
        """Place a stone; raises ValueError on an illegal move (callers validate model input first)."""
        if player not in (BLACK, WHITE):
            raise ValueError(f"player must be 1 or 2, got {player!r}")
        if self._winner:
            raise ValueError("the game is already won")
        if not self.legal(row, col):
            raise ValueError(f"illegal move {row},{col}")
        self.cells[row][col] = player
        self.moves.append((row, col, player))
        if self.line_length(row, col, player) >= self.win_length:
            self._winner = player

    def winner(self) -> int:
        """1 or 2 once a player has a line of `win_length`, else 0."""
        return self._winner

    def full(self) -> bool:
        """No empty cell left: with no winner, the game is a draw."""
        return len(self.moves) == self.size * self.size

    def render(self) -> str:
        """A compact grid: a header of column indices, each row prefixed with its index,
        `.` empty, `X` black, `O` white. Indices are 0-based and padded to equal width."""
        w = len(str(self.size - 1))
        header = " " * w + " " + " ".join(f"{c:>{w}}" for c in range(self.size))
        rows = [f"{r:>{w}} " + " ".join(f"{SYMBOLS[v]:>{w}}" for v in row) for r, row in enumerate(self.cells)]
        return "\n".join([header, *rows])

    def to_list(self) -> list[list[int]]:
        return [list(row) for row in self.cells]

    def copy(self) -> Board:
        other = Board(self.size, self.win_length)
        other.cells, other.moves, other._winner = self.to_list(), list(self.moves), self._winner
        return other

    def __str__(self) -> str:
        return self.render()
