"""The reference design's import paths (`opentinker.environment.base_game`), kept as aliases."""

from opentinker.env import AbstractGame, GameEnvironment, Observation, StepResult

__all__ = ["AbstractGame", "GameEnvironment", "Observation", "StepResult"]
