"""reasoning-gym's procedural datasets as single-turn games, scored by their own verifiers."""

from envs.reasoning_gym.game import ReasoningGymGame

__all__ = ["ReasoningGymGame"]
