"""The agent loop: episodes as a state machine over an append-only token record."""

from opentinker.agent.chat import ChatFormat
from opentinker.agent.loop import EpisodeLimits, EpisodeState, run_episodes

__all__ = ["ChatFormat", "EpisodeLimits", "EpisodeState", "run_episodes"]
