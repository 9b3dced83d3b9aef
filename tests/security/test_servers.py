"""The servers a job uses or starts ask for its token; bodies are size-limited; completions are
capped; a tenant's queue is bounded; the client link cannot be used to reach another job, and
whatever comes through it costs episodes, never the job or the gateway."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import tiny_spec
from tests.games import GarbageGame, HangingGame, RaisingGame, ScriptedTurns

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def service(stack_env):
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, _ = stack_env
    deploy(settings)
    store = TenantStore(settings.state_dir / "tenants.json")
    yield settings, {name: store.create(name, rotate=True) for name in ("alice", "bob", "crowd")}


def _parked(settings, key, tmp_path) -> dict:
    config = tiny_spec(tmp_path).model_dump(mode="json")
    config.pop("env")
    config.pop("job_id")
    response = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False)
    assert response.status_code == 201, response.text
    return response.json()


def _cancel(settings, key, job_id) -> None:
    httpx.post(f"{settings.gateway_url}/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False)


# --- request bodies and tokens -----------------------------------------------------------------------

@pytest.mark.parametrize("size", [17 * 1024**2, 40 * 1024**2])
def test_oversized_bodies_get_413_at_the_gateway(service, size):
    settings, keys = service
    body = b'{"config": {"x": "' + b"a" * size + b'"}}'
    response = httpx.post(f"{settings.gateway_url}/v1/jobs", content=body, timeout=60, trust_env=False,
                          headers={"Authorization": f"Bearer {keys['alice']}", "Content-Type": "application/json"})
    assert response.status_code == 413 and "over the limit" in response.json()["detail"]
    chunked = httpx.post(f"{settings.gateway_url}/v1/jobs", content=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                         headers={"Authorization": f"Bearer {keys['alice']}", "Content-Type": "application/json"}, timeout=60,
                         trust_env=False)
    assert chunked.status_code == 413  # no Content-Length: counted as it streams in
    assert httpx.get(f"{settings.gateway_url}/v1/health", trust_env=False).status_code == 200


def test_an_environment_server_answers_only_its_tokens_and_small_bodies():
    import uvicorn

    from opentinker.env.remote import RemoteGameClass, RemoteGameError
    from opentinker.env.server import create_app
    from tests.stack_fixtures import free_ports

    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(create_app(ScriptedTurns, tokens=["otj_job"], max_request_bytes=4096),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer otj_other"}, {"Authorization": "otj_job"}):
            assert httpx.post(f"{url}/sessions", json={}, headers=headers).status_code == 401
        with pytest.raises(RemoteGameError, match="HTTP 401"):
            RemoteGameClass(url, retries=0, token="otj_wrong")().reset()
        game = RemoteGameClass(url, retries=0, token="otj_job")()
        assert game.reset() == "start 0"
        big = httpx.post(f"{url}/sessions", json={"game_kwargs": {"turns": 1, "pad": "a" * 10_000}},
                         headers={"Authorization": "Bearer otj_job"})
        assert big.status_code == 413
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_gateways_job_endpoint_takes_only_that_jobs_token(service, tmp_path):
    from opentinker.core.tokens import job_token

    settings, keys = service
    job = _parked(settings, keys["alice"], tmp_path)
    body = {"calls": [{"id": "x-1", "op": "generate", "rng_state": {}, "config": {}}], "timeout_s": 1}
    url = f"{settings.gateway_url}/v1/internal/jobs/{job['job_id']}/link"
    for token in (None, keys["alice"], job_token(settings.stack_secret(), "alice-other"), "otj_forged"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        assert httpx.post(url, json=body, headers=headers, trust_env=False).status_code == 401
    own = httpx.post(url, json=body, headers={"Authorization": f"Bearer {job['job_token']}"}, trust_env=False)
    assert own.status_code == 200 and "no client is linked" in own.text
    _cancel(settings, keys["alice"], job["job_id"])


def test_a_client_cannot_link_to_another_tenants_job(service, tmp_path):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    from opentinker.client.link import websocket_url

    settings, keys = service
    job = _parked(settings, keys["alice"], tmp_path)
    for key in (keys["bob"], "otk_wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with pytest.raises(InvalidStatus) as refused:  # the handshake itself is refused
            connect(websocket_url(settings.gateway_url, job["job_id"]), additional_headers=headers)
        assert refused.value.response.status_code == 403
    _cancel(settings, keys["alice"], job["job_id"])


# --- what comes through the link costs episodes ---------------------------------------------------------

def _linked(settings, job) -> object:
    from opentinker.env.linked import LinkedGameClass

    return LinkedGameClass(settings.gateway_url, job["job_id"], job["job_token"], "Game", timeout_s=3, link_timeout_s=5)


def test_malformed_frames_from_a_client_cost_calls_not_the_gateway(service, tmp_path):
    from websockets.sync.client import connect

    from opentinker.client.link import websocket_url
    from opentinker.env.remote import RemoteGameError

    settings, keys = service
    job = _parked(settings, keys["alice"], tmp_path)
    with connect(websocket_url(settings.gateway_url, job["job_id"]), additional_headers={"Authorization": f"Bearer {keys['alice']}"}) as socket:
        game = _linked(settings, job)()
        answered = []

        def hostile() -> None:
            frame = json.loads(socket.recv(timeout=10))
            call_id = frame["calls"][0]["id"]
            for junk in ("not json", json.dumps({"results": "nope"}), json.dumps({"results": [{"id": 5}, "x"]}),
                         json.dumps({"results": [{"id": call_id}]}), "\x00" * 1000):
                socket.send(junk)
            socket.send(json.dumps({"results": [{"id": call_id, "ok": {"observation": 5}}]}))  # garbage as an answer
            answered.append(call_id)

        threading.Thread(target=hostile, daemon=True).start()
        with pytest.raises((RemoteGameError, KeyError, TypeError)):
            game.reset()
        assert answered
        with pytest.raises(RemoteGameError, match="did not answer within 3s"):
            _linked(settings, job)().reset()  # the client ignores it: the call times out, nothing hangs
    assert httpx.get(f"{settings.gateway_url}/v1/health", trust_env=False).status_code == 200
    _cancel(settings, keys["alice"], job["job_id"])


def test_a_raising_hanging_or_garbage_game_costs_its_episodes(service, tmp_path):
    from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams
    from opentinker.client.link import EnvironmentLink
    from opentinker.core.model_names import TINY
    from opentinker.model import load_model

    settings, keys = service
    model, tokenizer = load_model(TINY)
    engine, chat = HFRolloutEngine(model, tokenizer), ChatFormat(tokenizer)
    limits = EpisodeLimits(max_turns=2, max_total_tokens=256, step_timeout_s=4)
    for game_class, reason in ((RaisingGame, "RuntimeError: environment bug"), (HangingGame, "did not answer within 3s"),
                               (GarbageGame, "expected StepResult")):
        job = _parked(settings, keys["alice"], tmp_path / game_class.__name__)
        link = EnvironmentLink(settings.gateway_url, keys["alice"], job["job_id"], game_class).open()
        try:
            cls = _linked(settings, job)
            trajs = run_episodes(engine, chat, [cls() for _ in range(4)], [{"id": i} for i in range(4)],
                                 SamplingParams(max_new_tokens=4), limits)
        finally:
            link.close()
        assert all(t.failed and reason in t.failure for t in trajs), [t.failure for t in trajs]
        _cancel(settings, keys["alice"], job["job_id"])
    assert httpx.get(f"{settings.gateway_url}/v1/health", trust_env=False).status_code == 200


# --- a tenant's queue ------------------------------------------------------------------------------------

def test_a_tenants_waiting_jobs_are_bounded_with_the_numbers(service, tmp_path):
    settings, keys = service
    limit = settings.tenant_max_queued
    jobs = [_parked(settings, keys["crowd"], tmp_path / str(i))["job_id"] for i in range(limit)]
    config = tiny_spec(tmp_path).model_dump(mode="json")
    response = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config}, trust_env=False, timeout=60,
                          headers={"Authorization": f"Bearer {keys['crowd']}"})
    assert response.status_code == 429
    assert response.json()["detail"] == f"tenant crowd has {limit} jobs waiting, the limit is {limit}: wait for some to start or cancel them"
    other = _parked(settings, keys["bob"], tmp_path / "bob")  # another tenant is not affected
    for job_id in jobs:
        _cancel(settings, keys["crowd"], job_id)
    _cancel(settings, keys["bob"], other["job_id"])
