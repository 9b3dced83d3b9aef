"""Alias of `opentinker.env.base` under the reference design's module name."""

from opentinker.env.base import AbstractGame, StepResult
from opentinker.env.observation import Observation

__all__ = ["AbstractGame", "Observation", "StepResult"]
