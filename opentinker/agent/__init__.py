"""The agent loop: episodes as a state machine over an append-only token record."""

from opentinker.agent.chat import ChatFormat
from opentinker.agent.loop import EpisodeLimits, EpisodeState, run_episodes
from opentinker.agent.vision_chat import chat_format

__all__ = ["ChatFormat", "EpisodeLimits", "EpisodeState", "chat_format", "run_episodes"]
