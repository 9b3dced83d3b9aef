"""Hosted native jobs' updates in joint passes (opentinker.backend.shared_base, `joint_updates`):
the per-sequence micro-batches of jobs that update together run as one forward and one backward,
each row through its own job's adapter.

- alone, a joint update is the job's own update (loss, statistics, gradient norm, weights);
- two jobs updating at once share passes and each gets what it gets alone (KL to the base included);
- a job whose pass raises fails alone: its neighbour's update is the same as without it;
- on a worker, a joint update does not hold the base's training lock (the runner takes it per pass).

On the CPU `joint_updates` is off by default (bench/joint_updates.py measures why); here it is
turned on to check the arithmetic, which is the same on any device.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from tests.conftest import tiny_spec
from tests.rounding import PASS, same_adam_step, same_update_metrics, update_bounds

OPTIMIZATION = {"lr": 1e-2, "steps": 4, "micro_batch_size": 3, "shared_prefix": False}
ADAPTER = {"kind": "lora", "r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}  # the head's rows too


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """Two batches of the toy game sampled by an own job, and nonzero adapter weights to start from."""
    from opentinker.rl import RLJob

    tmp = tmp_path_factory.mktemp("joint")
    own = RLJob(tiny_spec(tmp, adapter=ADAPTER, optimization=OPTIMIZATION, algorithm={"kl": {"coef": 0.05}}), job_id="own")
    batches = []
    for step in (1, 2):
        own.rollout(step)
        batches.append(own.sampler.batch(step))
        own.update(step)  # the next step's groups start once this update is published
    start = {k: torch.randn_like(v) * 0.05 for k, v in own.policy.trainer.trainable_state().items()}
    return tmp, batches, start


def _jobs(setting, names, joint: bool, gather_s: float = 0.5):
    from opentinker.backend.shared_base import SharedBase
    from opentinker.model import load_model
    from opentinker.rl import RLJob

    tmp, _, start = setting
    spec = tiny_spec(tmp, resources={"share_base": True}, adapter=ADAPTER, optimization=OPTIMIZATION, algorithm={"kl": {"coef": 0.05}})
    base, tokenizer = load_model("tiny-random")
    shared = SharedBase(base, tokenizer, "tiny-random", gather_s=gather_s)
    lora = spec.adapter
    jobs = {}
    for name in names:
        key = f"job/-/{name}"
        job = RLJob(spec, job_id=name, model=shared.add_job(key, lora.r, lora.alpha, lora.target_modules, lora.dropout, spec.seed),
                    tokenizer=tokenizer)
        job.policy.trainer.load_trainable_state(start)
        if joint:
            job.policy.trainer.joint = functools.partial(shared.joint_update, key)
        jobs[name] = job
    return shared, jobs


def _update(job, batch) -> dict[str, float]:
    with job.policy.model.using():
        return job.policy.update(batch)


def _bounded_update(job, batch):
    """The job's update, and what bounds its rounding (tests/rounding.py), taken before it."""
    with job.policy.model.using():
        bounds = update_bounds(job.policy.trainer, batch.trajectories)
        return job.policy.update(batch), bounds


def _together(jobs: dict, batches: dict) -> dict[str, dict | BaseException]:
    """Each job's update in a thread of its own, all started at once."""
    out: dict[str, dict | BaseException] = {}
    barrier = threading.Barrier(len(jobs))

    def run(name: str) -> None:
        barrier.wait()
        try:
            out[name] = _update(jobs[name], batches[name])
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            out[name] = err

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def _same(mine: dict, theirs: dict, bounds, job, other) -> None:
    """A joint pass's rows against a job's own passes: the same sums in other orders, so within
    float32's bounds for them (tests/rounding.py); the counts exactly."""
    assert same_update_metrics(mine, theirs, bounds)
    assert mine["update/grad_norm"] == pytest.approx(theirs["update/grad_norm"], rel=PASS)
    assert all(mine[k] == theirs[k] for k in ("update/tokens", "update/positions_computed"))
    after = other.policy.trainer.trainable_state()
    for name, tensor in job.policy.trainer.trainable_state().items():
        assert same_adam_step(tensor, after[name], bounds.grads[name], lr=OPTIMIZATION["lr"]), name


def test_a_joint_update_alone_is_the_jobs_own_update(setting):
    _, batches, _ = setting
    _, own = _jobs(setting, ["a"], joint=False)
    shared, joint = _jobs(setting, ["a"], joint=True)
    (theirs, bounds), mine = _bounded_update(own["a"], batches[0]), _update(joint["a"], batches[0])
    _same(mine, theirs, bounds, joint["a"], own["a"])
    records = sum(1 for t in batches[0].trajectories if not t.failed and t.num_sampled)
    assert mine["update/joint_passes"] == -(-records // OPTIMIZATION["micro_batch_size"]) and mine["update/joint_share"] == 0.0
    assert "update/joint_passes" not in theirs and shared.stats.passes == mine["update/joint_passes"]
    assert shared.updating == set()


def test_two_jobs_updating_at_once_share_passes_and_each_gets_its_own_update(setting):
    _, batches, _ = setting
    _, alone = _jobs(setting, ["a", "b"], joint=False)
    expected = {name: _bounded_update(alone[name], batch) for name, batch in zip("ab", batches)}
    shared, jobs = _jobs(setting, ["a", "b"], joint=True)
    got = _together(jobs, dict(zip("ab", batches)))
    for name in "ab":
        assert isinstance(got[name], dict), got[name]
        _same(got[name], *expected[name], jobs[name], alone[name])
    assert shared.stats.shared >= 1 and got["a"]["update/joint_share"] > 0 and got["b"]["update/joint_share"] > 0


def test_a_job_whose_pass_fails_fails_alone_and_its_neighbour_gets_its_own_update(setting):
    _, batches, _ = setting
    _, alone = _jobs(setting, ["a"], joint=False)
    expected, bounds = _bounded_update(alone["a"], batches[0])
    shared, jobs = _jobs(setting, ["a", "b"], joint=True)

    def broken(*args, **kwargs):
        raise ValueError("tenant b's loss went wrong")

    jobs["b"].policy.trainer._loss_of = broken
    got = _together(jobs, {"a": batches[0], "b": batches[1]})
    assert isinstance(got["b"], ValueError) and "tenant b" in str(got["b"])
    assert isinstance(got["a"], dict), got["a"]
    _same(got["a"], expected, bounds, jobs["a"], alone["a"])
    assert shared.updating == set()


def test_a_joint_update_on_a_worker_leaves_the_base_lock_to_the_runner():
    from opentinker.orchestration.base_worker import HostedJob

    class Trainer:
        joint = None

    class Job:
        policy = type("Policy", (), {"trainer": Trainer()})()

    hosted = HostedJob(Job(), model=None, shared=None)
    assert hosted.locks_base("update") and hosted.locks_base("step") and not hosted.locks_base("rollout")
    Job.policy.trainer.joint = object()
    assert not hosted.locks_base("update") and hosted.locks_base("step")


def test_a_joint_pass_stays_within_its_bound_of_padded_positions():
    """Micro-batches join a pass while rows x widest row stays within JOINT_PASS_TOKENS; the first always runs."""
    from types import SimpleNamespace

    from opentinker.backend.shared_calls import JOINT_PASS_TOKENS, overfills

    def job(rows: int, width: int):
        return SimpleNamespace(kind="job", input_ids=torch.zeros(rows, width))

    half = job(4, JOINT_PASS_TOKENS // 8)  # half the bound
    assert not overfills([], job(64, JOINT_PASS_TOKENS))  # alone: runs, whatever its size
    assert not overfills([half], half)  # exactly the bound
    assert overfills([half], job(1, JOINT_PASS_TOKENS // 4))  # wider: every row pads to it
    assert not overfills([half], SimpleNamespace(kind="train"))  # Tinker calls have their own micro-batches
