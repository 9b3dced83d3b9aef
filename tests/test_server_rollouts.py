"""A job whose rollouts go through an inference server (`rollout.engine: server`), against our own
CPU server started by the job: it trains the math task, every sampled token's logprob is the
trainer's within the float32 tolerance, greedy records are the in-process engine's token for
token, and a resumed job puts its restored weights on the server (verified)."""

from __future__ import annotations

import pytest

from opentinker.agent import run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from tests.conftest import tiny_spec


def _spec(tmp_path, steps: int):
    return tiny_spec(tmp_path, rollout={"engine": "server", "max_new_tokens": 4}, optimization={"steps": steps},
                     evaluation={"every": 0, "n_samples": 8}, checkpoint={"every": 1})


@pytest.mark.slow  # a job learning through its own inference server (77 s); the adapter sync and its checks stay in the default run
def test_the_math_task_trains_through_the_jobs_own_server(tmp_path):
    """SmolLM2 on 1..20 addition (it answers some already, so the update has a signal), sampled
    through our server: each step's adapter verified there, every sampled logprob the trainer's
    within 1e-3, greedy episodes identical to the in-process engine's on the same weights."""
    from opentinker.core.spec import parse_spec
    from opentinker.inference.launch import rollout_server
    from opentinker.rl import RLJob

    spec = parse_spec({
        "model": {"name": "smollm2-135m-instruct"}, "adapter": {"kind": "lora", "r": 16, "alpha": 32},
        "rollout": {"engine": "server", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
        "optimization": {"lr": 2e-4, "steps": 2, "micro_batch_size": 16},
        "evaluation": {"every": 0, "n_samples": 1},  # evaluate() only puts the adapter on the server; the 8 tasks below compare
        "checkpoint": {"every": 1, "base_url": f"file://{tmp_path}"},
        "env": {"game": "envs.math:MathGame", "config": {"operations": ["+"], "val_size": 8}}, "seed": 0})
    job = RLJob(spec, job_id="via-server", start_server=rollout_server)
    sampler = job.sampler
    local = HFRolloutEngine(job.policy.model, job.policy.tokenizer, prefix_cache_tokens=0, placement=job.policy.placement)
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    rewards = []
    try:
        for step in range(2):
            metrics = job.rollout(step)
            rewards.append(metrics["rollout/reward_mean"])
            assert metrics["rollout/policy_version"] == step and sampler.engine.served == f"policy-v{step}"
            assert metrics["rollout/sync_logprob_gap"] < 1e-3
            trajs = [t for t in sampler.batch(step).trajectories if not t.failed]
            assert trajs and all(t.policy_version == step for t in trajs)
            recomputed = job.policy.trainer.logprobs(trajs)
            sampled = [[lp for lp, m in zip(t.sampling_logprobs, t.loss_mask) if m] for t in trajs]
            assert max(abs(a - b) for r, s in zip(recomputed, sampled) for a, b in zip(r, s)) < 1e-3
            assert job.update(step)["update/tokens"] > 0

            # Greedy (temperature 0): the server's records are the in-process engine's, token for token.
            tasks = sampler.env.validation_tasks(8)
            sampler.evaluate(step)  # puts the updated adapter on the server first (and plays one validation episode)
            via_server = run_episodes(sampler.engine, sampler.chat, [sampler.env.make_game() for _ in tasks], tasks, greedy, sampler.limits)
            in_process = run_episodes(local, sampler.chat, [sampler.env.make_game() for _ in tasks], tasks, greedy, sampler.limits)
            assert [t.token_ids for t in via_server] == [t.token_ids for t in in_process]
            assert [t.reward for t in via_server] == [t.reward for t in in_process]
        assert 0 < max(rewards) < 1  # a signal to learn from
        assert max(p.abs().max().item() for n, p in job.policy.model.named_parameters() if "lora_B" in n) > 0  # it trained
    finally:
        job.close()


def test_a_resumed_job_puts_its_restored_weights_on_the_server(tmp_path):
    from opentinker.inference.launch import rollout_server
    from opentinker.rl import RLJob

    first = RLJob(_spec(tmp_path, 2), job_id="resumed", start_server=rollout_server)
    try:
        first.run()
    finally:
        first.close()
    again = RLJob(_spec(tmp_path, 3), job_id="resumed", start_server=rollout_server)
    try:
        result = again.run()
        assert result.resumed_from == 2 and result.steps_done == 3
        assert again.sampler.engine.synced_version == 3 and again.sampler.engine.served == "policy-v3"
    finally:
        again.close()


def test_a_server_engine_job_needs_a_server_or_someone_to_start_one(tmp_path):
    from opentinker.rl import RLJob

    with pytest.raises(ValueError, match=r"rollout.engine: 'server' needs rollout.server_url"):
        RLJob(_spec(tmp_path, 1), job_id="no-server")


def test_server_engine_specs_are_checked(tmp_path):
    from opentinker.core.spec import SpecError, parse_spec

    base = {"model": {"name": "tiny-random"}, "env": {"game": "envs.math:MathGame"}}
    with pytest.raises(SpecError, match="adapter.kind 'full'"):
        parse_spec(base | {"adapter": {"kind": "full"}, "rollout": {"engine": "server"}})
    with pytest.raises(SpecError, match=r"rollout.server_url.*http"):
        parse_spec(base | {"rollout": {"engine": "server", "server_url": "file:///etc"}})
    with pytest.raises(SpecError, match="rollout.weight_sync: 'lora' moves a LoRA adapter; a full fine-tune"):
        parse_spec(base | {"adapter": {"kind": "full"}, "rollout": {"engine": "vllm", "weight_sync": "lora"}})
    assert parse_spec(base | {"adapter": {"kind": "full"}, "rollout": {"engine": "vllm"}}).rollout.engine == "vllm"
    assert parse_spec(base | {"rollout": {"engine": "vllm"}}).rollout.weight_sync == "auto"


def test_rollout_tokens_per_second_divide_by_the_time_requests_were_in_flight():
    """Requests overlap (a step's groups ask at once): the engine's seconds are the wall time with any
    request in flight, not the sum of each request's own time, which made `rollout/tokens_per_s`
    read 1-8 tok/s for steps that sampled 2,048 tokens in 1-2 s. Four concurrent calls, each
    answered after 0.4 s: the engine counts their overlap once, not the 1.6 s or more they add up to."""
    import asyncio
    import json
    import threading
    import time

    from opentinker.backend.server_engine import ServerHandle, ServerRolloutEngine
    from opentinker.inference.server import serve_in_thread

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        request = json.loads((await receive())["body"])
        await asyncio.sleep(0.4)
        choices = [{"index": i, "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "length"}
                   for i in range(len(request["prompt"]))]
        body = json.dumps({"model": request["model"], "choices": choices}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    running = serve_in_thread(app, "127.0.0.1", 0, model="base")
    engine = ServerRolloutEngine(ServerHandle(running.url, "base"), tolerance=1e-3)
    own: list[float] = []  # each call's own time

    def call() -> None:
        t = time.perf_counter()
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, greedy=True))
        own.append(time.perf_counter() - t)

    try:
        calls = [threading.Thread(target=call) for _ in range(4)]
        t0 = time.perf_counter()
        for thread in calls:
            thread.start()
        for thread in calls:
            thread.join()
        wall = time.perf_counter() - t0
    finally:
        engine.close()
        running.stop()
    assert engine.generated_tokens == 8 and len(own) == 4
    assert 0 < engine.generate_seconds <= wall and engine.generate_seconds < sum(own) / 2  # the overlap counted once
