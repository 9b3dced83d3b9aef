"""Alias of `opentinker.env.base` under the reference design's module name."""

from opentinker.env.base import AbstractGame, StepResult

__all__ = ["AbstractGame", "StepResult"]
