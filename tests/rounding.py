"""How far two float32 computations of the same math may differ when their summation orders differ
(a call in pieces or in one pass, a tenant alone or sharing a pass, a cached prefix, a batch of
rows or one row, another CPU's kernels: AVX2, AVX-512, AMX, oneDNN). Tests compare with these
tolerances, which come from float32's rounding for the operation's size, never from what one
CPU happened to produce.

A float32 reduction of n terms (a sum, a dot product) lands within λ·√n·u·Σ|terms| of its exact
value, u = eps/2, with probability at least 1 − 2n·exp(−λ²/2) (Higham & Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1; the worst case,
n·u, needs every rounding to err the same way). Two orders of it are then within λ·√n·eps of each
other; λ = 6 leaves a chance below 1e-7·n per reduction. A pass's stages add their errors (to first
order). The tiny model's pass (2 layers, widths 64 and 128, a call's tokens ≤ 128) reduces twice
over its vocabulary (the forward's log-sum-exp, the backward's product with the unembedding) and,
per layer, nine times over ≤ 128 terms in the forward (two norms, q/k/v, the scores, their softmax,
the weighted sum, o, gate/up, down) and twice as often in the backward: 54 such stages, so
`PASS` = λ·(2·√49152 + 54·√128)·eps ≈ 7.5e-4 bounds the relative gap of its log-probabilities,
logits and gradients.

In bfloat16 the products accumulate in float32 but every stage's output is rounded to 8
significant bits: two orders can round a value one unit (2^-7 of it) apart at each stage, so
`BF16_FORWARD` (the forward's 18 stages and the head) and `BF16_PASS` (all 54 and both vocabulary
stages) bound a bfloat16 pass's relative gap.

Set OPENTINKER_ROUNDING_LOG to a file to have every comparison append its gap / tolerance there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

EPS32 = float(torch.finfo(torch.float32).eps)  # 1.19e-7
LAMBDA = 6.0
VOCAB = 49152  # tiny-random's (SmolLM2's tokenizer)


def order_gap(n: int) -> float:
    """The relative gap two float32 orders of one n-term reduction may show: λ·√n·eps."""
    return LAMBDA * math.sqrt(n) * EPS32


PER_LAYER = 9  # reductions in a decoder layer's forward (see above)


def pass_gap(layers: int, width: int, vocab: int = VOCAB) -> float:
    """The relative gap of a pass of a model of `layers` layers whose reductions run over at most
    `width` terms: two stages over the vocabulary, and 9 per layer in the forward and twice that in
    the backward (the inputs' and the weights' gradients), λ·√n·eps each."""
    return LAMBDA * (2 * math.sqrt(vocab) + 3 * PER_LAYER * layers * math.sqrt(width)) * EPS32


LAYERS, WIDTH = 2, 128  # the tiny model
FORWARD_STAGES = LAYERS * PER_LAYER
PASS_STAGES = 3 * FORWARD_STAGES
PASS = pass_gap(LAYERS, WIDTH)  # 7.5e-4
# |log p| of the tiny model's tokens: log V ± 2·max|logit|, and a logit is at most the RMS-normed
# hidden state (norm √64 = 8) times a head row (64 weights of std 0.02: norm ≤ 0.25), ≤ 2
TINY_LOGPROB = math.log(VOCAB) + 2 * 2.0
BF16_ULP = 2.0 ** -7
BF16_FORWARD = (FORWARD_STAGES + 1) * BF16_ULP  # 0.15
BF16_PASS = (PASS_STAGES + 2) * BF16_ULP  # 0.44


def _max_abs(x) -> float:
    array = x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    return float(np.abs(array).max()) if array.size else 0.0


def _gap(got, want) -> float:
    as64 = (lambda x: x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64))
    return _max_abs(as64(got) - as64(want))


def _log(ratio: float) -> None:
    if path := os.environ.get("OPENTINKER_ROUNDING_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as log:
            log.write(f"{test}\t{ratio:.4g}\n")


def within(got, want, tolerance: float) -> bool:
    """max|got − want| ≤ tolerance (logged as a ratio where OPENTINKER_ROUNDING_LOG says)."""
    gap = _gap(got, want)
    _log(gap / tolerance if tolerance else (0.0 if gap == 0 else math.inf))
    return gap <= tolerance


def same_grad(got, want, rel: float = PASS) -> bool:
    """Gradients (or anything else linear in them) of one pass in two orders: within rel of the
    tensor's largest magnitude; both None counts as the same."""
    if got is None or want is None:
        return got is None and want is None
    return within(got, want, rel * _max_abs(want))


def logprob_gap(logprobs, rel: float = PASS) -> float:
    """How far a pass's log-probabilities may move with the order: the log-sum-exp errs relative to
    1 (log S moves by dS/S), a logit relative to its magnitude, which the tiny model's log-probabilities
    (near −log 49152, its logits small) bound: rel · (1 + the largest |logprob|)."""
    return rel * (1.0 + _max_abs(logprobs))


def same_logprobs(got, want, rel: float = PASS) -> bool:
    return within(got, want, logprob_gap(want, rel))


def same_metric(got: float, want: float, sensitivity: float, lp_gap: float) -> bool:
    """A metric of a pass's log-probabilities (a loss summed over tokens, a mean ratio) in two orders:
    it moves by at most Σ_t |∂metric/∂logprob_t| (`sensitivity`) times the log-probabilities' gap."""
    return within(got, want, sensitivity * lp_gap)


def call_sensitivity(data, outputs) -> float:
    """Σ_t |∂metric/∂logprob_t| for a Tinker call's metrics (`loss:sum`, `ratio:mean`): each token's
    term is its weight or advantage times its logprob or its ratio r = exp(logprob − sampled), so
    at most (1 + Σ|weights or advantages|) · max(1, r)."""
    coefficients, ratio = 1.0, 1.0
    for datum, out in zip(data, outputs):
        inputs = datum.inputs
        c = inputs.get("weights", inputs.get("advantages"))
        coefficients += float(np.abs(np.asarray(c, dtype=np.float64)).sum()) if c is not None else 0.0
        if "logprobs" in inputs:
            r = np.exp(np.asarray(out["logprobs"], dtype=np.float64) - np.asarray(inputs["logprobs"], dtype=np.float64))
            ratio = max(ratio, float(r.max()) if r.size else 1.0)
    return coefficients * ratio


def same_call_metrics(got: dict, want: dict, data, outputs) -> bool:
    """A Tinker call's metrics in two orders of one pass (see same_metric)."""
    gap = logprob_gap([x for out in outputs for x in np.ravel(out["logprobs"])])
    return got.keys() == want.keys() and all(same_metric(got[k], want[k], call_sensitivity(data, outputs), gap) for k in want)


@dataclass
class UpdateBounds:
    """What bounds an RL update's rounding, taken from its trainer before the update: the gradient
    of the step (per parameter name), the gap of its log-probabilities, and each sampled token's
    ratio exp(logprob − sampled)."""

    grads: dict[str, torch.Tensor]
    lp_gap: float
    ratios: list[float]


def update_bounds(trainer, trajs) -> UpdateBounds:
    """UpdateBounds of `trainer.update(trajs)`, leaving the trainer as it was (gradients cleared)."""
    usable = [t for t in trajs if not t.failed and t.num_sampled > 0]
    trainer.compute_gradients(usable)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad and p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    lps = trainer.logprobs(usable)
    sampled = [[lp for lp, m in zip(t.sampling_logprobs, t.loss_mask) if m] for t in usable]
    ratios = [math.exp(a - b) for row, made in zip(lps, sampled) for a, b in zip(row, made)]
    return UpdateBounds(grads, logprob_gap([x for row in lps for x in row]), ratios)


def same_update_metrics(got: dict, want: dict, bounds: UpdateBounds, clip: float = 0.2) -> bool:
    """An RL update's metrics in two orders of its passes. Each is a mean over positions (token- or
    sequence-weighted: weights summing to 1) of a term whose derivative in its position's
    log-probability is at most: r·|A| for the clipped policy loss (|A| ≤ 2: the tests' rewards lie
    in [0, 1.3], so GRPO's z-scores of 4 samples ≤ 1.5 and RLOO's differences ≤ 1.3), r for the
    ratio, |e^d − 1| for k3's KL (d = ref − logprob: ≤ 1 where d < 0, and where d > 0 the position's
    k3 ≥ d²/2 is at most `tokens` times the mean), and 2H ≤ 2·log V summed over the vocabulary for
    the entropy. The clipped fraction counts positions: those whose ratio lies within rounding of
    a clip bound may flip, each 1/tokens."""
    r_max, tokens = max(bounds.ratios, default=1.0), max(want.get("update/tokens", 1.0), 1.0)
    d_max = math.sqrt(2 * tokens * max(want.get("update/kl", 0.0), 0.0))
    sensitivity = {"update/policy_loss": 2 * r_max, "update/ratio_mean": r_max,
                   "update/kl": max(1.0, math.expm1(d_max)), "update/entropy": 2 * math.log(VOCAB)}
    same = all(same_metric(got[k], want[k], s, bounds.lp_gap) for k, s in sensitivity.items() if k in want)
    clipped = "update/clip_fraction"
    if clipped not in want:
        return same
    edge = sum(any(abs(r - b) <= 2 * bounds.lp_gap * r for b in (1 - clip, 1 + clip)) for r in bounds.ratios)
    return same and within(got[clipped], want[clipped], edge / tokens + PASS * abs(want[clipped]))


def same_adam_step(got: torch.Tensor, want: torch.Tensor, grad: torch.Tensor, lr: float, rel: float = PASS) -> bool:
    """Weights after one AdamW step from the same weights, their gradients `grad` within rel of the
    tensor's largest in the two orders: the first step moves a weight by lr·ĝ/(|ĝ| + eps) (ĝ the
    clipped gradient, the decay alike), which moves by at most lr·δĝ/|ĝ| and never by more than 2·lr;
    δĝ/|ĝ| ≤ 2·rel·max|g|/|g| (the gradient's gap and the clipping factor's, a norm within rel), plus
    a few roundings of the weight. Near-zero gradients thus may move their weights by up to 2·lr."""
    g = grad.detach().double().abs()
    gap = (got.detach().double() - want.detach().double()).abs()
    moved = torch.where(g > 0, 2 * rel * g.max() / g.clamp(min=1e-300), torch.full_like(g, 2.0)).clamp(max=2.0)
    tolerance = lr * moved + 4 * EPS32 * (want.detach().double().abs() + lr)
    ratio = float((gap / tolerance).max()) if gap.numel() else 0.0
    _log(ratio)
    return ratio <= 1.0
