"""Gomoku as a self-play match: the multi-agent loop's interface (opentinker.agent.selfplay.Match)
over GomokuMatch, with seeded tasks so GameEnvironment can serve train and held-out openings."""

from __future__ import annotations

from typing import Any

from envs.gomoku.board import SYMBOLS
from envs.gomoku.examples import selfplay_example
from envs.gomoku.game import GomokuMatch


class GomokuSelfPlay(GomokuMatch):
    """Two policies play X and O. A task may place opening stones (`opening`: [[r, c], ...],
    alternating X, O, ...) so that GRPO groups share a position and the held-out set differs
    from training."""

    players = ("X", "O")

    def __init__(self, size: int = 9, win_length: int = 5, max_illegal: int = 2, few_shot: int = 0):
        if few_shot not in (0, 1):
            raise ValueError(f"few_shot must be 0 or 1 (one example exchange per player), got {few_shot!r}")
        super().__init__(size, win_length, max_illegal)
        self.few_shot = few_shot

    def example_turns(self, player: str) -> list[dict[str, str]]:
        """`few_shot=1`: the player's first moves of an earlier match, as the match showed them."""
        return selfplay_example(self.board.size, self.board.win_length, self.max_illegal, player) if self.few_shot else []

    @classmethod
    def evaluation_env(cls, player: str, config: dict[str, Any]) -> dict[str, Any]:
        """The env section that evaluates one player's trained policy alone: `player` against the
        scripted random opponent on the same board (what the registry's promotion evaluation replays)."""
        kwargs = {**(config.get("game_kwargs") or {}), "opponent": "random"}
        return {"game": "envs.gomoku:GomokuGame",
                "config": {"model_plays": player, "val_size": config.get("val_size", 64), "game_kwargs": kwargs}}

    @classmethod
    def generate_task(cls, rng: Any, size: int = 9, opening_stones: int = 2, **_: Any) -> dict[str, Any]:
        cells = rng.permutation(size * size)[:opening_stones]
        return {"opening": [[int(c) // size, int(c) % size] for c in cells]}

    def reset(self, opening: list[list[int]] | None = None, **_: Any) -> str:
        for row, col in opening or []:
            self.play(SYMBOLS[self.turn], row, col)
        return self.observation_for(self.current_player)

    @property
    def current_player(self) -> str:
        return SYMBOLS[self.turn]

    def system_prompt(self, player: str | None = None) -> str:  # the rules are the same for both
        return super().system_prompt()

    def info_for(self, player: str) -> dict[str, Any]:
        result = {1: "win", -1: "loss", 0: "draw"}[self.result_for(player)]
        side = 1 if player == "X" else 2
        return {"result": result, "correct": result == "win", "illegal_moves": self.illegal_moves[side],
                "game_length": sum(v != 0 for row in self.board.cells for v in row)}
