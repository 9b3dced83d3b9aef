"""Environment API: games (text in, text out) and the data sources that feed them."""

from opentinker.env.base import AbstractGame, AbstractMatch, StepResult
from opentinker.env.environment import GameEnvironment, environment_from_spec, import_game

__all__ = ["AbstractGame", "AbstractMatch", "StepResult", "GameEnvironment", "environment_from_spec", "import_game"]
