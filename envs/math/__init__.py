"""Seeded arithmetic problems with a strict `Answer: <number>` format."""

from envs.math.game import MathGame, graded, parse_answer

__all__ = ["MathGame", "graded", "parse_answer"]
