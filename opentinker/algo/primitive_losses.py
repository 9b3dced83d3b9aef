"""The token-level losses of the Tinker API, over datums padded to [B, T] with a mask of real positions.

Position t of a datum predicts `target_tokens[t]`; `lp` is the learner's log p(target) there (with
gradient), `q` the sampler's (`loss_fn_inputs["logprobs"]`), `A` the advantages and `r = exp(lp − q)`.
Every loss is a **sum** over tokens and datums (no mean), as Tinker defines them; KL, if wanted,
goes into the advantages on the client's side.

    cross_entropy        −Σ w·lp                                   (w: any real weights; with soft targets
                         [N, K], lp and w are [N, K]: −Σ_t Σ_k w[t,k]·log p(target[t,k]))
    importance_sampling  −Σ r·A
    ppo                  −Σ min(r·A, clip(r, lo, hi)·A)            (lo, hi: ratio bounds, 0.8 / 1.2)
    cispo                −Σ sg(clip(r, lo, hi))·lp·A               (sg: no gradient; 0.8 / 1.2)
    dro                  −Σ (lp·A − ½·β·(lp − q)²)                 (β: `beta`, 0.05)
    gspo                 per datum s = exp(Σ m·(lp − q) / Σ m), m its `sequence_ratio_mask` (default: the
                         positions with a nonzero advantage); −Σ min(s·A, clip(s, lo, hi)·A) over its
                         positions (the GSPO paper's sequence ratio, summed over the tokens like the
                         others; lo, hi default to the paper's 1 − 3e-4 and 1 + 4e-4)

`stable_reinforce` is not publicly specified and is refused (UnsupportedLoss names the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# loss -> (the inputs it needs besides target_tokens, its config keys with their defaults)
LOSSES: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "cross_entropy": (("weights",), {}),
    "importance_sampling": (("logprobs", "advantages"), {}),
    "ppo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": (("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "dro": (("logprobs", "advantages"), {"beta": 0.05}),
    "gspo": (("logprobs", "advantages"), {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}),
}
SUPPORTED = ", ".join(LOSSES)


class UnsupportedLoss(ValueError):
    """A loss name or config this server does not take; the message says what it does take."""


def loss_config(name: str, given: dict[str, float]) -> dict[str, float]:
    """The loss's config: its defaults overridden by `given`; unknown names or keys are refused."""
    if name not in LOSSES:
        raise UnsupportedLoss(f"loss_fn {name!r} is not supported here; supported: {SUPPORTED}")
    defaults = LOSSES[name][1]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise UnsupportedLoss(f"loss_fn_config for {name}: unknown key(s) {', '.join(unknown)} (allowed: {allowed})")
    try:
        config = {**defaults, **{k: float(v) for k, v in given.items()}}
    except (TypeError, ValueError):
        raise UnsupportedLoss(f"loss_fn_config for {name}: values must be numbers") from None
    if any(not math.isfinite(v) for v in config.values()) or config.get("beta", 0) < 0:
        raise UnsupportedLoss(f"loss_fn_config for {name}: values must be finite numbers (beta >= 0)")
    if config.get("clip_low_threshold", 0) > config.get("clip_high_threshold", math.inf):
        raise UnsupportedLoss(f"loss_fn_config for {name}: clip_low_threshold above clip_high_threshold")
    return config


@dataclass
class LossOut:
    loss: torch.Tensor  # the scalar to backpropagate
    metrics: dict[str, float]  # keys `name:reduction`, as the SDK combines them across chunks


def primitive_loss(name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor,
                   config: dict[str, float]) -> LossOut:
    """The loss `name` of a padded batch: `lp` [B, T] with gradient, `inputs` [B, T] each, `mask`
    [B, T] 1.0 on real positions; `config` from `loss_config`. With soft targets in the batch
    (opentinker.backend.primitives.padded) `lp` and `weights` are [B, T, K], a hard target in slot 0."""
    mask = mask.to(lp.dtype)
    if name == "cross_entropy":
        weights = inputs["weights"] if inputs["weights"].dim() == lp.dim() else inputs["weights"][..., None]
        loss = -(weights * lp * (mask[..., None] if lp.dim() == 3 else mask)).sum()
        return LossOut(loss, {"loss:sum": float(loss.detach())})
    if lp.dim() == 3:  # a shared pass beside another call's soft targets: this call's targets are in slot 0
        lp = lp[..., 0]
    q, adv = inputs["logprobs"], inputs["advantages"]
    log_ratio = lp - q
    ratio = torch.exp(log_ratio)
    lo, hi = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if name == "importance_sampling":
        per_token = -ratio * adv
    elif name == "ppo":
        per_token = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    elif name == "cispo":
        per_token = -torch.clamp(ratio, lo, hi).detach() * lp * adv
    elif name == "dro":
        per_token = -(lp * adv - 0.5 * config["beta"] * log_ratio**2)
    elif name == "gspo":
        ratio_mask = inputs.get("sequence_ratio_mask")
        tokens = mask * (ratio_mask.to(lp.dtype) if ratio_mask is not None else (adv != 0).to(lp.dtype))
        seq_ratio = torch.exp((log_ratio * tokens).sum(-1) / tokens.sum(-1).clamp(min=1))[:, None]
        per_token = -torch.minimum(seq_ratio * adv, torch.clamp(seq_ratio, lo, hi) * adv)
    else:  # loss_config refused it already
        raise UnsupportedLoss(f"loss_fn {name!r} is not supported here; supported: {SUPPORTED}")
    loss = (per_token * mask).sum()
    scored = mask * (adv != 0).to(lp.dtype)  # the sampled tokens (prompt positions carry no advantage)
    n = float(scored.sum().clamp(min=1))
    return LossOut(loss, {"loss:sum": float(loss.detach()), "ratio:mean": float((ratio.detach() * scored).sum()) / n})
