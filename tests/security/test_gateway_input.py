"""The gateway keeps the connection usable after any error, and answers a NUL, a control character or
an over-long string in any field with a 422 naming the field: each attack really sent over HTTP to a
running gateway (create_app under uvicorn, as the stack runs it; no Prefect behind it, so nothing here
may need one: every refusal comes before the scheduler is asked anything).

Every answer is checked to be one short line of JSON (`detail`) that names the field and does not
echo what was sent, and the keep-alive connection the attack came on to be the one the next request
is answered on.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)


class _BrokenSessions:
    """Tinker sessions whose every call fails unforeseen: a route of the gateway that raises."""

    def create(self, tenant, body):
        raise RuntimeError("the session store broke\nits second line stays in the log")

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    from opentinker.control.gateway.app import create_app
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.core.settings import Settings
    from opentinker.inference.server import serve_in_thread

    root = tmp_path_factory.mktemp("gateway-input")
    settings = Settings(state_dir=root / "state", host="127.0.0.1")
    key = TenantStore(settings.state_dir / "tenants.json").create("mallory")
    server = serve_in_thread(create_app(settings, tinker_sessions=_BrokenSessions()), "127.0.0.1", 0)
    yield SimpleNamespace(url=server.url, key=key, settings=settings)
    server.stop()


@pytest.fixture
def client(gw):
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {gw.key}"}, timeout=30, trust_env=False) as http:
        yield http


def _port(response: httpx.Response) -> int:
    """The client's local port: which TCP connection the response came on."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def _one_line(response: httpx.Response, status: int, starts: str) -> str:
    assert response.status_code == status, response.text[:500]
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and len(response.content) < 600, response.text[:500]
    assert detail.startswith(starts), detail
    return detail


def _spec(**sections) -> dict:
    spec = {"model": {"name": "tiny-random"}, "env": {"game": "envs.toy:UppercaseGame"}}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def test_after_a_server_error_the_same_connection_answers_the_next_request(client, gw, caplog):
    first = client.get("/v1/health")
    with caplog.at_level("ERROR", logger="opentinker.gateway"):
        broken = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": gw.key})
    detail = _one_line(broken, 500, "RuntimeError: the session store broke")
    assert "second line" not in detail and "Traceback" not in broken.text
    assert "second line" in caplog.text and "Traceback" in caplog.text  # the rest goes to the log
    after = client.get("/v1/whoami")  # the same client, the same keep-alive connection: not reset
    assert after.status_code == 200 and after.json()["tenant"] == "mallory"
    assert _port(first) == _port(broken) == _port(after)
    for _ in range(3):  # and again: errors do not wear the connection out
        client.post("/api/v1/create_session", json={}, headers={"X-API-Key": gw.key})
    assert client.get("/v1/health").status_code == 200


@pytest.mark.parametrize("sections,field,reason", [
    ({"model": {"name": "tiny\x00random"}}, "model.name", "contains a control character (U+0000 at position 4)"),
    ({"model": {"name": "a" * 10_000}}, "model.name", "10000 characters, more than the 2048 a field may hold"),
    ({"model": {"name": "m" * 300}}, "model.name", "'mmm"),  # past NAME_MAX: a plain refusal, not the file system's error
    ({"model": {"name": "tiny-random\n"}}, "model.name", "contains a control character (U+000A"),
    ({"model": {"init_from": "run/\x00"}}, "model.init_from", "contains a control character (U+0000"),
    ({"env": {"game": "envs.toy:Uppercase\x00Game"}}, "env.game", "contains a control character (U+0000"),
    ({"env": {"game": "envs." + "g" * 5000 + ":G"}}, "env.game", "5007 characters, more than the 2048"),
    ({"env": {"url": "http://example.com/\x00"}}, "env.url", "contains a control character (U+0000"),
    ({"env": {"config": {"data_path": "d\x00"}}}, "env.config.data_path", "contains a control character (U+0000"),
    ({"env": {"config": {"k\x00ey": 1}}}, "env.config", "a key contains a control character (U+0000"),
    ({"storage": {"base_url": "file:///tmp/\x00"}}, "storage.base_url", "contains a control character (U+0000"),
    ({"registry": {"model_name": "r" * 3000}}, "registry.model_name", "3000 characters"),
    ({"adapter": {"kind": "lora", "target_modules": ["q_proj", "\x00"]}}, "adapter.target_modules[1]", "contains a control character"),
])
def test_a_bad_string_in_any_field_of_a_spec_is_a_422_naming_it(client, sections, field, reason):
    first = client.get("/v1/health")
    response = client.post("/v1/jobs", json={"config": _spec(**sections)})
    detail = _one_line(response, 422, f"{field}: ")
    assert reason in detail and "a" * 3000 not in detail and "g" * 3000 not in detail and "r" * 3000 not in detail
    assert _port(client.get("/v1/health")) == _port(first)


def test_a_job_id_or_an_unknown_key_cannot_smuggle_a_nul(client):
    _one_line(client.post("/v1/jobs", json={"config": {**_spec(), "job_id": "j\x00"}}), 422, "job_id: ")
    detail = _one_line(client.post("/v1/jobs", json={"config": {**_spec(), "x" * 5000: 1}}), 422, "<spec>: a key 5000 characters")
    assert "x" * 100 not in detail


def test_other_bodies_paths_and_queries_refuse_them_too(client):
    for model_path, reason in (("ckpt\x00", "contains a control character (U+0000"), ("c" * 10_000, "at most 2048 characters")):
        detail = _one_line(client.post("/v1/inference", json={"model_path": model_path}), 422, "model_path: ")
        assert reason in detail
    detail = _one_line(client.post("/v1/jobs/mallory-x/start", json={"env": {"game": "envs.toy:Upper\x00"}}), 422, "env.game: ")
    assert "U+0000" in detail  # refused before the job is even looked up
    _one_line(client.post("/v1/jobs/mallory-x%00/start", json={"env": {}}), 422, "job_id: ")
    _one_line(client.get("/v1/jobs/" + "j" * 1000), 422, "job_id: ")
    _one_line(client.get("/v1/jobs/mallory-x/artifacts", params={"path": "a\x01b"}), 422, "path: ")
    _one_line(client.get("/v1/jobs/mallory-x/artifacts", params={"path": "p" * 5000}), 422, "path: ")


def test_big_deep_or_malformed_bodies_get_one_line_and_nothing_echoed(client):
    from opentinker.core.spec_limits import MAX_SPEC_BYTES

    first = client.get("/v1/health")
    big = _spec(env={"config": {"note": "n" * (MAX_SPEC_BYTES + 1)}})
    detail = _one_line(client.post("/v1/jobs", json={"config": big}), 422, "env.config.note: 256 KB, more than the 256 KB a spec may hold")
    assert "nnnn" not in detail
    many = _spec(env={"config": {"rows": [{"q": "x" * 100}] * 5000}})  # no single big value: the part that holds it is named
    _one_line(client.post("/v1/jobs", json={"config": many}), 422, "env.config.rows: ")
    deep = "[" * 500 + "]" * 500
    _one_line(client.post("/v1/jobs", content=f'{{"config": {{"model": {{"name": "tiny-random"}}, "env": {{"config": {{"x": {deep}}}}}}}}}',
                          headers={"Content-Type": "application/json"}), 422, "env.config.x...: nested more than 64 levels deep")
    deeper = "[" * 100_000 + "]" * 100_000  # past the JSON parser's own depth
    response = client.post("/v1/jobs", content=f'{{"config": {deeper}}}', headers={"Content-Type": "application/json"})
    assert response.status_code in (400, 422) and len(response.content) < 600
    detail = _one_line(client.post("/v1/jobs", json={"config": "s" * 100_000}), 422, "config: Input should be a valid dictionary")
    assert "sss" not in detail  # FastAPI's default answer would have held all 100,000 of them
    _one_line(client.post("/v1/jobs", content=b'{"config": ', headers={"Content-Type": "application/json"}), 422, "body: not JSON")
    assert _port(client.get("/v1/health")) == _port(first)
