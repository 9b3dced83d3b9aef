"""Environment API: games (text in, text out) and the data sources that feed them."""

from opentinker.env.base import AbstractGame, StepResult
from opentinker.env.environment import GameEnvironment, environment_from_spec, import_game

__all__ = ["AbstractGame", "StepResult", "GameEnvironment", "environment_from_spec", "import_game"]
