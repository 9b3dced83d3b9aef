"""Native LoRA RL jobs on a shared base (`resources.share_base`): each job an adapter of the base-model
worker's one copy of the base (opentinker.backend.adapter_model), trained by the job's own trainer,
its episodes sampled by the base's shared engine in batches with other jobs' rows.

In-process (the worker's class without Ray; the stack test runs it through Prefect and Ray):
- the same batch gives the same update as the job's own peft model (loss, gradient norm, weights);
- two jobs hosted together sample in mixed batches, train, and checkpoint in peft's layout, which
  loads as any LoRA checkpoint and scores as the hosted adapter did; the same job id of two tenants
  is two jobs; a job the memory bound cannot hold is refused with the numbers; leaving frees the adapter;
- a spec that cannot share is refused with the field and the reason.
"""

from __future__ import annotations

import threading

import pytest
import torch

from opentinker.core.spec import SpecError
from tests.conftest import tiny_spec


def _spec(tmp_path, **overrides):
    return tiny_spec(tmp_path, resources={"share_base": True}, **overrides)


def test_an_update_on_a_shared_base_is_the_update_of_the_jobs_own_peft_model(tmp_path):
    from opentinker.backend.shared_base import SharedBase
    from opentinker.model import load_model
    from opentinker.rl import RLJob

    spec = _spec(tmp_path)
    own = RLJob(spec.model_copy(update={"resources": spec.resources.model_copy(update={"share_base": False})}), job_id="own")
    own.rollout(1)
    batch = own.sampler.batch(1)
    base, tokenizer = load_model("tiny-random")
    shared = SharedBase(base, tokenizer, "tiny-random")
    lora = spec.adapter
    model = shared.add_job("job/-/shared", lora.r, lora.alpha, lora.target_modules, lora.dropout, spec.seed)
    hosted = RLJob(spec, job_id="shared", model=model, tokenizer=tokenizer)
    state = own.policy.trainer.trainable_state()
    assert sorted(state) == sorted(hosted.policy.trainer.trainable_state())  # peft's names: one checkpoint layout
    with torch.no_grad():
        for p in model.parameters():  # B starts at zero: give both the same nonzero adapter
            p.copy_(torch.randn_like(p) * 0.05)
    own.policy.trainer.load_trainable_state(hosted.policy.trainer.trainable_state())
    with model.using():
        mine = hosted.policy.update(batch)
    theirs = own.policy.update(batch)
    for key in ("update/policy_loss", "update/grad_norm", "update/ratio_mean", "update/tokens"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    after = own.policy.trainer.trainable_state()
    for name, tensor in hosted.policy.trainer.trainable_state().items():
        torch.testing.assert_close(tensor, after[name], rtol=1e-4, atol=1e-6)


def test_two_hosted_jobs_sample_in_shared_batches_train_and_checkpoint_as_peft(tmp_path):
    from opentinker.backend.primitives import BadRequest
    from opentinker.backend.rollout import score_tokens
    from opentinker.model.policy import load_policy
    from opentinker.orchestration.base_worker import BaseModelWorker, adapter_name

    worker = BaseModelWorker(num_gpus=0, idle_s=3600)
    specs = {name: _spec(tmp_path, seed=seed) for name, seed in (("ann", 1), ("bob", 2))}
    keys = {name: worker.host_job(spec, name, "tenant-" + name)["key"] for name, spec in specs.items()}
    assert keys == {name: adapter_name(name, "tenant-" + name) for name in specs}
    with pytest.raises(ValueError, match="job ann is hosted here already"):
        worker.host_job(specs["ann"], "ann", "tenant-ann")
    other = worker.host_job(specs["ann"], "ann", "tenant-bob")["key"]  # the same job id of another tenant is another job
    worker.drop_job(other)
    shared = worker.bases.base("tiny-random")
    shared.memory_bytes = shared.base_bytes() + 1  # full: a job is refused with the numbers, and leaves nothing behind
    with pytest.raises(BadRequest, match=r"^adapter\.r 8: this job's adapter needs \d+ MiB .* or when another job has ended$"):
        worker.host_job(specs["ann"], "carl", "tenant-carl")
    shared.memory_bytes = None
    info = worker.info()
    assert info["jobs"] == sorted(keys.values()) and sorted(info["adapters"]["tiny-random"]) == sorted(keys.values())
    worker.bases.engines.engine("tiny-random").gather_s = 0.2  # the two rollouts below start together: one batch

    def steps(name):
        key = keys[name]
        worker.job_call(key, "restore")
        for step in (1, 2):
            played = worker.job_call(key, "rollout", step)
            assert played["rollout/response_tokens_mean"] <= specs[name].rollout.max_new_tokens  # the job's own limits hold
            metrics[name].append(worker.job_call(key, "update", step))
        refs[name] = worker.job_call(key, "checkpoint", 2)

    metrics, refs = {"ann": [], "bob": []}, {}
    threads = [threading.Thread(target=steps, args=(name,)) for name in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(m) == 2 and m[-1]["update/sequences"] > 0 for m in metrics.values())
    assert worker.info()["sampling"]["tiny-random"]["mixed"] >= 1  # rows of both jobs decoded in one batch
    assert worker.job_call(keys["ann"], "evaluate", 2).metrics["eval/accuracy"] >= 0.0

    # The checkpoint is a peft LoRA checkpoint: it loads (merged) on a base of its own and scores
    # a completion as the hosted adapter does on the shared base.
    model, _, _ = load_policy(refs["ann"].url)
    hosted = worker.jobs[keys["ann"]]
    prompt, tokens = [5, 6, 7, 8], [9, 10, 11]
    with hosted.model.using():
        on_shared = score_tokens(hosted.model.lm, hosted.job.policy.placement, prompt, tokens)
    alone = score_tokens(model, hosted.job.policy.placement, prompt, tokens)
    assert on_shared == pytest.approx(alone, abs=1e-4)
    assert refs["ann"].url.split("/")[-2] == "ann" and refs["bob"].url.split("/")[-2] == "bob"

    worker.drop_job(keys["ann"])
    assert worker.info()["jobs"] == [keys["bob"]] and worker.info()["adapters"]["tiny-random"] == [keys["bob"]]
    with pytest.raises(KeyError):
        worker.job_call(keys["ann"], "rollout", 3)
    with pytest.raises(ValueError, match="no such job call: close"):
        worker.job_call(keys["bob"], "close")
    worker.drop_job(keys["bob"])
    assert worker.info()["adapters"]["tiny-random"] == [] and worker.bases.engines.engine("tiny-random").adapters == {}
    worker.server.stop()
    worker.bases.close()


def test_a_hosted_jobs_samples_are_its_own_whoever_shares_the_worker_and_resume_from_its_checkpoint(tmp_path):
    """Isolation of the random draws: a hosted job samples from its own generator (seeded with its
    seed), so its episodes are the same alone on the worker and in mixed batches with another
    job's; its checkpoint keeps that generator (not the worker's, which it neither reseeds nor
    draws from), so a job resumed on the worker samples what it would have sampled uninterrupted."""
    from opentinker.orchestration.base_worker import BaseModelWorker

    worker = BaseModelWorker(num_gpus=0, idle_s=3600)
    engine = worker.bases.engines.engine("tiny-random")
    spec = _spec(tmp_path / "a", seed=1, rollout={"temperature": 1.0})
    tokens = lambda key, step: [t.token_ids for t in worker.jobs[key].job.sampler.batch(step).trajectories]  # noqa: E731

    key = worker.host_job(spec, "ann", "tenant-ann")["key"]
    worker.job_call(key, "restore")
    torch.manual_seed(0)
    global_rng = torch.get_rng_state()
    worker.job_call(key, "rollout", 1)
    alone = {1: tokens(key, 1)}
    worker.job_call(key, "update", 1)
    worker.job_call(key, "checkpoint", 1)
    worker.job_call(key, "rollout", 2)
    alone[2] = tokens(key, 2)
    assert torch.equal(torch.get_rng_state(), global_rng)  # the worker's generator: not drawn from, not reseeded
    worker.drop_job(key)

    key = worker.host_job(spec, "ann", "tenant-ann")["key"]  # resumed (the worker restarted it, say)
    assert worker.job_call(key, "restore").step == 1
    assert torch.equal(torch.get_rng_state(), global_rng)
    worker.job_call(key, "rollout", 2)
    assert tokens(key, 2) == alone[2]
    worker.drop_job(key)

    twin = worker.host_job(_spec(tmp_path / "b", seed=1, rollout={"temperature": 1.0}), "ann", "tenant-ann")["key"]
    other = worker.host_job(_spec(tmp_path / "c", seed=2, rollout={"temperature": 1.0}), "bob", "tenant-bob")["key"]
    engine.gather_s = 0.2  # the two rollouts below start together: one batch
    mixed_before = engine.mixed
    threads = [threading.Thread(target=worker.job_call, args=(k, "rollout", 1)) for k in (twin, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.mixed > mixed_before  # the twin's rows were decoded beside bob's
    assert tokens(twin, 1) == alone[1] and tokens(other, 1) != alone[1]
    worker.server.stop()
    worker.bases.close()


def test_a_hosted_job_whose_worker_died_fails_in_one_line_naming_the_worker_and_where_it_resumes(tmp_path):
    import ray

    from opentinker.orchestration.job import lost_cluster_line
    from opentinker.storage import checkpoint as ckpt

    spec = _spec(tmp_path)
    ref = ckpt.save_checkpoint(spec.checkpoint.base_url, "ann", 2, {"w": torch.zeros(1)}, {"state": {}, "param_groups": []},
                               {"env": {}}, tenant="tenant-ann")
    assert lost_cluster_line(ray.exceptions.ActorDiedError(), spec, "ann", "tenant-ann") == (
        "ActorDiedError: the base-model worker hosting it died (killed, out of memory, or its Ray node went away); "
        f"resubmit job ann to resume from step 2 ({ref.url})")


@pytest.mark.parametrize("overrides", [
    {"adapter": {"kind": "full"}},
    {"model": {"name": "tiny-random", "init_from": "file:///tmp/x"}},
    {"rollout": {"engine": "server"}},
    {"resources": {"share_base": True, "colocate": False}},
])
def test_a_job_that_cannot_share_a_base_is_refused_with_the_reason(tmp_path, overrides):
    data = {"resources": {"share_base": True}, **overrides}
    with pytest.raises(SpecError, match=r"resources.share_base: only a LoRA job on a plain base"):
        tiny_spec(tmp_path, **data)


def test_an_sft_job_that_asks_to_share_a_base_is_refused(tmp_path):
    from opentinker.sft.spec import parse_sft_spec

    with pytest.raises(SpecError, match=r"^<spec>: resources.share_base: an SFT job trains a model of its own"):
        parse_sft_spec({"model": {"name": "tiny-random"}, "data": {"path": str(tmp_path / "d.jsonl")}, "resources": {"share_base": True}})
