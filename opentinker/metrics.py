"""Batch statistics over trajectories: what a person watching a run needs to see.

Beside reward, every boolean or numeric `info` key an environment reports is averaged (e.g.
`correct`, `format_ok`), and the share of distinct `answer`s is reported, so that a policy
collapsing onto one answer in the right format (reward hacking a format bonus) is visible.
"""

from __future__ import annotations

import statistics
from typing import Any

from opentinker.trajectory import Trajectory


def _info_means(trajs: list[Trajectory]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for t in trajs:
        for key, value in t.info.items():
            if isinstance(value, (bool, int, float)) and not isinstance(value, str):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in sums.items()}


def episode_stats(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    ok = [t for t in trajs if not t.failed]
    rewards = [t.reward for t in ok] or [0.0]
    out = {
        f"{prefix}/episodes": float(len(trajs)),
        f"{prefix}/failed_episodes": float(len(trajs) - len(ok)),
        f"{prefix}/reward_mean": statistics.fmean(rewards),
        f"{prefix}/reward_std": statistics.pstdev(rewards),
        f"{prefix}/reward_min": min(rewards),
        f"{prefix}/reward_max": max(rewards),
        f"{prefix}/response_tokens_mean": statistics.fmean([t.num_sampled for t in ok]) if ok else 0.0,
        f"{prefix}/turns_mean": statistics.fmean([len(t.turns) for t in ok]) if ok else 0.0,
    }
    for key, mean in _info_means(ok).items():  # booleans become rates, e.g. rollout/format_ok
        if key not in ("answer", "expected"):
            out[f"{prefix}/{key}"] = mean
    answers = [t.info["answer"] for t in ok if "answer" in t.info]
    if answers:
        out[f"{prefix}/distinct_answer_share"] = len({repr(a) for a in answers}) / len(answers)
    if "correct" in {k for t in ok for k in t.info}:
        out[f"{prefix}/accuracy"] = sum(bool(t.info.get("correct")) for t in trajs) / max(len(trajs), 1)
    return out


def transcripts(trajs: list[Trajectory]) -> list[dict[str, Any]]:
    """Readable episodes (messages, reward, info) for artifacts and eyeballing."""
    return [
        {
            "task": t.task,
            "messages": t.messages,
            "reward": t.reward,
            "failed": t.failed,
            "failure": t.failure,
            "stop_reason": t.stop_reason,
            "info": t.info,
            "policy_version": t.policy_version,
        }
        for t in trajs
    ]
