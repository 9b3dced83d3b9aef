"""Environment API: games (text in; text, and images, out) and the data sources that feed them."""

from opentinker.env.base import AbstractGame, AbstractMatch, StepResult
from opentinker.env.environment import GameEnvironment, environment_from_spec, import_game
from opentinker.env.observation import Observation

__all__ = ["AbstractGame", "AbstractMatch", "Observation", "StepResult", "GameEnvironment", "environment_from_spec", "import_game"]
