"""A trainer sharded over N ranks (FSDP2 over gloo, the ranks Ray actors in one placement group)
updates exactly as one process does on the same batch: in float64 the weights after one and after
three steps at N = 1, 2 and 4 equal one process's to 1e-10 (the same sums in another order; float64
rounding is about 1e-16 of each sum), and so do the loss, the gradient norm and every logged
statistic. A rank killed mid-update fails the group at once, in one line naming it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from opentinker.backend.sharded import sharded_trainer
from opentinker.core.spec import AlgorithmSpec, FullSpec, KLSpec, LoraSpec, OptimizationSpec
from tests.test_shared_prefix import single_turn

WIDTHS = (1, 2, 4)
BOUND = 1e-10
# positions_computed counts each rank's padding (its own micro-batches' widths), seconds the clock
UNEQUAL = {"update/seconds", "update/positions_computed"}
CASES = {"lora": (LoraSpec(r=4, alpha=8), AlgorithmSpec()),
         "full-kl": (FullSpec(), AlgorithmSpec(kl=KLSpec(coef=0.1)))}
OPTIM = OptimizationSpec(lr=1e-2, micro_batch_size=3, shared_prefix=False)


@pytest.fixture(scope="module")
def groups(tiny_path):
    """Rank groups of each width on a local Ray node, started once for the module."""
    import ray

    from opentinker.orchestration.ranks import RankGroup

    ray.init(address="local", num_cpus=9,  # the widths, then a group of two for the kill include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    made = {}
    try:
        for n in WIDTHS:
            made[n] = RankGroup(n, cpus_per_rank=1)
        yield made
    finally:
        for group in made.values():
            group.close()
        ray.shutdown()


def _steps(n: int) -> list:
    """The batches of steps 0..n-1: three groups of four records of unequal lengths each."""
    out = []
    for step in range(n):
        trajs = single_turn(seed=step)
        for t in trajs:
            t.policy_version = step
        out.append(trajs)
    return out


def _lora_start(names_shapes: dict) -> dict[str, torch.Tensor]:
    """Adapter weights with a non-zero B (a fresh LoRA's B is zero: A would get no gradient)."""
    gen = torch.Generator().manual_seed(1)
    return {n: torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05 for n, shape in sorted(names_shapes.items())}


def _one_process(case: str, steps: list):
    from opentinker.backend import PolicyTrainer
    from opentinker.backend.device import Placement
    from opentinker.model.policy import load_model

    adapter, algorithm = CASES[case]
    torch.manual_seed(0)
    model, tok = load_model("tiny-random")
    trainer = PolicyTrainer(model.double(), tok, adapter, algorithm, OPTIM, placement=Placement(torch.device("cpu"), torch.float64))
    if isinstance(adapter, LoraSpec):
        trainer.load_trainable_state(_lora_start({n: t.shape for n, t in trainer.trainable_state().items()}))
    metrics, states = [], []
    for trajs in steps:
        metrics.append(trainer.update(trajs))
        states.append(trainer.trainable_state())
    return metrics, states


def _sharded(group, case: str, steps: list, start: dict | None):
    adapter, algorithm = CASES[case]
    group.host(sharded_trainer, "tiny-random", adapter, algorithm, OPTIM, "float64")
    if start is not None:
        group.call("load_trainable_state", start)
    metrics, states = [], []
    for trajs in steps:
        metrics.append(group.call("update", trajs))
        states.append(group.call("trainable_state"))
    return metrics, states


@pytest.mark.parametrize("case", CASES)
def test_sharded_update_equals_one_process(groups, case):
    steps = _steps(3)
    want_metrics, want_states = _one_process(case, steps)
    start = _lora_start({n: t.shape for n, t in want_states[0].items()}) if case == "lora" else None
    for n in WIDTHS:
        metrics, states = _sharded(groups[n], case, steps, start)
        for step in (0, 2):  # after one step and after three
            assert states[step].keys() == want_states[step].keys()
            worst = max(float((states[step][k] - want_states[step][k]).abs().max()) for k in want_states[step])
            assert worst <= BOUND, (n, step, worst)
            got, want = metrics[step], want_metrics[step]
            assert got.keys() == want.keys(), (n, got.keys() ^ want.keys())
            off = {k: (got[k], want[k]) for k in want if k not in UNEQUAL and abs(got[k] - want[k]) > BOUND * max(1.0, abs(want[k]))}
            assert not off, (n, step, off)
        assert metrics[0]["update/grad_norm"] > 0 and metrics[0]["update/policy_loss"] != 0
    # the weights moved between the compared steps: the comparison is not of untouched weights
    assert max(float((want_states[2][k] - want_states[0][k]).abs().max()) for k in want_states[0]) > 1e-4


def test_share_splits_whole_groups_by_load():
    from opentinker.backend.sharded import share

    trajs = single_turn(groups=3, group_size=4)
    shares = [share(trajs, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(12))
    for mine in shares:  # whole groups only
        for g in {trajs[i].group_id for i in mine}:
            assert [i for i in range(12) if trajs[i].group_id == g] == [i for i in mine if trajs[i].group_id == g]
    assert [len(s) for s in shares] == [8, 4]  # groups 0 and 2 to rank 0, group 1 to rank 1
    assert share(trajs, 3, 4) == []  # a rank with no group still takes part (its passes at weight zero)


def test_killed_rank_fails_the_group_in_one_line(groups):
    """SIGKILL to rank 1 while the ranks update: the call fails at once (not after the collective's
    timeout), names rank 1 and its node, and the group's actors and placement are gone."""
    import ray

    from opentinker.orchestration.ranks import RankGroup, RankLost

    group = RankGroup(2, cpus_per_rank=1, collective_timeout_s=300)
    adapter, algorithm = CASES["lora"]
    group.host(sharded_trainer, "tiny-random", adapter, algorithm, OptimizationSpec(micro_batch_size=1, shared_prefix=False))
    batch = [t for seed in range(30) for t in single_turn(seed=seed)]  # 360 passes of one record each: seconds
    for i, t in enumerate(batch):
        t.group_id = i // 4
    victim = group.places[1]["pid"]
    update = group.start("update", batch)
    time.sleep(2)  # the ranks are in their update now
    assert not ray.wait(update, timeout=0)[0], ("the update ended before the kill: make the batch larger", ray.get(update))
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankLost) as failed:
        group.gather("update", update)
    took = time.monotonic() - t0
    line = str(failed.value)
    assert line == f"trainer rank 1 of 2 on {group.places[1]['address']} died in update (its process was killed or ran out of memory, or its node left)"
    assert took < 30, took
    assert ray.util.placement_group_table(group.group)["state"] == "REMOVED"


def test_placement_that_cannot_be_met_says_so(groups):
    from opentinker.orchestration.ranks import RankFailed, RankGroup

    with pytest.raises(RankFailed, match=r"cannot place 64 trainer ranks of \{'CPU': 1\} \(packed\) within 2 s"):
        RankGroup(64, cpus_per_rank=1, ready_timeout_s=2)


def _spec(base_url: str, ranks: int):
    from opentinker.core.spec import parse_spec

    return parse_spec({"model": {"name": "tiny-random", "dtype": "float32"}, "env": {"game": "envs.math:MathGame"},
                       "adapter": {"kind": "full"}, "optimization": {"lr": 1e-2, "micro_batch_size": 3, "shared_prefix": False},
                       "checkpoint": {"base_url": base_url, "keep_last": 5}, "resources": {"trainer_ranks": ranks}})


def _batch(trajs):
    from types import SimpleNamespace

    return SimpleNamespace(trajectories=trajs)


def _whole_optimizer(url: str) -> dict[str, torch.Tensor]:
    """A checkpoint's AdamW state read back by one process (sharded checkpoints resume there too), by name."""
    from opentinker.backend import PolicyTrainer
    from opentinker.backend.device import cpu
    from opentinker.core.spec import AlgorithmSpec, FullSpec
    from opentinker.model.policy import load_model
    from opentinker.storage.checkpoint import load_checkpoint

    model, tok = load_model("tiny-random")
    trainer = PolicyTrainer(model, tok, FullSpec(), AlgorithmSpec(), OPTIM, placement=cpu())
    trainer.load_optimizer_state(load_checkpoint(url).optimizer_state)
    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    state = trainer.optimizer.state_dict()["state"]
    return {f"{names[i]}.{k}": v for i, moments in state.items() for k, v in moments.items()}


def test_a_sharded_checkpoint_resumes_bit_for_bit_and_at_another_width(groups, tmp_path):
    """A job at 4 ranks checkpoints after two steps: every rank writes its share of AdamW's state
    (DCP, safetensors, listed and hashed in the signed COMMIT.json; no optimizer.pt gathered).
    Resumed at 4 ranks, its third step equals the uninterrupted one bit for bit; resumed at 2, the
    state it holds is the saved one exactly (checkpointed again at 2 ranks and read back in one
    process, both checkpoints' weights and moments are equal), and it trains on."""
    from opentinker.rl.policy import Policy
    from opentinker.storage.checkpoint import committed_manifest, load_checkpoint

    base, job = str(tmp_path / "ckpt"), "job-dcp"
    steps = _steps(3)
    groups[4].host(Policy, _spec(base, 4), job)
    for trajs in steps[:2]:
        groups[4].call("update", _batch(trajs))
    saved = groups[4].call("save", 2, {"cursor": 2})
    files = committed_manifest(saved.url)["files"]
    shares = sorted(n for n in files if n.startswith("optimizer/"))
    assert len(shares) == 4 and "optimizer.pt" not in files, sorted(files)
    want_metrics = groups[4].call("update", _batch(steps[2]))
    want = groups[4].call("weights")[1]

    groups[4].host(Policy, _spec(base, 4), job)  # a fresh job process at the same width
    restored = groups[4].call("restore_latest")
    assert (restored.step, restored.env_state) == (2, {"cursor": 2})
    got_metrics = groups[4].call("update", _batch(steps[2]))
    got = groups[4].call("weights")[1]
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert {k: v for k, v in got_metrics.items() if k != "update/seconds"} == {k: v for k, v in want_metrics.items() if k != "update/seconds"}

    groups[2].host(Policy, _spec(base, 2), job)  # at another width
    assert groups[2].call("restore_latest").step == 2
    again = groups[2].call("save", 3, {"cursor": 2})
    assert len([n for n in committed_manifest(again.url)["files"] if n.startswith("optimizer/")]) == 2
    before, after = load_checkpoint(saved.url).weights, load_checkpoint(again.url).weights
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    moments, moments_again = _whole_optimizer(saved.url), _whole_optimizer(again.url)
    assert moments.keys() == moments_again.keys() and len(moments) == 3 * len(before)  # step, exp_avg, exp_avg_sq
    assert all(torch.equal(moments[k], moments_again[k]) for k in moments)
    assert max(float(v.abs().max()) for k, v in moments.items() if k.endswith("exp_avg")) > 0  # the moments are not zeros
    assert groups[2].call("update", _batch(steps[2]))["update/grad_norm"] > 0  # and it trains on


def test_a_changed_share_of_a_sharded_checkpoint_is_refused(groups, tmp_path):
    """A rank's optimizer share changed after the commit (same size, other bytes) fails the load
    with the file named, before DCP reads any of it."""
    from opentinker.rl.policy import Policy
    from opentinker.storage.checkpoint import CheckpointError, load_checkpoint

    groups[2].host(Policy, _spec(str(tmp_path), 2), "job-tampered")
    groups[2].call("update", _batch(_steps(1)[0]))
    url = groups[2].call("save", 1, {}).url
    share = sorted((tmp_path / "job-tampered" / "step-00000001" / "optimizer").iterdir())[-1]
    data = bytearray(share.read_bytes())
    data[-1] ^= 0xFF
    share.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"optimizer/{share.name} differs from the sha256 in COMMIT.json"):
        load_checkpoint(url)
