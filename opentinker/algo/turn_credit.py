"""Per-turn credit for multi-turn episodes (`algorithm.advantage: grpo_per_step`), for every job.

A game that scores each turn (`StepResult.reward`, kept per turn in the record) says which turn
helped; the outcome-only estimators put the episode's return on its last token. Per-step GRPO, as
the reference design ships it:

- each turn t of an episode earns its return from there on, R_t = r_t + gamma * R_{t+1};
- the advantage of turn t is (R_t - mean(R_0)) / (std(R_0) + eps), the mean and (unbiased) std
  of the episodes' whole returns R_0 within the prompt's group, on that turn's tokens only;
- a group where no episode scores any turn but its last (an outcome reward only) is plain GRPO:
  every turn of an episode gets its episode's advantage, undiscounted;
- a group whose whole returns are all equal is centred only (a std of 0 divides nothing): its turns'
  differences are the signal left, where GRPO would have none.

GiGPO (`algorithm.advantage: gigpo`, Feng et al. 2025) adds a step-level advantage where a group's
episodes pass through the same state: the turns that act from one state (an anchor: the state the
turn before led to, as the game names it in `info["state"]`, else its observation text) form a step
group, and each gets (R_t - mean) / (std + eps) of its step group's returns, weighted by
`step_weight`, beside its episode's GRPO advantage (R_0 against the group's). The first turn's state
is the task's, shared by the whole group by construction, so it anchors no step group (it would
repeat the episode's advantage); a turn alone in its step group adds nothing, and where states never
repeat GiGPO is GRPO.

Each turn is trained as a sample of its own (`Trajectory.split_by_turn`: the turns before it are
context, so every sampled token is trained once, with its sampling logprob). A failed episode is
one sample with return 0.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from opentinker.algo.advantages import compute_advantages, grpo_advantages
from opentinker.core.trajectory import Trajectory


def credit(trajs: list[Trajectory], algorithm, critic=None) -> tuple[list[Trajectory], torch.Tensor]:
    """The samples an update trains and the advantage of each, as `algorithm` (the spec's) says:
    the whole records for grpo and rloo, a sample per turn for grpo_per_step, gigpo and gae (whose
    `critic`, opentinker.backend.critic, values the turns)."""
    a = algorithm
    if a.advantage == "gae":
        if critic is None:
            raise ValueError("algorithm.advantage: 'gae' needs a critic, and this trainer has none")
        return critic.credit(trajs)
    if a.advantage == "grpo_per_step":
        return grpo_per_step(trajs, a.gamma, a.normalize_std)
    if a.advantage == "gigpo":
        return gigpo(trajs, a.gamma, a.normalize_std, a.step_weight)
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    return trajs, compute_advantages(a.advantage, rewards, torch.tensor([t.group_id for t in trajs]), a.normalize_std)


def _scores_turns(trajs: list[Trajectory]) -> bool:
    """Does any episode of the group score a turn before its last one?"""
    return any(turn.reward != 0 for t in trajs if not t.failed for turn in t.turns[:-1])


def grpo_per_step(trajs: list[Trajectory], gamma: float = 1.0, normalize_std: bool = True,
                  eps: float = 1e-6) -> tuple[list[Trajectory], torch.Tensor]:
    """(one sample per turn, in the records' order; the advantage of each) for `trajs`, whose
    `group_id` names the prompt's group (see the module)."""
    members: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        members[t.group_id].append(i)
    pieces: list[list[Trajectory]] = [[]] * len(trajs)
    baseline: dict[int, tuple[float, float]] = {}
    for group, indices in members.items():
        group_trajs = [trajs[i] for i in indices]
        discount = gamma if _scores_turns(group_trajs) else 1.0
        for i in indices:
            pieces[i] = trajs[i].split_by_turn(discount)  # each piece's reward is its return R_t
        whole = torch.tensor([pieces[i][0].reward for i in indices], dtype=torch.float64)  # R_0
        std = float(whole.std(unbiased=True)) if len(indices) > 1 else 0.0
        baseline[group] = (float(whole.mean()), std + eps if normalize_std and std > 0 else 1.0)
    samples, advantages = [], []
    for t, own in zip(trajs, pieces):
        mean, scale = baseline[t.group_id]
        for piece in own:
            samples.append(piece)
            advantages.append((piece.reward - mean) / scale)
    return samples, torch.tensor(advantages, dtype=torch.float32)



def gigpo(trajs: list[Trajectory], gamma: float = 1.0, normalize_std: bool = True, step_weight: float = 1.0,
          eps: float = 1e-6) -> tuple[list[Trajectory], torch.Tensor]:
    """(one sample per turn, in the records' order; the advantage of each): the episode's GRPO
    advantage plus `step_weight` times the turn's within its step group (see the module). Both are
    GRPO (algo.advantages): over the prompt's groups, then over step groups as groups of their own."""
    pieces = [t.split_by_turn(gamma) for t in trajs]
    episode_adv = grpo_advantages(torch.tensor([t.reward for t in trajs], dtype=torch.float64),
                                  torch.tensor([t.group_id for t in trajs]), normalize_std, eps)
    anchors: dict[tuple[int, str], int] = {}  # (prompt's group, state) -> step group id
    anchored, step_groups = [], []  # (record, turn) acting from a state, and its step group
    for i, t in enumerate(trajs):
        for k in range(1, 0 if t.failed else len(t.turns)):
            before = t.turns[k - 1]
            state = before.state if before.state is not None else (before.observation or "")
            anchored.append((i, k))
            step_groups.append(anchors.setdefault((t.group_id, state), len(anchors)))
    step_adv = [[0.0] * len(own) for own in pieces]  # a turn alone in its step group gets 0 from GRPO too
    if anchored:
        returns = torch.tensor([pieces[i][k].reward for i, k in anchored], dtype=torch.float64)
        for (i, k), a in zip(anchored, grpo_advantages(returns, torch.tensor(step_groups), normalize_std, eps).tolist()):
            step_adv[i][k] = a
    advantages = [float(episode_adv[i]) + step_weight * step_adv[i][k] for i, own in enumerate(pieces) for k in range(len(own))]
    return [p for own in pieces for p in own], torch.tensor(advantages, dtype=torch.float32)
