"""Seeded arithmetic problems with a strict `Answer: <number>` format."""

from envs.math.game import MathGame, parse_answer

__all__ = ["MathGame", "parse_answer"]
