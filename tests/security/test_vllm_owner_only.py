"""Every vLLM server the runtime starts answers only its owner (opentinker/inference/vllm_guard.py),
attacked through a real vLLM server keyed as a job's own (the test session's pool): each route, the
dev ones that reload weights, pause and sleep the engine, SageMaker's `/invocations`, `/tokenize`,
`/metrics` and a route vLLM might add next, without the key and with another job's key; the key is
on no command line; the worker loads weights only from its job's folder; and a reload the trainer
did not make is named as tampering before its rollouts are trusted."""

from __future__ import annotations

import httpx
import psutil
import pytest
import torch

pytestmark = pytest.mark.timeout(600)

# (method, path, body): what the attacks of 2026-11-29 reached without a key, and more of vLLM's routes
ROUTES = [
    ("POST", "/collective_rpc", {"method": "load_policy_from", "args": ["/tmp/evil.safetensors"]}),
    ("POST", "/pause", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("POST", "/sleep", None), ("POST", "/wake_up", None), ("GET", "/is_sleeping", None),
    ("POST", "/invocations", {"model": "base", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/tokenize", {"model": "base", "prompt": "hi"}), ("POST", "/detokenize", {"model": "base", "tokens": [1]}),
    ("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/version", None), ("GET", "/ping", None),
    ("POST", "/v1/completions", {"model": "base", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/reset_prefix_cache", None), ("GET", "/server_info", None), ("GET", "/load", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}), ("GET", "/a-route-vllm-adds-next", None),
    ("GET", "/health/../v1/models", None), ("GET", "/health/", None),
]


@pytest.fixture(scope="module")
def keyed(vllm_pool, vllm_tiny_path):
    return vllm_pool.get(vllm_tiny_path, "merged")


def test_every_route_but_health_asks_for_the_owners_key(keyed):
    """No key, or another job's: 401 on every route and spelling, the engine neither paused nor asleep
    after; the bare health check answers; the owner's key opens them."""
    with httpx.Client(base_url=keyed.url, timeout=30, trust_env=False) as client:
        for key in (None, "another-jobs-key-" + "x" * 16, keyed.api_key[:-1]):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for method, path, body in ROUTES:
                reply = client.request(method, path, json=body, headers=headers)
                assert reply.status_code == 401, (key, path, reply.status_code, reply.text[:200])
        assert client.get("/health").status_code == 200
        owner = {"Authorization": f"Bearer {keyed.api_key}"}
        assert client.get("/is_paused", headers=owner).json() == {"is_paused": False}
        assert client.get("/is_sleeping", headers=owner).json() == {"is_sleeping": False}
        assert client.get("/v1/models", headers=owner).status_code == 200


def test_the_key_is_on_no_command_line(keyed):
    """`ps` shows every local user each process's command line: the key is in none of the server's."""
    group = psutil.Process(keyed._process.pid)
    processes = [group, *group.children(recursive=True)]
    assert len(processes) >= 2
    for process in processes:
        assert keyed.api_key not in " ".join(process.cmdline())


def test_the_worker_loads_weights_only_from_its_jobs_folder(keyed, vllm_tiny_path, tmp_path):
    """With the owner's key even: a file outside the job's weights folder, and a symlink in it to one
    outside, are refused, and the server's weights are untouched (its greedy answer the same)."""
    from safetensors.torch import save_file

    owner = {"Authorization": f"Bearer {keyed.api_key}"}
    evil = tmp_path / "evil.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(1)}, str(evil))
    link = keyed.weights_dir / "link.safetensors"
    link.symlink_to(evil)
    body = {"model": "base", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0}
    try:
        with httpx.Client(base_url=keyed.url, timeout=60, headers=owner, trust_env=False) as client:
            before = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            for path in (str(evil), str(link), str(keyed.weights_dir / ".." / "evil.safetensors")):
                reply = client.post("/collective_rpc", json={"method": "load_policy_from", "args": [path]})
                assert not reply.is_success, path
            assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
    finally:
        link.unlink()


def test_a_reload_the_trainer_did_not_make_is_named_as_tampering(keyed, vllm_tiny_path):
    """The engine syncs version 1 (verified); then someone holding the key reloads the same factors
    (so the probe would pass) without the sync's stamp: the check before its rollouts are trusted
    fails, saying the weights changed under the job, not that they are stale."""
    from safetensors.torch import save_file

    from opentinker.backend.device import cpu
    from opentinker.backend.rollout import score_tokens
    from opentinker.backend.server_engine import Probe, ServerRolloutEngine, SyncError
    from opentinker.core.spec import LoraSpec
    from opentinker.model import load_model, wrap_model
    from opentinker.model.adapters import lora_factors

    base, tok = load_model(vllm_tiny_path)
    model = wrap_model(base, LoraSpec(r=8, alpha=16))
    engine = ServerRolloutEngine(keyed.handle("merged", owned=False), 1e-4)
    probe = Probe(tok("a probe")["input_ids"], lambda p, t: score_tokens(model, cpu(), p, t))
    try:
        engine.sync_weights(1, lora_factors(model), probe)
        assert engine.verified() is not None
        foreign = keyed.weights_dir / "foreign.safetensors"
        save_file(lora_factors(model), str(foreign))
        reply = engine.client.post("/collective_rpc", json={"method": "load_policy_from", "args": [str(foreign)]})
        foreign.unlink()
        assert reply.is_success, reply.text
        with pytest.raises(SyncError, match=r"^the inference server's weights changed under the job: it serves a load this job did "
                                            r"not make \(version None, expected 1\); its rollouts are not trusted$"):
            engine.verified()
    finally:
        engine.close()
