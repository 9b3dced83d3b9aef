"""Execution backends: the trainer (scores and updates the policy) and rollout engines (sample it)."""

from opentinker.backend.rollout import Completion, HFRolloutEngine, RolloutEngine, SamplingParams
from opentinker.backend.trainer import PolicyTrainer, StalePolicyError

__all__ = ["Completion", "HFRolloutEngine", "RolloutEngine", "SamplingParams", "PolicyTrainer", "StalePolicyError"]
