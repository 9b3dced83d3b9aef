"""Policy-gradient losses over masked token tensors of shape [batch, time].

`mask` is 1 on tokens the policy sampled; every statistic is taken over those tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: float | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar.

    token-mean: every sampled token in the batch weighs the same (sum / number of tokens).
    seq-mean:   every sequence weighs the same (mean over its tokens, then over sequences).
    `normalizer` replaces the denominator (tokens or sequences in the whole batch) so that
    gradient accumulation over micro-batches gives the same gradient as one big batch.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1)
        return (per_token * mask).sum() / denom
    if mode == "seq-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        denom = normalizer if normalizer is not None else per_token.shape[0]
        return per_seq.sum() / denom
    raise ValueError(f"unknown loss aggregation {mode!r}")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1 / k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        # exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased, low variance
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}")


@dataclass
class PolicyLossOutput:
    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    weight_mean: torch.Tensor  # the behaviour importance weight's mean (1 on-policy)
    capped_fraction: torch.Tensor  # tokens whose weight was capped


def ppo_clipped_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.2,
    aggregation: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    normalizer: float | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    weight_cap: float = 2.0,
) -> PolicyLossOutput:
    """PPO's clipped surrogate, plus an optional KL penalty; off-policy, decoupled PPO.

    advantages are per token ([B, T]) or per sequence ([B], broadcast over its tokens).
    per-token loss = -w * min(r * A, clip(r, 1-eps, 1+eps) * A) + kl_coef * KL, with
    r = pi / pi_old. On-policy `old_logprobs` are the sampler's and w = 1. Off-policy
    (`behaviour_logprobs` given: the sampler's), `old_logprobs` are the proximal policy's (the
    policy before this update) and w = min(pi_old / pi_behaviour, weight_cap), a truncated
    importance weight (no gradient) that corrects for tokens drawn by an older policy (AReaL's
    decoupled PPO). With pi_old = pi_behaviour it is PPO's loss.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    weight = torch.ones_like(per_token)
    if behaviour_logprobs is not None:
        weight = torch.exp(old_logprobs - behaviour_logprobs).clamp(max=weight_cap).detach()
        per_token = per_token * weight
    pg_loss = aggregate(per_token, mask, aggregation, normalizer)
    if ref_logprobs is not None and kl_coef > 0:
        kl_tok = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        kl = aggregate(kl_tok, mask, aggregation, normalizer)
        loss = pg_loss + kl_coef * kl
    else:
        kl = torch.zeros((), dtype=logprobs.dtype)
        loss = pg_loss
    with torch.no_grad():
        clip_fraction = masked_mean((unclipped > clipped).to(logprobs.dtype), mask)
        ratio_mean = masked_mean(ratio, mask)
        weight_mean = masked_mean(weight, mask)
        capped = masked_mean((weight >= weight_cap).to(logprobs.dtype), mask) if behaviour_logprobs is not None else torch.zeros(())
    return PolicyLossOutput(loss=loss, pg_loss=pg_loss.detach(), kl=kl.detach(), clip_fraction=clip_fraction, ratio_mean=ratio_mean,
                            weight_mean=weight_mean, capped_fraction=capped)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last axis."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -(logp.exp() * logp).sum(-1)
