"""Per-step GRPO (opentinker.algo.turn_credit) against hand-computed advantages: turn returns
R_t = r_t + gamma R_{t+1}, normalised by the group's whole returns R_0; plain GRPO where a group is
scored only at the end; centred only where the whole returns are all equal."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.algo import grpo_advantages
from opentinker.algo.turn_credit import grpo_per_step
from opentinker.core.trajectory import Trajectory


def episode(rewards: list[float], group: int = 0, failed: bool = False) -> Trajectory:
    """A record of one turn per reward: prompt [1], each turn samples two tokens then sees one."""
    t = Trajectory(prompt_ids=[1], group_id=group, failed=failed)
    for k, r in enumerate(rewards):
        t.append_sampled([10 + k, 20 + k], [-0.1 * (k + 1), -0.2 * (k + 1)], f"a{k}")
        t.turns[-1].reward = r
        t.append_observation([2], f"o{k}")
    return t


def test_scored_turns_earn_their_discounted_return_against_the_groups_whole_returns():
    # group 0: E1 scores [1, 0, 2], E2 [0, 1]; gamma 0.5
    # E1: R = [1 + 0.5 (0 + 0.5 * 2), 0 + 0.5 * 2, 2] = [1.5, 1, 2]; E2: R = [0 + 0.5 * 1, 1] = [0.5, 1]
    # R_0 = [1.5, 0.5]: mean 1, unbiased std sqrt(0.25 + 0.25) = sqrt(0.5)
    samples, adv = grpo_per_step([episode([1, 0, 2]), episode([0, 1])], gamma=0.5)
    s = math.sqrt(0.5) + 1e-6
    assert adv.tolist() == pytest.approx([0.5 / s, 0.0, 1.0 / s, -0.5 / s, 0.0 / s], abs=1e-6)
    assert [p.reward for p in samples] == [1.5, 1.0, 2.0, 0.5, 1.0]
    # each sample trains its own turn's tokens only, with their sampling logprobs; earlier turns are context
    assert [[t for t, m in zip(p.token_ids, p.loss_mask) if m] for p in samples] == [[10, 20], [11, 21], [12, 22], [10, 20], [11, 21]]
    assert samples[2].token_ids == [1, 10, 20, 2, 11, 21, 2, 12, 22]
    assert samples[2].sampling_logprobs[-2:] == pytest.approx([-0.3, -0.6])

    centred, adv = grpo_per_step([episode([1, 0, 2]), episode([0, 1])], gamma=0.5, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.5, 0.0, 1.0, -0.5, 0.0])


def test_a_group_scored_only_at_the_end_is_plain_grpo_whatever_gamma():
    trajs = [episode([0, 0, 1], group=3), episode([0, 0], group=3), episode([0, 1], group=3)]
    samples, adv = grpo_per_step(trajs, gamma=0.5)
    episode_adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3, 3, 3]))
    assert adv.tolist() == pytest.approx([episode_adv[0].item()] * 3 + [episode_adv[1].item()] * 2 + [episode_adv[2].item()] * 2)
    assert len(samples) == 7


def test_groups_are_apart_equal_whole_returns_are_centred_and_a_failed_episode_is_one_sample():
    # group 0: E1 [1, 0] -> R [1, 0], E2 [0, 1] -> R [1, 1] (gamma 1): R_0 all 1, std 0: centred only
    # group 1: a failed episode (return 0, one sample) and E4 [2, 0] -> R [2, 0]: R_0 [0, 2], mean 1, std sqrt(2)
    trajs = [episode([1, 0]), episode([0, 1], group=1, failed=True), episode([0, 1]), episode([2, 0], group=1)]
    samples, adv = grpo_per_step(trajs, gamma=1.0)
    s = math.sqrt(2) + 1e-6
    assert adv.tolist() == pytest.approx([0.0, -1.0, -1 / s, 0.0, 0.0, 1 / s, -1 / s], abs=1e-6)
    assert samples[2] is trajs[1]  # the failed record, whole
    assert sum(p.num_sampled for p in samples) == sum(t.num_sampled for t in trajs)


def test_the_trainer_trains_each_turn_with_its_advantage(tiny):
    """Scored only at the end, per-step GRPO is GRPO: the trainer's gradient over the turns as samples
    of their own (each with its earlier turns as context) equals plain GRPO's over the whole records
    (token-mean: the same tokens, each once)."""
    import copy

    from opentinker.backend import PolicyTrainer
    from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec
    from tests.rounding import same_grad
    from tests.test_shared_prefix import multi_turn

    model, tok = tiny
    trainers = [PolicyTrainer(copy.deepcopy(model), tok, LoraSpec(r=4, alpha=8), AlgorithmSpec(advantage=kind, gamma=0.5),
                              OptimizationSpec(lr=1e-3, micro_batch_size=8)) for kind in ("grpo_per_step", "grpo")]
    gen = torch.Generator().manual_seed(0)  # a LoRA B that is not zero: every adapter weight has a gradient
    state = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in trainers[0].trainable_state().items()}
    for trainer in trainers:
        trainer.load_trainable_state(state)

    def gradients(trainer, trajs):
        trainer.model.zero_grad(set_to_none=True)
        metrics = trainer.compute_gradients(trajs)
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}, metrics

    outcome_only = multi_turn()
    for i, t in enumerate(outcome_only):
        for turn in t.turns:
            turn.reward = 0.0
        t.turns[-1].reward = float(i % 2)
    (per_step, m_step), (whole, m_whole) = gradients(trainers[0], outcome_only), gradients(trainers[1], outcome_only)
    assert per_step.keys() == whole.keys() and any(float(g.abs().max()) > 0 for g in whole.values())
    assert all(same_grad(per_step[k], whole[k]) for k in whole), [k for k in whole if not same_grad(per_step[k], whole[k])]
    assert m_step["update/positions_trained"] == m_whole["update/positions_trained"] == sum(t.num_sampled for t in outcome_only)


def with_states(rewards: list[float], states: list[str | None], group: int = 0) -> Trajectory:
    t = episode(rewards, group)
    for turn, state in zip(t.turns, states):
        turn.state = state
    return t


def test_gigpo_adds_the_step_groups_advantage_to_the_episodes():
    from opentinker.algo.turn_credit import gigpo

    # gamma 1. E1 [0, 1] via A; E2 [0, 0] via A; E3 [0, 0, 1] via B then A.
    # episode returns [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3): A_E = [1, -2, 1] / sqrt(3)
    # step group A: (E1 t1, R 1), (E2 t1, R 0), (E3 t2, R 1): the same values, so [1, -2, 1] / sqrt(3); B: E3 t1 alone: 0
    trajs = [with_states([0, 1], ["A", None]), with_states([0, 0], ["A", None]), with_states([0, 0, 1], ["B", "A", None])]
    samples, adv = gigpo(trajs, gamma=1.0, step_weight=0.5)
    u = 1 / math.sqrt(3)
    assert adv.tolist() == pytest.approx([u, u + 0.5 * u, -2 * u, -2 * u - 0.5 * 2 * u, u, u, u + 0.5 * u], abs=1e-5)
    assert len(samples) == 7 and samples[1].turns[0].state is None and samples[0].turns[0].state == "A"


def test_gigpo_anchors_on_the_observation_when_the_game_names_no_state_and_is_grpo_where_none_repeat():
    from opentinker.algo.turn_credit import gigpo

    # no names: episode() shows "o0" after every first turn, so all second turns act from one state
    # returns: E1 [0+1, 1] = [1, 1], E2 [0, 0]: step group of the second turns [1, 0] -> [1, -1] / sqrt(2)
    samples, adv = gigpo([episode([0, 1]), episode([0, 0])], gamma=1.0, step_weight=1.0)
    v = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([v, 2 * v, -v, -2 * v], abs=1e-5)

    distinct = [with_states([0, 1], ["x", None]), with_states([0, 0], ["y", None]), with_states([1, 0, 0], ["z", "w", None])]
    _, adv = gigpo(distinct, gamma=0.9)
    episode_adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 0]))
    assert adv.tolist() == pytest.approx([episode_adv[0].item()] * 2 + [episode_adv[1].item()] * 2 + [episode_adv[2].item()] * 3, abs=1e-6)


def test_the_loop_keeps_the_state_a_game_names_on_its_turn(tiny):
    from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams
    from opentinker.env.base import StepResult
    from tests.games import ScriptedTurns

    class Named(ScriptedTurns):
        def step(self, action):
            result = super().step(action)
            return StepResult(result.observation, result.reward, result.done, {"state": f"square {self.k % 2}"})

    model, tok = tiny
    trajs = run_episodes(HFRolloutEngine(model, tok), ChatFormat(tok), [Named(turns=3), ScriptedTurns(turns=2)], [{}, {}],
                         SamplingParams(max_new_tokens=3), EpisodeLimits(max_turns=3), [0, 0])
    assert [t.state for t in trajs[0].turns] == ["square 1", "square 0", "square 1"] and "state" not in trajs[0].info  # the turn's
    assert [t.state for t in trajs[1].turns] == [None, None] and trajs[1].turns[0].observation == "observation 1"
