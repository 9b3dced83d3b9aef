"""Generalised advantage estimation over an episode's turns, and PPO's clipped value loss.

The critic (opentinker.backend.critic) values the state each turn acts from, V(s_t); the turn's
reward r_t is what the game gave for it (`Turn.reward`, the outcome on the last turn). Then, with
V(s_T) = 0 after the last turn:

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lambda * A_{t+1}
    G_t     = A_t + V(s_t)                         (the critic's target)

lambda = 1 gives the discounted return minus the value (Monte Carlo); lambda = 0 the one-step
temporal difference. The value loss is PPO's, clipped around the values the advantages were
computed with: 0.5 * max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2).
"""

from __future__ import annotations

import torch


def gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one episode's turns, from their rewards and the critic's values."""
    if len(rewards) != len(values):
        raise ValueError(f"{len(rewards)} rewards for {len(values)} values")
    advantages = [0.0] * len(rewards)
    running, next_value = 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t], next_value = running, values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


def whiten(advantages: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Mean 0 and std 1 over the batch (PPO's normalisation; a batch of one, or of equal values, is only centred)."""
    centred = advantages - advantages.mean()
    std = float(advantages.std(unbiased=True)) if advantages.numel() > 1 else 0.0
    return centred / (std + eps) if std > 0 else centred


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """PPO's value loss per sample (see the module): the worse of the unclipped and clipped errors."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
