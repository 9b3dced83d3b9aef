"""A served completion is as long as its request asks, up to the server's stated cap: the HF server
once built its sampling parameters without a length, and every answer ended at SamplingParams'
default of 24 tokens (`finish_reason: length`) whatever `max_tokens` said. The tiny random model
is served with its end-of-sequence tokens off, so every completion runs its whole budget and
its length is the budget the server gave it."""

from __future__ import annotations

import httpx
import pytest

CAP = 210  # the server's stated cap, and the length of a completion that asks none


@pytest.fixture(scope="module")
def hf_server():
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread
    from opentinker.model.loading import load_base

    model, tokenizer = load_base("tiny-random")
    engine = HFEngine(model, tokenizer)
    engine.rollout.stop_ids = []  # no end-of-sequence token: a completion ends at its budget
    running = serve_in_thread(create_app(engine, "policy", api_key="k", max_tokens_cap=CAP), "127.0.0.1", 0, model="policy",
                              close=engine.close)
    yield running
    running.stop()


def test_the_hf_server_answers_as_many_tokens_as_asked(hf_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{hf_server.url}/v1", api_key="k")
    messages = [{"role": "user", "content": "Tell me a long story."}]
    chat = client.chat.completions.create(model="policy", messages=messages, max_tokens=200, temperature=0)
    assert chat.usage.completion_tokens == 200 and chat.choices[0].finish_reason == "length"
    newer = client.chat.completions.create(model="policy", messages=messages, max_completion_tokens=30, temperature=0)
    assert newer.usage.completion_tokens == 30
    text = client.completions.create(model="policy", prompt=["Once upon a time", "The cat"], max_tokens=30, temperature=0.8, seed=1)
    assert text.usage.completion_tokens == 2 * 30 and {c.finish_reason for c in text.choices} == {"length"}
    stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=200, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 200
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content


def test_the_cap_is_the_default_and_the_limit(hf_server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{hf_server.url}/v1", api_key="k")
    unasked = client.completions.create(model="policy", prompt="Once upon a time", temperature=0)
    assert unasked.usage.completion_tokens == CAP  # a request without max_tokens gets the server's cap
    with pytest.raises(BadRequestError, match=f"max_tokens: {CAP + 1} is over this server's limit of {CAP}"):
        client.completions.create(model="policy", prompt="Once upon a time", max_tokens=CAP + 1)
    response = httpx.post(f"{hf_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 0}, headers={"Authorization": "Bearer k"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_a_job_whose_server_cuts_its_turns_short_says_so_in_its_log(vllm_pool, vllm_tiny_path, tmp_path, caplog):
    """A job samples through a vLLM server whose own cap on a completion (its generation config's
    `max_new_tokens`, as `opentinker serve` sets from `max_tokens_cap`) is below the spec's
    `max_new_tokens`: vLLM cuts every turn there and answers `finish_reason: length`, as if the job
    had asked for it. The job goes on, and its log says what happened, once."""
    import json
    import logging

    import torch

    from opentinker.inference.engine_vllm import VLLMServer, merged_server_args
    from opentinker.inference.launch import free_port
    from opentinker.rl import RLJob
    from tests.conftest import tiny_spec

    vllm_pool.room()  # memory for this server
    workdir = tmp_path / "server"
    workdir.mkdir()
    args, env = merged_server_args(vllm_tiny_path, None, "float32", workdir, vllm_tiny_path)
    server = VLLMServer(args + ["--override-generation-config", json.dumps({"max_new_tokens": 3})], "127.0.0.1", free_port("127.0.0.1"),
                        vllm_tiny_path, workdir, num_gpus=int(torch.cuda.is_available()), env=env, api_key="k")
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path}, optimization={"steps": 1},
                     rollout={"engine": "vllm", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8})
    job = RLJob(spec, job_id="cut-short", start_server=lambda *_: server.handle("merged"))
    try:
        with caplog.at_level(logging.WARNING, logger="opentinker.backend.server_engine"):
            result = job.run()
    finally:
        job.close()
    assert result.steps_done == 1 and result.history[0]["rollout/turns_cut_by_server"] > 0
    warnings = [r.getMessage() for r in caplog.records if "short of the" in r.getMessage()]
    assert len(warnings) == 1 and "ended a turn at 3 tokens, short of the 8 asked" in warnings[0], warnings
