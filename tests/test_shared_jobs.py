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

from opentinker.core.polling import wait_for
from opentinker.core.spec import SpecError
from tests.conftest import tiny_spec
from tests.rounding import PASS, TINY_LOGPROB, logprob_gap, same_adam_step, same_logprobs, same_metric, same_update_metrics, update_bounds


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
    bounds = update_bounds(own.policy.trainer, batch.trajectories)
    theirs = own.policy.update(batch)
    # the shared base's adapter against peft's: the same sums in other orders (tests/rounding.py)
    assert same_update_metrics(mine, theirs, bounds) and mine["update/tokens"] == theirs["update/tokens"]
    assert mine["update/grad_norm"] == pytest.approx(theirs["update/grad_norm"], rel=PASS)
    after = own.policy.trainer.trainable_state()
    for name, tensor in hosted.policy.trainer.trainable_state().items():
        assert same_adam_step(tensor, after[name], bounds.grads[name], lr=spec.optimization.lr), name


def test_a_hosted_update_runs_in_passes_of_bounded_tokens_and_takes_the_same_step(tmp_path):
    """A job on a shared base: whatever its micro-batch size, each forward/backward of its update
    holds at most SHARED_PASS_TOKENS padded tokens (the base's memory is every tenant's: a huge
    micro-batch of one tenant would take it from all); the step is that of whole micro-batches."""
    from opentinker.backend.shared_base import SharedBase
    from opentinker.core.spec_limits import SHARED_PASS_TOKENS
    from opentinker.model import load_model
    from opentinker.rl import RLJob

    optimization = {"lr": 1e-2, "steps": 4, "micro_batch_size": 64, "shared_prefix": False}
    spec = _spec(tmp_path, optimization=optimization)
    own = RLJob(tiny_spec(tmp_path, optimization=optimization), job_id="own")
    own.rollout(1)
    batch = own.sampler.batch(1)
    records = [t for t in batch.trajectories if not t.failed and t.num_sampled]
    base, tokenizer = load_model("tiny-random")
    shared = SharedBase(base, tokenizer, "tiny-random")
    lora = spec.adapter
    jobs = {name: RLJob(spec, job_id=name, model=shared.add_job(f"job/-/{name}", lora.r, lora.alpha, lora.target_modules, lora.dropout,
                                                                 spec.seed), tokenizer=tokenizer) for name in ("bounded", "whole")}
    assert jobs["bounded"].policy.trainer.pass_tokens == SHARED_PASS_TOKENS and own.policy.trainer.pass_tokens is None
    state = {k: torch.randn_like(v) * 0.05 for k, v in jobs["bounded"].policy.trainer.trainable_state().items()}
    budget = 3 * max(len(t) for t in records)  # this test's records are short: a bound that cuts them into several passes
    jobs["bounded"].policy.trainer.pass_tokens, jobs["whole"].policy.trainer.pass_tokens = budget, None
    shapes: dict[str, list[tuple[int, int]]] = {}
    metrics = {}
    for name, job in jobs.items():
        trainer = job.policy.trainer
        trainer.load_trainable_state(state)
        if name == "whole":
            with job.policy.model.using():
                bounds = update_bounds(trainer, batch.trajectories)
        loss, shapes[name] = trainer._loss, []
        trainer._loss = lambda b, *a, _loss=loss, _seen=shapes[name], **k: (_seen.append(tuple(b.input_ids.shape)), _loss(b, *a, **k))[1]
        with job.policy.model.using():
            metrics[name] = job.policy.update(batch)
    assert shapes["whole"] == [(len(records), max(len(t) for t in records))]
    assert len(shapes["bounded"]) > 1 and sum(rows for rows, _ in shapes["bounded"]) == len(records)
    assert all(rows * width <= budget for rows, width in shapes["bounded"])
    # passes of bounded tokens against whole micro-batches: the same sums in other orders (tests/rounding.py)
    assert same_update_metrics(metrics["bounded"], metrics["whole"], bounds)
    assert metrics["bounded"]["update/tokens"] == metrics["whole"]["update/tokens"]
    assert metrics["bounded"]["update/grad_norm"] == pytest.approx(metrics["whole"]["update/grad_norm"], rel=PASS)
    after = jobs["whole"].policy.trainer.trainable_state()
    for name, tensor in jobs["bounded"].policy.trainer.trainable_state().items():
        assert same_adam_step(tensor, after[name], bounds.grads[name], lr=optimization["lr"]), name


def test_a_hosted_jobs_lora_dropout_applies_in_its_own_training_passes_only():
    """The shared base stays in eval mode (it is every tenant's); a job's trainer puts its own
    adapter in training mode, so the job's passes apply its LoRA dropout as a peft job's do, while
    its sampling (eval) and every other tenant's passes stay exact."""
    from opentinker.backend.shared_base import SharedBase
    from opentinker.model import load_model

    base, tokenizer = load_model("tiny-random")
    shared = SharedBase(base, tokenizer, "tiny-random")
    a, b = (shared.add_job(name, 8, 16, ["q_proj", "v_proj"], 0.5, seed) for name, seed in (("a", 1), ("b", 2)))
    with torch.no_grad():
        for p in [*a.parameters(), *b.parameters()]:
            p.copy_(torch.randn_like(p) * 0.1)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    exact = {name: logits(model) for name, model in (("a", a), ("b", b))}
    a.train()
    assert not torch.allclose(logits(a), exact["a"])  # its dropout applies
    assert torch.equal(logits(b), exact["b"]) and not shared.lm.training  # the neighbour and the base are untouched
    a.eval()
    assert torch.equal(logits(a), exact["a"])


def test_two_hosted_jobs_sample_in_shared_batches_train_and_checkpoint_as_peft(base_worker, tmp_path):
    from opentinker.backend.primitives import BadRequest
    from opentinker.backend.rollout import score_tokens
    from opentinker.model.policy import load_policy
    from opentinker.orchestration.base_worker import adapter_name

    worker = base_worker()
    specs = {name: _spec(tmp_path, seed=seed) for name, seed in (("ann", 1), ("bob", 2))}
    keys = {name: worker.host_job(spec, name, "tenant-" + name)["key"] for name, spec in specs.items()}
    assert keys == {name: adapter_name(name, "tenant-" + name) for name in specs}
    with pytest.raises(ValueError, match=r"^job ann is hosted here already, and its run made a call in the last 60 s"):
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
    assert same_logprobs(on_shared, alone)  # the adapter beside the base against merged into it: other orders
    assert refs["ann"].url.split("/")[-2] == "ann" and refs["bob"].url.split("/")[-2] == "bob"

    worker.drop_job(keys["ann"])
    assert worker.info()["jobs"] == [keys["bob"]] and worker.info()["adapters"]["tiny-random"] == [keys["bob"]]
    with pytest.raises(LookupError, match="^job ann is not hosted on this base-model worker"):
        worker.job_call(keys["ann"], "rollout", 3)
    with pytest.raises(ValueError, match="no such job call: close"):
        worker.job_call(keys["bob"], "close")
    worker.drop_job(keys["bob"])
    assert worker.info()["adapters"]["tiny-random"] == [] and worker.bases.engines.engine("tiny-random").adapters == {}
    worker.server.stop()
    worker.bases.close()


def test_a_hosted_jobs_samples_are_its_own_whoever_shares_the_worker_and_resume_from_its_checkpoint(base_worker, tmp_path):
    """Isolation of the random draws: a hosted job samples from its own generator (seeded with its
    seed), so its episodes are the same alone on the worker and in mixed batches with another
    job's; its checkpoint keeps that generator (not the worker's, which it neither reseeds nor
    draws from), so a job resumed on the worker samples what it would have sampled uninterrupted."""

    worker = base_worker()
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


def test_a_hosted_job_with_lora_dropout_resumes_drawing_the_masks_it_would_have_drawn(base_worker, tmp_path):
    """A hosted adapter draws its LoRA dropout masks from a generator of its own (not the process's,
    which every tenant draws from): its checkpoints keep that generator beside the sampling one, so
    a job resumed on the worker takes the update it would have taken uninterrupted (with the
    generator reseeded on resume, its masks, and so its weights, would differ)."""

    worker = base_worker()
    spec = _spec(tmp_path, adapter={"kind": "lora", "r": 8, "alpha": 16, "dropout": 0.3}, rollout={"temperature": 1.0})
    adapter = lambda key: {n: p.detach().clone() for n, p in worker.jobs[key].model.named_parameters()}  # noqa: E731

    key = worker.host_job(spec, "ann", "tenant-ann")["key"]
    worker.job_call(key, "restore")
    for step in (1, 2):
        worker.job_call(key, "rollout", step)
        worker.job_call(key, "update", step)
        if step == 1:
            worker.job_call(key, "checkpoint", 1)
    uninterrupted = adapter(key)
    worker.drop_job(key)

    key = worker.host_job(spec, "ann", "tenant-ann")["key"]  # resumed: a new adapter, seeded as at the start
    assert worker.job_call(key, "restore").step == 1
    worker.job_call(key, "rollout", 2)
    worker.job_call(key, "update", 2)
    resumed = adapter(key)
    # equal up to the float noise of decode batches that episodes join at their own moments (a reseeded
    # dropout generator would draw other masks: differences of the size of the update itself)
    assert all(torch.allclose(resumed[n], uninterrupted[n], rtol=1e-4, atol=1e-6) for n in uninterrupted)
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


def test_a_shared_sft_batch_runs_in_bounded_passes_with_the_same_result(base_worker, tmp_path, chats, monkeypatch):
    """A tenant's batch size must not decide how much of the shared base's memory one pass takes: a
    batch runs as passes of at most SHARED_PASS_TOKENS padded tokens, gradients accumulated. With a
    budget of ~two examples a pass, the job's losses and adapter are those of whole-batch passes;
    an example longer than the budget is refused at submission."""
    from opentinker.sft import shared
    from opentinker.sft.spec import SHARED_PASS_TOKENS, parse_sft_spec

    worker = base_worker()
    whole_key = worker.host_sft(_sft_spec(tmp_path / "whole", chats), "sft", "tenant-a")["key"]
    whole = _train(worker, whole_key)
    whole_weights = {n: p.detach().clone() for n, p in worker.jobs[whole_key].model.named_parameters()}
    worker.drop_job(whole_key)

    longest = max(len(ids) for ids, _ in shared.SharedSFT(_sft_spec(tmp_path / "probe", chats), "probe", None,
                                                          worker.bases.base("tiny-random").add_job("probe", 8, 16, ["q_proj"], 0.0, 0)).train_rows)
    monkeypatch.setattr(shared, "SHARED_PASS_TOKENS", 2 * longest)
    rows = [(list(range(n)), [1] * n) for n in (longest, longest, 3, longest)]
    assert [len(p) for p in shared.SharedSFT.passes(rows)] == [2, 2]  # 2 rows x the longest fit; a third would not
    split_key = worker.host_sft(_sft_spec(tmp_path / "split", chats), "sft", "tenant-a")["key"]
    split = _train(worker, split_key)
    assert split[0] == pytest.approx(whole[0], rel=1e-5)
    for mine, theirs in zip(split[1:-1], whole[1:-1], strict=True):
        assert mine["metrics"] == pytest.approx(theirs["metrics"], rel=1e-5)
    for name, tensor in worker.jobs[split_key].model.named_parameters():
        torch.testing.assert_close(tensor, whole_weights[name], rtol=1e-3, atol=1e-4)  # Adam turns float-order noise of near-zero gradients into lr-sized steps

    data = {"model": {"name": "tiny-random"}, "data": {"path": chats}, "resources": {"share_base": True},
            "training": {"max_length": SHARED_PASS_TOKENS + 1}}
    with pytest.raises(SpecError, match=rf"^<spec>: training.max_length: {SHARED_PASS_TOKENS + 1} tokens; on a shared base"):
        parse_sft_spec(data)


def test_a_hosted_job_whose_flow_died_is_replaced_by_its_next_run_or_taken_off_when_silent(base_worker, tmp_path, chats):
    """A job's flow process that dies (OOM-killed, say) leaves its adapter on the worker with nobody to
    take it off: the resubmitted job id was refused as "hosted here already" for ever, and the worker
    never went idle. Now a new run of the job replaces a hosting whose last call is over a minute old,
    and the worker's tick takes off a job silent for twice the heartbeat timeout; a call to it then
    says what happened in one line."""
    from opentinker.orchestration.base_worker import LEFTOVER_S

    worker = base_worker()
    spec = _sft_spec(tmp_path, chats)
    key = worker.host_sft(spec, "sft", "tenant-a")["key"]
    worker.job_call(key, "begin")
    first = worker.jobs[key]
    first.last_call -= LEFTOVER_S + 1  # its flow died a minute ago
    assert worker.host_sft(spec, "sft", "tenant-a")["key"] == key  # the resubmission is hosted
    assert worker.jobs[key] is not first and worker.bases.adapters()["tiny-random"].count(key) == 1
    assert worker.job_call(key, "begin")["sft/max_steps"] == 4  # the new run trains from its own start

    worker.jobs[key].last_call -= 2 * worker.settings.tinker_heartbeat_timeout_s + 1  # silent for too long
    # the tick takes the job out of `jobs` (no call can start on it) before its adapter leaves the base
    wait_for(lambda: (key not in worker.jobs and key not in worker.bases.adapters().get("tiny-random", [])) or None,
             interval=0.2, timeout=10, what="the tick taking it off")
    with pytest.raises(LookupError, match=r"^job sft is not hosted on this base-model worker \(taken off after 240 s without a call, "
                                          r"or by a new run of it\): resubmit it to resume from its last checkpoint$"):
        worker.job_call(key, "step")


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


def test_a_job_on_a_shared_base_cannot_compile_its_modules(tmp_path):
    with pytest.raises(SpecError, match=r"^<spec>: optimization.compile: a shared base's modules serve every tenant's adapter"):
        tiny_spec(tmp_path, resources={"share_base": True}, optimization={"compile": True})
    assert tiny_spec(tmp_path, optimization={"compile": True}).optimization.compile


@pytest.mark.parametrize("overrides,kind", [
    ({"adapter": {"kind": "full"}}, "full"),
    ({"model": {"name": "tiny-random", "init_from": "file:///tmp/x"}}, "init_from"),
    ({"training": {"gradient_checkpointing": True}}, "checkpointing"),
])
def test_an_sft_job_that_cannot_share_a_base_is_refused_with_the_reason(tmp_path, overrides, kind):
    from opentinker.sft.spec import parse_sft_spec

    data = {"model": {"name": "tiny-random"}, "data": {"path": str(tmp_path / "d.jsonl")}, "resources": {"share_base": True}, **overrides}
    with pytest.raises(SpecError, match=r"^<spec>: resources.share_base: only a LoRA job on a plain base \(no model.init_from\) "
                                        r"without training.gradient_checkpointing trains as an adapter"):
        parse_sft_spec(data)


# -- SFT jobs on a shared base ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> str:
    from opentinker.sft.game_chats import math_chats, write_jsonl

    path = tmp_path_factory.mktemp("sft-data") / "math.jsonl"
    write_jsonl(math_chats(16, seed=0, few_shot=0), str(path))
    return str(path)


def _sft_spec(tmp_path, data: str, share: bool = True, seed: int = 0):
    from opentinker.sft.spec import parse_sft_spec

    return parse_sft_spec({"model": {"name": "tiny-random"}, "adapter": {"kind": "lora", "r": 8, "alpha": 16},
                           "data": {"path": data, "eval_fraction": 0.25},
                           "training": {"epochs": 2, "lr": 2e-2, "batch_size": 4, "grad_accum": 2, "max_length": 256, "seed": seed},
                           "storage": {"base_url": f"file://{tmp_path}/runs"}, "resources": {"share_base": share}})


def _train(worker, key: str) -> list[dict]:
    """The flow's calls of a hosted SFT job: begin, steps until done, finish; every answer."""
    answers = [worker.job_call(key, "begin")]
    while not answers[-1].get("done"):
        answers.append(worker.job_call(key, "step"))
    return [*answers, worker.job_call(key, "finish", 1.0)]


def test_an_sft_job_on_a_shared_base_measures_as_trl_does_learns_and_checkpoints_as_peft(base_worker, tmp_path, chats):
    """Its loss before training is TRL's `evaluate` of the same examples (the adapter starts at zero,
    so both read the base: same tokens trained, same loss per token, same averaging); it learns, takes
    the steps an own job would, leaves the shared base as it was, and its checkpoint loads as a LoRA
    policy whose outputs are the hosted adapter's."""
    import math
    import tempfile

    from opentinker.model.policy import load_policy
    from opentinker.sft.job import SFTJob

    own = SFTJob(_sft_spec(tmp_path, chats, share=False), job_id="own")
    with tempfile.TemporaryDirectory() as out:
        trainer, rows = own._trainer(out, None, [])
        trl_before = own._measure(trainer, rows)

    worker = base_worker()
    key = worker.host_sft(_sft_spec(tmp_path, chats), "sft-a", "tenant-a")["key"]
    shared = worker.bases.base("tiny-random")
    frozen = {n: p.detach().clone() for n, p in shared.multi.model.named_parameters() if "lora" not in n.lower()}
    answers = _train(worker, key)
    begin, steps, result = answers[0], answers[1:-1], answers[-1]
    for name, value in trl_before.items():
        if name.endswith("/loss"):  # a mean of −log p over tokens, in TRL's order or ours: within the logprobs' gap
            assert same_metric(begin[name], value, 1.0, logprob_gap(TINY_LOGPROB)), name
        else:  # a token accuracy counts argmax hits: the same unless two logits tie within rounding
            assert begin[name] == value, name
    assert begin["sft/max_steps"] == own.max_steps == 4 == result["steps"] == len(steps)  # 12 examples, 4 a batch, 2 batches a step
    assert [a["step"] for a in steps] == [1, 2, 3, 4] and all(math.isfinite(a["metrics"]["sft/loss"]) for a in steps)
    assert steps[0]["metrics"]["sft/learning_rate"] == pytest.approx(2e-2)  # linear decay from the peak
    assert steps[-1]["metrics"]["sft/learning_rate"] == pytest.approx(2e-2 / 4)
    assert result["after"]["eval/loss"] < result["before"]["eval/loss"] - 0.1, result
    assert result["after"]["train_set/loss"] < result["before"]["train_set/loss"] - 0.1, result
    for name, tensor in shared.multi.model.named_parameters():  # the base every tenant reads is untouched
        if name in frozen:
            torch.testing.assert_close(tensor, frozen[name], rtol=0, atol=0)

    policy, _, info = load_policy(result["checkpoint"])
    assert info["adapter"]["kind"] == "lora" and info["init_from"] is None
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        hosted = worker.jobs[key].model(input_ids=ids).logits
        assert same_logprobs(policy(input_ids=ids).logits, hosted)  # merged against beside: other orders (tests/rounding.py)
    worker.drop_job(key)
    assert key not in worker.bases.adapters().get("tiny-random", [])


def test_an_sft_job_trains_the_same_whoever_shares_the_worker_and_a_rerun_reuses_its_checkpoint(base_worker, tmp_path, chats):
    """The same SFT job alone on a worker, and beside another tenant's SFT job whose steps interleave
    with its own (two threads, as two flows call): the same losses and the same adapter. Running the
    job id again with the same spec trains nothing and returns the saved result."""

    worker = base_worker()
    alone_key = worker.host_sft(_sft_spec(tmp_path / "alone", chats), "sft", "tenant-a")["key"]
    alone = _train(worker, alone_key)
    alone_weights = dict(worker.jobs[alone_key].model.named_parameters())
    alone_weights = {n: p.detach().clone() for n, p in alone_weights.items()}
    worker.drop_job(alone_key)

    keys = {"twin": worker.host_sft(_sft_spec(tmp_path / "twin", chats), "sft", "tenant-a")["key"],
            "other": worker.host_sft(_sft_spec(tmp_path / "other", chats, seed=5), "sft", "tenant-b")["key"]}
    answers: dict[str, list] = {}
    threads = [threading.Thread(target=lambda n=n: answers.__setitem__(n, _train(worker, keys[n]))) for n in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(answers) == {"twin", "other"}
    twin = answers["twin"]
    # a CPU's base runs one tenant's pass at a time (joint passes are a GPU's), so each of the twin's
    # passes is the very computation it runs alone: the same losses and adapter, bit for bit
    for mine, theirs in zip(twin[1:-1], alone[1:-1], strict=True):
        assert mine["metrics"] == theirs["metrics"], (mine, theirs)
    assert twin[-1]["after"] == alone[-1]["after"]
    for name, tensor in worker.jobs[keys["twin"]].model.named_parameters():
        assert torch.equal(tensor, alone_weights[name]), name
    assert answers["other"][-1]["after"] != twin[-1]["after"]  # another seed: another order and init

    for key in keys.values():
        worker.drop_job(key)
    again = worker.host_sft(_sft_spec(tmp_path / "alone", chats), "sft", "tenant-a")["key"]
    reused = _train(worker, again)
    assert reused[0] == {"reused": True, "done": True} and len(reused) == 2
    assert reused[-1]["reused"] and reused[-1]["checkpoint"] == alone[-1]["checkpoint"]


def test_an_idle_worker_built_in_process_closes_without_starting_ray(base_worker):
    """The idle exit kills the worker's own actor; a worker built in-process (as these tests build it)
    has none, so it closes and leaves Ray as it was (it once started a Ray instance at the end of a
    test session, whose process then hung)."""
    import ray

    before = ray.is_initialized()
    others = set(threading.enumerate())  # another test's worker may still be ticking its last second
    worker = base_worker(idle_s=0.2)
    tick = next(t for t in threading.enumerate() if t.name == "base-worker-tick" and t not in others)
    wait_for(lambda: worker.closing or None, interval=0.1, timeout=15, what="the idle worker to close")
    tick.join(timeout=30)
    assert not tick.is_alive()
    assert ray.is_initialized() == before
