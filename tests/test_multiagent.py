"""Multi-agent training: phase barriers, self-play token records for every seat, zero-sum
rewards on the right tokens, and per-turn credit."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from opentinker.agent import ChatFormat, EpisodeLimits
from opentinker.agent.coordinator import Coordinator, PhaseError
from opentinker.agent.selfplay import Seat, play_matches
from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams
from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec
from opentinker.core.trajectory import Trajectory, Turn
from tests.rounding import same_logprobs

# --- barriers ---------------------------------------------------------------------------------


class InstrumentedAgent:
    """Sleeps a different time per agent and phase, recording when each piece of work ran."""

    def __init__(self, name: str, log: list, lock: threading.Lock, delay: float, meet: threading.Barrier):
        self.name, self.log, self.lock, self.delay, self.meet = name, log, lock, delay, meet

    def work(self, phase: str, step: int):
        def run():
            start = time.monotonic()
            if (phase, step) == ("rollout", 0):
                self.meet.wait()  # all three must be running at once, or this breaks (5 s timeout)
            time.sleep(self.delay * (1 + step % 2))
            with self.lock:
                self.log.append((phase, step, self.name, start, time.monotonic()))
            return f"{phase}-{self.name}-{step}"
        return run


def test_no_update_before_all_rollouts_and_no_rollout_before_all_updates():
    log, lock, meet = [], threading.Lock(), threading.Barrier(3, timeout=5)
    agents = [InstrumentedAgent(n, log, lock, d, meet) for n, d in (("a", 0.01), ("b", 0.05), ("c", 0.03))]
    coord = Coordinator(phase_timeout_s=10)
    for step in range(3):
        out = coord.step(step, {a.name: a.work("rollout", step) for a in agents},
                         lambda batches, step=step: {a.name: a.work("update", step) for a in agents})
        assert out == {a.name: f"update-{a.name}-{step}" for a in agents}
    for step in range(3):
        rollouts = [e for e in log if e[:2] == ("rollout", step)]
        updates = [e for e in log if e[:2] == ("update", step)]
        assert len(rollouts) == len(updates) == 3
        assert min(u[3] for u in updates) >= max(r[4] for r in rollouts)  # barrier 1
        later = [e for e in log if e[:2] == ("rollout", step + 1)]
        if later:
            assert min(r[3] for r in later) >= max(u[4] for u in updates)  # barrier 2
    # the work of one phase runs concurrently: step 0's rollouts met at a barrier (see run)


def test_a_failing_or_hanging_agent_fails_the_phase_by_name():
    coord = Coordinator(phase_timeout_s=0.5)

    def boom():
        raise ValueError("out of memory")

    with pytest.raises(PhaseError, match=r"rollout phase of step 4: b failed: ValueError: out of memory"):
        coord.run_phase("rollout", 4, {"a": lambda: 1, "b": boom})
    t0 = time.monotonic()
    with pytest.raises(PhaseError, match=r"update phase of step 5: a did not finish within 0.5s"):
        coord.run_phase("update", 5, {"a": lambda: time.sleep(30), "b": lambda: 2})
    assert time.monotonic() - t0 < 5  # no deadlock


# --- self-play records and zero-sum rewards ---------------------------------------------------


class ScriptedMatch:
    """X and O alternate; any text is a move, except O's first reply of each match is refused
    once (an illegal-move message). After `moves` legal moves the scripted winner wins."""

    players = ("X", "O")

    def __init__(self, moves: int = 4, winner: str | None = "X"):
        self.moves, self.winner = moves, winner
        self.current_player, self.finished, self.played = "X", False, []
        self.refused = False

    def system_prompt(self, player: str) -> str:
        return f"You play {player}."

    def observation_for(self, player: str) -> str:
        return f"{player} to move after {len(self.played)} moves"

    def apply(self, player: str, action: str) -> tuple[bool, str]:
        assert player == self.current_player and not self.finished
        if player == "O" and not self.refused:
            self.refused = True
            return False, "illegal: try again"
        self.played.append((player, action))
        self.current_player = "O" if player == "X" else "X"
        self.finished = len(self.played) >= self.moves
        return True, "ok"

    def result_for(self, player: str) -> float:
        return 0.0 if self.winner is None else (1.0 if player == self.winner else -1.0)

    def info_for(self, player: str) -> dict:
        result = "draw" if self.winner is None else ("win" if player == self.winner else "loss")
        return {"result": result, "correct": result == "win", "game_length": len(self.played)}


@pytest.fixture
def two_seats(tiny_path):
    from opentinker.core.model_names import TINY
    from opentinker.model.policy import load_model

    seats, trainers = {}, {}
    for name, seed in (("X", 0), ("O", 1)):  # each player its own model and adapter
        torch.manual_seed(seed)
        model, tok = load_model(TINY)
        trainers[name] = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(), temperature=0.8)
        seats[name] = Seat(HFRolloutEngine(trainers[name].model, tok), ChatFormat(tok))
    return seats, trainers


def test_every_seat_gets_an_exact_record_and_the_zero_sum_result(two_seats):
    seats, trainers = two_seats
    matches = [ScriptedMatch(moves=4, winner="X"), ScriptedMatch(moves=4, winner="O"), ScriptedMatch(moves=3, winner=None)]
    records = play_matches(seats, matches, SamplingParams(max_new_tokens=5, temperature=0.8), EpisodeLimits(max_turns=6, max_total_tokens=512))
    expected = {"X": [1.0, -1.0, 0.0], "O": [-1.0, 1.0, 0.0]}
    for player, trajs in records.items():
        chat = seats[player].chat
        for i, traj in enumerate(trajs):
            assert traj is not None and not traj.failed
            # prompt = the template of system + first observation, tokenized once
            first = [{"role": "system", "content": f"You play {player}."}, {"role": "user", "content": traj.messages[1]["content"]}]
            assert traj.prompt_ids == chat.prompt_ids(first)
            # mask 1 exactly on the sampled spans, 0 on prompt and observations
            sampled = {k for t in traj.turns for k in range(t.sampled_start, t.sampled_end)}
            assert traj.loss_mask == [1 if k in sampled else 0 for k in range(len(traj))]
            # the reward is the match result, on the player's last trainable token only
            rewards = traj.token_rewards()
            assert rewards[traj.last_trainable_index()] == expected[player][i]
            assert sum(abs(r) for r in rewards) == abs(expected[player][i])
            assert traj.info["result"] == {1.0: "win", -1.0: "loss", 0.0: "draw"}[expected[player][i]]
        # O was refused once per match: it saw the illegal-move message and moved again
        if player == "O":
            assert all(any(m["content"] == "illegal: try again" for m in t.messages) for t in trajs)
        # recomputed logprobs (each player's own weights) match its sampling logprobs
        recomputed = trainers[player].logprobs(trajs)
        for traj, lps in zip(trajs, recomputed):
            sampled_lp = [lp for lp, m in zip(traj.sampling_logprobs, traj.loss_mask) if m]
            assert len(sampled_lp) == len(lps) and same_logprobs(sampled_lp, lps)  # other orders: tests/rounding.py


def test_a_broken_match_is_a_draw_for_both_and_spares_the_others(two_seats):
    seats, _ = two_seats

    class Broken(ScriptedMatch):
        def apply(self, player, action):
            if len(self.played) == 2:
                raise RuntimeError("engine bug")
            return super().apply(player, action)

    matches = [Broken(moves=6), ScriptedMatch(moves=2, winner="O")]
    records = play_matches(seats, matches, SamplingParams(max_new_tokens=3), EpisodeLimits(max_turns=8, max_total_tokens=512))
    assert records["X"][0].info["aborted"].startswith("apply: RuntimeError: engine bug")
    assert records["X"][0].reward == 0.0 and records["O"][0].reward == 0.0
    assert records["X"][1].reward == -1.0 and records["O"][1].reward == 1.0


def test_a_match_that_hangs_is_abandoned_at_the_step_deadline_and_spares_the_others(two_seats):
    seats, _ = two_seats
    release = threading.Event()

    class Hangs(ScriptedMatch):
        def apply(self, player, action):
            if len(self.played) == 2:
                release.wait(30)  # a game stuck in a loop
            return super().apply(player, action)

    matches = [Hangs(moves=6), ScriptedMatch(moves=2, winner="O")]
    try:
        records = play_matches(seats, matches, SamplingParams(max_new_tokens=3),
                               EpisodeLimits(max_turns=8, max_total_tokens=512, step_timeout_s=0.5))
    finally:
        release.set()
    assert records["X"][0].info["aborted"] == "apply: timed out after 0.5s"
    assert records["X"][0].reward == 0.0 and records["O"][0].reward == 0.0
    assert records["X"][1].reward == -1.0 and records["O"][1].reward == 1.0


# --- per-turn credit -------------------------------------------------------------------------


def test_split_by_turn_gives_each_turn_its_return_and_only_its_tokens():
    traj = Trajectory(prompt_ids=[1, 2])
    traj.append_sampled([10, 11], [-0.1, -0.2], "a")
    traj.turns[-1].reward = 0.5
    traj.append_observation([3], "o1")
    traj.append_sampled([12], [-0.3], "b")
    traj.turns[-1].reward = 0.0
    traj.append_observation([4, 5], "o2")
    traj.append_sampled([13, 14], [-0.4, -0.5], "c")
    traj.turns[-1].reward = 1.0
    pieces = traj.split_by_turn(gamma=0.5)
    assert [p.reward for p in pieces] == [0.5 + 0.5 * (0.0 + 0.5 * 1.0), 0.0 + 0.5 * 1.0, 1.0]
    assert pieces[0].token_ids == [1, 2, 10, 11] and pieces[0].loss_mask == [0, 0, 1, 1]
    assert pieces[1].token_ids == [1, 2, 10, 11, 3, 12] and pieces[1].loss_mask == [0, 0, 0, 0, 0, 1]
    assert pieces[2].loss_mask == [0] * 8 + [1, 1] and pieces[2].sampling_logprobs[-2:] == [-0.4, -0.5]
    assert all(p.num_sampled == len(t) for p, t in zip(pieces, [[10, 11], [12], [13, 14]]))
    assert sum(p.num_sampled for p in pieces) == traj.num_sampled
    failed = Trajectory(prompt_ids=[1], failed=True)
    assert failed.split_by_turn() == [failed]
    assert isinstance(pieces[0].turns[0], Turn)


# --- the self-play job on gomoku ---------------------------------------------------------------


def _gomoku_spec(tmp_path, opponent, advantage="grpo"):
    from tests.conftest import tiny_spec

    return tiny_spec(
        tmp_path,
        rollout={"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "max_turns": 6, "max_total_tokens": 1024},
        evaluation={"n_samples": 2},
        env={"game": "envs.gomoku:GomokuSelfPlay", "config": {"size": 5, "opening_stones": 2, "val_size": 2,
                                                             "game_kwargs": {"size": 5, "win_length": 4, "max_illegal": 1}}},
        multiagent={"opponent": opponent, "snapshot_every": 1}, algorithm={"advantage": advantage, "gamma": 0.9},
    )


@pytest.mark.parametrize("opponent,advantage", [("agents", "grpo"), ("self", "grpo_per_step"), ("snapshot", "gigpo")])
def test_selfplay_job_trains_its_learners_through_the_phases(tmp_path, opponent, advantage):
    from opentinker.rl.selfplay import SelfPlayJob

    job = SelfPlayJob(_gomoku_spec(tmp_path, opponent, advantage), job_id="sp")
    expected = {"agents": ["X", "O"], "self": ["X"], "snapshot": ["X"]}[opponent]
    assert job.learners == expected
    for step in range(2):
        metrics = job.rollout(step) | job.update(step)
        for agent in expected:
            assert {f"{agent}/rollout/win_rate", f"{agent}/rollout/illegal_move_rate", f"{agent}/rollout/game_length",
                    f"{agent}/update/sequences"} <= set(metrics)
            rates = [metrics[f"{agent}/rollout/{r}_rate"] for r in ("win", "loss", "draw")]
            assert sum(rates) == pytest.approx(1.0)
    if opponent == "agents":  # zero-sum: X's wins are O's losses
        assert metrics["X/rollout/win_rate"] == pytest.approx(metrics["O/rollout/loss_rate"])
    phases = [(e.phase, e.step) for e in job.coordinator.events]
    assert phases[0] == ("rollout", 0) and ("update", 1) in phases
    # every policy that learns moved its version; a snapshot follows its learner
    for agent in expected:
        assert job.policies[agent].version == 2
    if opponent == "snapshot":
        assert job.policies["snapshot"].trainer.version == job.policies["X"].version
    evaluation = job.evaluate(2)
    assert f"{expected[0]}/eval/win_rate" in evaluation.metrics
