"""Advantages and losses against values computed by hand."""

import math

import pytest
import torch

from opentinker.algo import aggregate, grpo_advantages, kl_estimate, ppo_clipped_loss, rloo_advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
GROUPS = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5])


def test_grpo_normalised():
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 5: mean 0.75, std 0.5
    s = 0.5 / math.sqrt(1 / 3)
    expected = [s, -s, -s, s, 0.5, 0.5, 0.5, -1.5]
    # the std's eps (1e-6 against stds ≥ 0.5) moves an advantage ≤ 1.5 by ≤ 3e-6; float32's few roundings far less
    assert grpo_advantages(REWARDS, GROUPS).tolist() == pytest.approx(expected, abs=1e-5)


def test_grpo_without_std():
    expected = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    assert grpo_advantages(REWARDS, GROUPS, normalize_std=False).tolist() == pytest.approx(expected)


def test_grpo_constant_group_has_no_signal():
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert adv[:2].tolist() == [0.0, 0.0]


def test_rloo():
    # r_i minus the mean of the other three in its group
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]
    assert rloo_advantages(REWARDS, GROUPS).tolist() == pytest.approx(expected)


def test_rloo_needs_two_per_group():
    with pytest.raises(ValueError):
        rloo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]))


def _ppo_case():
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 1.5, 1.0]])
    old = torch.log(torch.tensor([[0.2, 0.4, 0.3], [0.4, 0.2, 0.3]]))
    new = old + torch.log(ratios)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    return new, old, adv, mask


def test_ppo_clipped_token_mean():
    new, old, adv, mask = _ppo_case()
    out = ppo_clipped_loss(new, old, adv, mask, clip_range=0.2, aggregation="token-mean")
    # per token: -1.2 (clipped), -0.5, -1.0 | +0.8 (clipped), +1.5 ; mean over 5 tokens
    assert float(out.loss) == pytest.approx(-0.08, abs=1e-6)
    assert float(out.clip_fraction) == pytest.approx(0.4)


def test_ppo_clipped_seq_mean():
    new, old, adv, mask = _ppo_case()
    out = ppo_clipped_loss(new, old, adv, mask, clip_range=0.2, aggregation="seq-mean")
    # row 0: -2.7 / 3 = -0.9 ; row 1: 2.3 / 2 = 1.15 ; mean 0.125
    assert float(out.loss) == pytest.approx(0.125, abs=1e-6)


def test_ppo_gradient_is_policy_gradient_where_unclipped():
    new, old, adv, mask = _ppo_case()
    new = new.clone().requires_grad_(True)
    ppo_clipped_loss(new, old, adv, mask, aggregation="token-mean").loss.backward()
    # d/dlogp of -(ratio*A)/5 = -ratio*A/5 where unclipped; 0 where clipped or masked
    expected = torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [0.0, 1.5 / 5, 0.0]])
    assert torch.allclose(new.grad, expected, atol=1e-6)


def test_kl_estimators():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.25]))
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([math.log(2), 0.0])
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0])


def test_kl_penalty_added_to_loss():
    new, old, adv, mask = _ppo_case()
    ref = new - 0.1
    with_kl = ppo_clipped_loss(new, old, adv, mask, ref_logprobs=ref, kl_coef=0.5, kl_estimator="k1")
    assert float(with_kl.kl) == pytest.approx(0.1, abs=1e-6)
    assert float(with_kl.loss) == pytest.approx(-0.08 + 0.5 * 0.1, abs=1e-6)


def test_aggregate_normalizer_makes_micro_batches_add_up():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    whole = aggregate(x, mask, "token-mean")
    parts = aggregate(x[:1], mask[:1], "token-mean", normalizer=5) + aggregate(x[1:], mask[1:], "token-mean", normalizer=5)
    assert float(whole) == pytest.approx(float(parts)) == pytest.approx(3.0)
    whole = aggregate(x, mask, "seq-mean")
    parts = aggregate(x[:1], mask[:1], "seq-mean", normalizer=2) + aggregate(x[1:], mask[1:], "seq-mean", normalizer=2)
    assert float(whole) == pytest.approx(float(parts)) == pytest.approx((2.0 + 4.5) / 2)
