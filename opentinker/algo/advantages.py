"""Group-relative advantage estimators. One scalar reward per sample in, one advantage out.

Samples of the same prompt share a `group` id; advantages compare a sample with its group.
"""

from __future__ import annotations

import torch


def _group_index(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map arbitrary group ids to 0..G-1 and return (index per sample, count per group)."""
    _, index = torch.unique(groups, return_inverse=True)
    counts = torch.bincount(index).to(torch.float64)
    return index, counts


def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean of the group) / (std of the group + eps) with the unbiased std.

    A group whose rewards are all equal gets advantage 0 everywhere (no signal, no noise).
    """
    r = rewards.to(torch.float64)
    index, counts = _group_index(groups)
    sums = torch.zeros_like(counts).index_add_(0, index, r)
    means = sums / counts
    centred = r - means[index]
    if not normalize_std:
        return centred.to(rewards.dtype)
    sq = torch.zeros_like(counts).index_add_(0, index, centred**2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return (centred / (std[index] + eps)).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other samples in its group, i.e. (n/(n-1)) (r_i - mean)."""
    r = rewards.to(torch.float64)
    index, counts = _group_index(groups)
    if bool((counts < 2).any()):
        raise ValueError("RLOO needs at least two samples per group")
    sums = torch.zeros_like(counts).index_add_(0, index, r)
    others_mean = (sums[index] - r) / (counts[index] - 1)
    return (r - others_mean).to(rewards.dtype)


def compute_advantages(kind: str, rewards: torch.Tensor, groups: torch.Tensor, normalize_std: bool = True) -> torch.Tensor:
    if kind == "grpo":
        return grpo_advantages(rewards, groups, normalize_std=normalize_std)
    if kind == "rloo":
        return rloo_advantages(rewards, groups)
    raise ValueError(f"unknown advantage estimator {kind!r}")
