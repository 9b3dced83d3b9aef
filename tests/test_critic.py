"""The critic of `algorithm.advantage: gae` (opentinker/algo/gae.py, opentinker/backend/critic.py):
GAE and PPO's clipped value loss against hand-computed values, the critic's values converging to a
toy task's known ones, and a job that trains with it resuming it exactly from its checkpoint."""

from __future__ import annotations

import pytest
import torch

from opentinker.algo.gae import clipped_value_loss, gae, whiten
from opentinker.backend.critic import CRITIC_FILE, job_critic
from opentinker.backend.device import placement
from opentinker.core.spec_limits import SpecError
from opentinker.core.trajectory import Trajectory
from opentinker.rl import RLJob
from tests.conftest import tiny_spec


def test_gae_matches_the_hand_computation():
    # rewards [0, 0, 1], values [0.5, 0.6, 0.8], gamma 0.9, lambda 0.8, V after the last turn 0:
    # delta = [0 + 0.9 * 0.6 - 0.5, 0 + 0.9 * 0.8 - 0.6, 1 - 0.8] = [0.04, 0.12, 0.2]
    # A_2 = 0.2; A_1 = 0.12 + 0.72 * 0.2 = 0.264; A_0 = 0.04 + 0.72 * 0.264 = 0.23008; G = A + V
    advantages, returns = gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.8], gamma=0.9, lam=0.8)
    assert advantages == pytest.approx([0.23008, 0.264, 0.2], abs=1e-12)
    assert returns == pytest.approx([0.73008, 0.864, 1.0], abs=1e-12)
    # lambda 1: the discounted return minus the value; lambda 0: the one-step temporal difference
    assert gae([1.0, 2.0], [0.5, 0.25], 0.5, 1.0)[0] == pytest.approx([1 + 0.5 * 2 - 0.5, 2 - 0.25])
    assert gae([1.0, 2.0], [0.5, 0.25], 0.5, 0.0)[0] == pytest.approx([1 + 0.5 * 0.25 - 0.5, 2 - 0.25])
    with pytest.raises(ValueError, match="2 rewards for 1 values"):
        gae([1.0, 2.0], [0.5], 1.0, 1.0)


def test_the_value_loss_is_the_worse_of_clipped_and_unclipped():
    values, old, returns = torch.tensor([1.0, 0.6, 0.45]), torch.tensor([0.5, 0.5, 0.5]), torch.tensor([2.0, 0.0, 0.5])
    # 1: unclipped (1 - 2)^2 = 1, clipped to 0.7: (0.7 - 2)^2 = 1.69 -> 0.845
    # 2: unclipped 0.36, clipped 0.6 (within 0.2): 0.36 -> 0.18; 3: 0.0025 both -> 0.00125
    assert clipped_value_loss(values, old, returns, clip=0.2).tolist() == pytest.approx([0.845, 0.18, 0.00125])
    assert whiten(torch.tensor([1.0, 3.0])).tolist() == pytest.approx([-2 ** -0.5, 2 ** -0.5], abs=1e-6)
    assert whiten(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]


def _episode(prompt: list[int], rewards: list[float], group: int = 0) -> Trajectory:
    t = Trajectory(prompt_ids=prompt, group_id=group)
    for k, r in enumerate(rewards):
        t.append_sampled([40 + k, 50 + k], [-0.5, -0.5], f"a{k}")
        t.turns[-1].reward = r
        t.append_observation([60 + k], f"o{k}")
    return t


def _critic(tmp_path, **algorithm):
    spec = tiny_spec(tmp_path, algorithm={"advantage": "gae", **algorithm}, optimization={"micro_batch_size": 8})
    torch.manual_seed(0)
    return job_critic(spec, placement(0, "float32"))


def test_a_fresh_critic_values_every_state_at_zero_so_its_advantages_are_the_discounted_rewards(tmp_path):
    critic = _critic(tmp_path, gamma=0.5, gae_lambda=1.0, normalize_std=False)
    samples, advantages = critic.credit([_episode([1, 2], [1.0, 0.0, 2.0]), _episode([3], [0.0, 1.0])])
    # V = 0 everywhere: A_t = sum_k gamma^k r_{t+k}: [1 + 0.5 * 0 + 0.25 * 2, 0 + 0.5 * 2, 2], [0 + 0.5 * 1, 1]
    assert advantages.tolist() == pytest.approx([1.5, 1.0, 2.0, 0.5, 1.0])
    assert [p.prompt_ids for p in samples] == [[1, 2], [1, 2, 40, 50, 60], [1, 2, 40, 50, 60, 41, 51, 61], [3], [3, 40, 50, 60]]


def test_the_critic_learns_a_toy_tasks_known_values(tmp_path):
    """Two kinds of episode, each always the same: from prompt A the second turn earns 1 (V = 1 at both
    of its states, gamma 1), from prompt B nothing does (V = 0). Fitted on them, the critic's values
    converge to those."""
    critic = _critic(tmp_path, gae_lambda=1.0, critic_lr=3e-2, critic_epochs=4)
    batch = [_episode([5, 6, 7], [0.0, 1.0]), _episode([20, 21], [0.0, 0.0])] * 2
    states = [[5, 6, 7], [5, 6, 7, 40, 50, 60], [20, 21], [20, 21, 40, 50, 60]]
    losses = []
    for _ in range(15):
        critic.credit(batch)
        losses.append(critic.fit()["critic/value_loss"])
    with torch.no_grad():
        values = critic.values(states).tolist()
    assert values == pytest.approx([1.0, 1.0, 0.0, 0.0], abs=0.1), values
    assert losses[-1] < 0.05 * losses[0]
    critic.credit(batch)
    assert critic.fit()["critic/explained_variance"] > 0.9


def test_a_job_trains_with_its_critic_and_resumes_it_exactly(tmp_path):
    def spec(steps):
        return tiny_spec(tmp_path, algorithm={"advantage": "gae", "critic_lr": 1e-2}, optimization={"steps": steps}, checkpoint={"every": 1})

    straight = RLJob(spec(3), job_id="critic-straight")
    result = straight.run()
    assert {"critic/value_loss", "critic/explained_variance"} <= set(result.history[-1])
    first = RLJob(spec(2), job_id="critic-resumed")
    first.run()
    del first
    second = RLJob(spec(3), job_id="critic-resumed")
    assert second.run().resumed_from == 2
    a, b = (dict(j.policy.trainer.critic._trained()) for j in (straight, second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a, opt_b = (j.policy.trainer.critic.optimizer.state_dict()["state"] for j in (straight, second))
    assert all(torch.equal(opt_a[i]["exp_avg_sq"], opt_b[i]["exp_avg_sq"]) for i in opt_a)
    from opentinker.storage.checkpoint import read_file

    assert read_file(result.checkpoint.url, CRITIC_FILE, owner=straight.policy.owner)  # in the signed manifest


def test_gae_where_no_critic_can_train_fails_the_spec(tmp_path):
    with pytest.raises(SpecError, match=r"algorithm\.advantage: 'gae' trains a critic beside one text model's policy"):
        tiny_spec(tmp_path, algorithm={"advantage": "gae"}, resources={"trainer_ranks": 2})
