"""Reinforcement learning: the step loop, and the jobs it drives (single-agent RL, self-play),
made of a policy (learns) and a sampler (plays the environment)."""

from opentinker.rl.job import RLJob
from opentinker.rl.loop import LoopHooks, LoopResult, StepReport, run_steps
from opentinker.rl.policy import Policy, Restored
from opentinker.rl.sampler import Evaluation, RolloutBatch, Sampler

__all__ = ["RLJob", "LoopHooks", "LoopResult", "StepReport", "run_steps", "Policy", "Restored", "Evaluation",
           "RolloutBatch", "Sampler"]
