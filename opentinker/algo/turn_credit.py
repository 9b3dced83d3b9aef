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

Each turn is trained as a sample of its own (`Trajectory.split_by_turn`: the turns before it are
context, so every sampled token is trained once, with its sampling logprob). A failed episode is
one sample with return 0.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from opentinker.core.trajectory import Trajectory


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
