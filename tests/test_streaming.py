"""Streaming rollouts and bounded staleness (opentinker/rl/producer.py, the sampler, the loss):
k = 0 trains only tokens of the version it trains; k > 0 plays ahead but never more than k
versions; the off-policy loss against hand-computed values; an environment that hangs or raises
costs its episode and never stalls the stream; a job dropped mid-stream resumes without training
any group twice."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from opentinker.algo.losses import ppo_clipped_loss
from opentinker.rl import RLJob
from opentinker.rl.producer import Producer
from tests.conftest import tiny_spec


def _recording(job: RLJob) -> list[tuple[int, list[int], list[int]]]:
    """(trainer version, sampled tokens' versions, group ids) of every batch the policy updates on."""
    seen = []
    original = job.policy.update

    def update(batch):
        versions = [v for t in batch.trajectories for v, m in zip(t.token_versions, t.loss_mask) if m]
        seen.append((job.policy.version, versions, [t.group_id for t in batch.trajectories]))
        return original(batch)

    job.policy.update = update
    return seen


def test_a_synchronous_job_trains_only_tokens_drawn_by_the_version_it_trains(tmp_path):
    job = RLJob(tiny_spec(tmp_path, optimization={"steps": 3}), job_id="sync")
    seen = _recording(job)
    result = job.run()
    assert result.steps_done == 3 and len(seen) == 3
    for version, versions, groups in seen:
        assert versions and set(versions) == {version}  # every trained token: the version being trained
    assert [sorted(set(g)) for _, _, g in seen] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(h["rollout/version_lag_max"] == 0 for h in result.history)


def test_a_producer_starts_a_group_only_within_k_versions_and_k_plus_one_steps_ahead():
    started = []  # (group, trainer version when it started)
    lock = threading.Lock()
    producer_version = [0]

    def play(group):
        with lock:
            started.append((group.index, producer_version[0]))
        return [group.index]

    draws = iter(range(10**6))
    producer = Producer(lambda: ({"n": next(draws)}, {"at": 0}), play, prompts_per_step=2, max_staleness=1)
    time.sleep(0.3)
    assert sorted(g for g, _ in started) == [0, 1, 2, 3]  # steps 0 and 1 (version 0 >= 1 - k): k + 1 steps ahead
    for step in range(4):
        assert [g.trajectories for g in producer.take(step)] == [[2 * step], [2 * step + 1]]
        producer_version[0] = step + 1
        producer.publish(step + 1)
        time.sleep(0.2)
    producer.stop()
    for group, version in started:
        assert version >= group // 2 - 1  # the step of a group is at most k = 1 ahead of the trainer's version


def test_a_producer_plays_at_most_a_steps_worth_of_groups_at_once():
    """k = 2 may start three steps of groups, but only one step's worth plays at a time, the oldest first."""
    playing, most, order = set(), [0], []
    lock, release = threading.Lock(), threading.Semaphore(0)

    def play(group):
        with lock:
            playing.add(group.index)
            order.append(group.index)
            most[0] = max(most[0], len(playing))
        release.acquire()
        with lock:
            playing.discard(group.index)
        return [group.index]

    draws = iter(range(10**6))
    producer = Producer(lambda: ({"n": next(draws)}, {"at": 0}), play, prompts_per_step=2, max_staleness=2)
    time.sleep(0.3)
    assert sorted(playing) == [0, 1]  # not groups 2-5 yet, though k = 2 allows them
    for _ in range(6):
        release.release()
        time.sleep(0.1)
    assert [[g.trajectories for g in producer.take(step)] for step in range(3)] == [[[0], [1]], [[2], [3]], [[4], [5]]]
    producer.stop()
    assert most[0] == 2 and order == [0, 1, 2, 3, 4, 5]


def test_an_off_policy_job_plays_ahead_within_its_bound_and_corrects_with_the_behaviour_logprobs(tmp_path):
    spec = tiny_spec(tmp_path, optimization={"steps": 4}, algorithm={"max_staleness": 1})
    job = RLJob(spec, job_id="async")
    assert job.own_copy and job.sampler.model is not job.policy.model  # the producer samples from a copy of its own
    seen = _recording(job)
    result = job.run()
    job.close()
    lags = [version - v for version, versions, _ in seen for v in versions]
    assert max(lags) <= 1 and any(lag == 1 for lag in lags)  # it did play ahead, never past k
    last = result.history[-1]
    assert 0 <= last["rollout/version_lag_mean"] <= last["rollout/version_lag_max"] <= 1
    assert "update/behaviour_weight_mean" in last and last["rollout/groups_dropped"] == 0


def test_the_off_policy_loss_is_decoupled_ppo_against_hand_computed_values():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    prox = torch.tensor([[-1.2, -1.5, -0.5]])
    behaviour = torch.tensor([[-1.0, -3.0, -0.6]])
    adv = torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = ppo_clipped_loss(lp, prox, adv, mask, clip_range=0.2, behaviour_logprobs=behaviour, weight_cap=2.0)
    r = torch.exp(lp.detach() - prox)  # e^0.2, e^-0.5
    w = torch.exp(prox - behaviour).clamp(max=2.0)  # e^-0.2, e^1.5 -> capped at 2
    per = -w * torch.minimum(r * 1.0, r.clamp(0.8, 1.2) * 1.0)
    expected = (per * mask).sum() / 2
    assert float(out.loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(out.weight_mean) == pytest.approx((float(w[0, 0]) + 2.0) / 2, rel=1e-6)
    assert float(out.capped_fraction) == pytest.approx(0.5)
    on = ppo_clipped_loss(lp, prox, adv, mask, clip_range=0.2, behaviour_logprobs=prox)  # pi_prox = pi_behaviour: PPO
    plain = ppo_clipped_loss(lp, prox, adv, mask, clip_range=0.2)
    assert float(on.loss) == pytest.approx(float(plain.loss), rel=1e-7)
    out.loss.backward()  # the weight carries no gradient: d loss / d lp = -w * r * A on unclipped tokens
    grad = torch.where(r <= 1.2, -w * r / 2, torch.zeros_like(r)) * mask
    assert torch.allclose(lp.grad, grad, atol=1e-6)


def test_a_hanging_or_raising_environment_costs_its_episodes_and_never_stalls_the_stream(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENTINKER_GAME_ALLOWLIST", "envs,tests.games")  # the operator ships the test games here
    spec = tiny_spec(tmp_path, optimization={"steps": 2}, rollout={"step_timeout_s": 0.5},
                     env={"game": "tests.games:SometimesBroken", "config": {"val_size": 16}})
    started = time.monotonic()
    result = RLJob(spec, job_id="broken").run()
    assert result.steps_done == 2 and time.monotonic() - started < 120
    failed = [h["rollout/failed_episodes"] for h in result.history]
    assert all(0 < f < 16 for f in failed)  # some episodes hung or raised, the others trained


def test_a_job_dropped_mid_stream_resumes_and_trains_no_group_twice(tmp_path):
    """Off-policy, the producer is steps ahead when the job stops after its checkpoint at step 2 (as
    a kill -9 would leave it); the resumed job trains the tasks the uninterrupted one trains, in the
    same order, and the bound holds after the resume too."""
    trained: dict[str, list] = {"straight": [], "resumed": []}

    def run(name: str, steps: int, job_id: str) -> RLJob:
        job = RLJob(tiny_spec(tmp_path, optimization={"steps": steps}, algorithm={"max_staleness": 2}, checkpoint={"every": 2}),
                    job_id=job_id)
        original = job.policy.update

        def update(batch):
            trained[name].extend(t.task.get("prompt") for t in batch.trajectories[:: job.spec.rollout.group_size])
            lags = [job.policy.version - v for t in batch.trajectories for v, m in zip(t.token_versions, t.loss_mask) if m]
            assert max(lags) <= 2
            return original(batch)

        job.policy.update = update
        job.run()
        return job

    run("straight", 4, "straight").close()
    first = run("resumed", 2, "dropped")
    assert first.sampler.producer.next_group > 2 * 4  # groups of later steps were playing when it stopped
    first.sampler.producer.stop()  # dropped: nothing of it is carried over
    run("resumed", 4, "dropped").close()
    assert trained["resumed"] == trained["straight"] and len(trained["straight"]) == 16


def test_what_k_greater_than_zero_reproduces_and_what_depends_on_timing(tmp_path):
    """Two uninterrupted k = 2 runs with one seed: the same tasks in the same groups in the same order,
    every trained token within the bound, and an episode drawn by the same weights in both runs draws the
    same tokens (its generator is seeded by (seed, episode)): versions 0 and 1 are the same weights in
    both (step 0 trains only version 0's tokens). Which version draws which token later depends on when
    each update lands, so later weights may differ (docs/training.md)."""
    runs = []
    for name in ("first", "second"):
        job = RLJob(tiny_spec(tmp_path, optimization={"steps": 3}, algorithm={"max_staleness": 2}), job_id=name)
        trained = []
        original = job.policy.update

        def update(batch, job=job, trained=trained):
            assert max(job.policy.version - v for t in batch.trajectories for v, m in zip(t.token_versions, t.loss_mask) if m) <= 2
            trained.extend((t.group_id, t.task.get("prompt"), t.token_versions, t.token_ids) for t in batch.trajectories)
            return original(batch)

        job.policy.update = update
        job.run()
        job.close()
        runs.append(trained)
    first, second = runs
    assert [(g, task) for g, task, _, _ in first] == [(g, task) for g, task, _, _ in second] and len(first) == 48
    same_versions = [(a, b) for a, b in zip(first, second) if a[2] == b[2] and set(a[2]) <= {-1, 0, 1}]
    assert len(same_versions) >= 16  # the first step's episodes at least: drawn by version 0 in both runs
    assert all(a[3] == b[3] for a, b in same_versions)
