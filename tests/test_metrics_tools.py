"""episode_stats on tool-using and move-based games: tool_call_rate, tool_error_rate, illegal_move_rate."""

from __future__ import annotations

import pytest

from opentinker.tracking.metrics import episode_stats
from opentinker.core.trajectory import Trajectory, Turn


def _traj(reward: float = 0.0, failed: bool = False, **info) -> Trajectory:
    return Trajectory(prompt_ids=[1, 2], turns=[Turn(action="a", reward=reward)], info=dict(info), failed=failed)


def test_tool_rates_from_calls_and_errors():
    trajs = [
        _traj(1.0, correct=True, tool_calls=2, tool_errors=1, format_ok=True),
        _traj(0.0, correct=False, tool_calls=0, tool_errors=0, format_ok=True),
        _traj(1.0, correct=True, tool_calls=1, tool_errors=0, format_ok=True),
        _traj(0.0, correct=False, tool_calls=3, tool_errors=3, format_ok=False),
        _traj(failed=True, tool_calls=5, tool_errors=5),  # failed episodes are left out, as for other info keys
    ]
    m = episode_stats(trajs, "eval")
    assert m["eval/tool_call_rate"] == pytest.approx(3 / 4)
    assert m["eval/tool_error_rate"] == pytest.approx(4 / 6)  # Σ errors / Σ calls, not a mean of ratios
    # the existing keys are unchanged
    assert m["eval/tool_calls"] == pytest.approx(6 / 4)
    assert m["eval/tool_errors"] == pytest.approx(4 / 4)
    assert m["eval/format_ok"] == pytest.approx(3 / 4)
    assert m["eval/accuracy"] == pytest.approx(2 / 5)
    assert m["eval/reward_mean"] == pytest.approx(0.5)
    assert "eval/illegal_move_rate" not in m


def test_tool_error_rate_is_zero_without_calls():
    m = episode_stats([_traj(tool_calls=0, tool_errors=0), _traj(tool_calls=0)], "rollout")
    assert m["rollout/tool_call_rate"] == 0.0
    assert m["rollout/tool_error_rate"] == 0.0


def test_illegal_move_rate_over_all_attempts():
    trajs = [
        _traj(1.0, illegal_moves=1, moves=4, result="win", correct=True, game_length=8),
        _traj(-1.0, illegal_moves=3, moves=0, result="loss", correct=False, game_length=0),
        _traj(0.0, illegal_moves=0, moves=6, result="draw", correct=False, game_length=12),
    ]
    m = episode_stats(trajs, "eval")
    assert m["eval/illegal_move_rate"] == pytest.approx(4 / (4 + 10))
    assert m["eval/illegal_moves"] == pytest.approx(4 / 3)
    assert m["eval/moves"] == pytest.approx(10 / 3)
    assert m["eval/game_length"] == pytest.approx(20 / 3)
    assert m["eval/accuracy"] == pytest.approx(1 / 3)
    assert "eval/tool_call_rate" not in m and "eval/tool_error_rate" not in m


def test_illegal_move_rate_needs_both_keys_and_handles_no_attempts():
    only_illegal = episode_stats([_traj(illegal_moves=2)], "x")  # e.g. self-play records without `moves`
    assert "x/illegal_move_rate" not in only_illegal
    assert episode_stats([_traj(illegal_moves=0, moves=0)], "x")["x/illegal_move_rate"] == 0.0


def test_games_without_these_keys_get_no_new_metrics():
    m = episode_stats([_traj(1.0, correct=True, answer=3), _traj(0.0, correct=False, answer=4)], "rollout")
    assert not {"rollout/tool_call_rate", "rollout/tool_error_rate", "rollout/illegal_move_rate"} & set(m)
    assert m["rollout/distinct_answer_share"] == 1.0
