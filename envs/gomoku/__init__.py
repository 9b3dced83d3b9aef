"""Gomoku (k in a row) against a scripted opponent (`GomokuGame`) or another player (`GomokuMatch`;
`GomokuSelfPlay` is the match the multi-agent trainer drives)."""

from envs.gomoku.board import Board
from envs.gomoku.game import GomokuGame, GomokuMatch, parse_move
from envs.gomoku.opponents import greedy_opponent, random_opponent
from envs.gomoku.selfplay import GomokuSelfPlay

__all__ = ["Board", "GomokuGame", "GomokuMatch", "GomokuSelfPlay", "greedy_opponent", "parse_move", "random_opponent"]
