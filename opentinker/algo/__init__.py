"""RL algorithms as pure tensor functions: no models, no I/O."""

from opentinker.algo.advantages import compute_advantages, grpo_advantages, rloo_advantages
from opentinker.algo.losses import aggregate, entropy_from_logits, kl_estimate, masked_mean, ppo_clipped_loss

__all__ = [
    "compute_advantages", "grpo_advantages", "rloo_advantages",
    "aggregate", "entropy_from_logits", "kl_estimate", "masked_mean", "ppo_clipped_loss",
]
