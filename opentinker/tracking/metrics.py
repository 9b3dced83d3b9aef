"""Batch statistics over trajectories: what a person watching a run needs to see.

Beside reward, every boolean or numeric `info` key an environment reports is averaged (e.g.
`correct`, `format_ok`), and the share of distinct `answer`s is reported, so that a policy
collapsing onto one answer in the right format (reward hacking a format bonus) is visible.
Tool-using games (`tool_calls`, `tool_errors` in info) also get `tool_call_rate` and
`tool_error_rate` (and `tool_valid_rate`, the share of calls that were well formed, with declared tools); move-based games (`illegal_moves`, `moves`) get `illegal_move_rate`.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

from opentinker.core.trajectory import Trajectory


def _info_means(trajs: list[Trajectory]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for t in trajs:
        for key, value in t.info.items():
            if isinstance(value, (bool, int, float)) and not isinstance(value, str):
                sums.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in sums.items()}


def failure_summary(trajs: list[Any]) -> str | None:
    """The most common failure reason and how many episodes it cost, e.g.
    `reset: RuntimeError: boom (8 of 8 episodes)`; None when no episode failed."""
    reasons = Counter(str(t.failure or "unknown failure") for t in trajs if t.failed)
    if not reasons:
        return None
    reason, count = reasons.most_common(1)[0]
    return f"{reason} ({count} of {len(trajs)} episodes)"


def truncation_summary(trajs: list[Any]) -> str | None:
    """Why episodes stopped at max_total_tokens (the most common reason, or the first) and how many,
    e.g. `the prompt is at least 12,040 tokens, over rollout.max_total_tokens 1,024 (truncated 8 of 8
    episodes)`; None when none was."""
    cut = [t for t in trajs if not t.failed and t.stop_reason == "max_total_tokens"]
    if not cut:
        return None
    reason = Counter(str(getattr(t, "truncation", None) or "the record reached rollout.max_total_tokens") for t in cut).most_common(1)[0][0]
    return f"{reason} (truncated {len(cut)} of {len(trajs)} episodes)"


def episode_stats(trajs: list[Trajectory], prefix: str) -> dict[str, Any]:
    """Metrics of a batch of episodes; `<prefix>/first_failure` (text, not a number) names the
    most common failure when there was one, and `<prefix>/first_truncation` why episodes were cut at
    max_total_tokens, so progress lines and the run can say why."""
    ok = [t for t in trajs if not t.failed]
    rewards = [t.reward for t in ok] or [0.0]
    out: dict[str, Any] = {
        f"{prefix}/episodes": float(len(trajs)),
        f"{prefix}/failed_episodes": float(len(trajs) - len(ok)),
        f"{prefix}/failure_rate": (len(trajs) - len(ok)) / len(trajs) if trajs else 0.0,
        f"{prefix}/truncated_episodes": float(sum(t.stop_reason == "max_total_tokens" for t in ok)),
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
    out |= _tool_stats(ok, prefix) | _move_stats(ok, prefix)
    if summary := failure_summary(trajs):
        out[f"{prefix}/first_failure"] = summary
    if summary := truncation_summary(trajs):
        out[f"{prefix}/first_truncation"] = summary
    return out


def _count(t: Trajectory, key: str) -> float:
    """A count an environment reported; anything not a finite number counts as 0."""
    value = t.info.get(key, 0)
    return float(value) if isinstance(value, (bool, int, float)) and math.isfinite(value) else 0.0


def _tool_stats(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """Tool use (games reporting `tool_calls`, optionally `tool_errors`): the share of episodes
    with at least one call, and the share of all calls that failed (0 when there were none)."""
    users = [t for t in trajs if "tool_calls" in t.info]
    if not users:
        return {}
    calls = sum(_count(t, "tool_calls") for t in users)
    errors = sum(_count(t, "tool_errors") for t in users)
    out = {
        f"{prefix}/tool_call_rate": sum(_count(t, "tool_calls") > 0 for t in users) / len(users),
        f"{prefix}/tool_error_rate": errors / calls if calls else 0.0,
    }
    if any("tool_invalid" in t.info for t in users):  # declared tools (opentinker/tools): calls that were well formed
        out[f"{prefix}/tool_valid_rate"] = 1.0 - sum(_count(t, "tool_invalid") for t in users) / calls if calls else 0.0
    return out


def _move_stats(trajs: list[Trajectory], prefix: str) -> dict[str, float]:
    """Games reporting `illegal_moves` and (legal) `moves`: the share of all move attempts that
    were illegal, Σ illegal / (Σ illegal + Σ moves) (0 when nothing was attempted)."""
    players = [t for t in trajs if "illegal_moves" in t.info and "moves" in t.info]
    if not players:
        return {}
    illegal = sum(_count(t, "illegal_moves") for t in players)
    attempts = illegal + sum(_count(t, "moves") for t in players)
    return {f"{prefix}/illegal_move_rate": illegal / attempts if attempts else 0.0}


def headline_key(metric_keys, name: str) -> str:
    """The key to show for `name` (e.g. "rollout/reward_mean"): itself, or for a self-play job
    an agent's (`O/rollout/reward_mean`, the first in sorted order)."""
    keys = sorted(metric_keys)
    return name if name in keys else next((k for k in keys if k.endswith("/" + name)), name)
