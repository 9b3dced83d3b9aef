"""env.url may not reach the stack's own servers however its host is spelt: each spelling a tester
got past the old check (which compared host names) is attempted against the real gateway and
MLflow of the test stack, through the gateway (a 422 naming env.url), the worker (before its first
request) and the env client (at the connection, where a rebound name is caught); the same spellings
of a port that is not the stack's still reach an environment server on loopback."""

from __future__ import annotations

import socket

import httpx
import pytest

from opentinker.core.env_hosts import EnvHosts
from opentinker.core.settings import Settings, settings_env
from opentinker.env.confined_net import confined_client
from tests.conftest import tiny_spec
from tests.test_env_hosts import _rebinding, _served, _spec

pytestmark = pytest.mark.timeout(600)

SPELLINGS = ["[::ffff:127.0.0.1]", "0x7f000001", "127.1", "2130706433", "[::ffff:7f00:1]", "localhost.",  # the tester's
             "017700000001", "[::127.0.0.1]", "0", "0.0.0.0", "[::]", "LOCALHOST"]
OWN = "is one of this service's own servers, not an environment"


@pytest.fixture(scope="module")
def stack_key(stack):
    from opentinker.control.gateway.tenants import TenantStore

    settings, _ = stack
    return settings, TenantStore(settings.state_dir / "tenants.json").create("spelling", rotate=True)


@pytest.fixture
def as_the_stack(stack, monkeypatch):
    """This process's settings are the stack's (what a worker of it reads)."""
    settings, _ = stack
    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    return settings


def _port(settings, service: str) -> int:
    return {"gateway": settings.gateway_port, "mlflow": settings.mlflow_port}[service]


@pytest.mark.parametrize("service", ["gateway", "mlflow"])
@pytest.mark.parametrize("host", SPELLINGS)
def test_the_gateway_refuses_each_spelling_of_its_own_servers_with_one_line(stack_key, tmp_path, host, service):
    settings, key = stack_key
    url = f"http://{host}:{_port(settings, service)}"
    config = tiny_spec(tmp_path, env={"game": None, "url": url}).model_dump(mode="json")
    config.pop("job_id", None)
    response = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config}, headers={"Authorization": f"Bearer {key}"},
                          timeout=60, trust_env=False)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail.startswith(f"env.url: {url} (") and detail.endswith(OWN) and "\n" not in detail, detail


@pytest.mark.parametrize("service", ["gateway", "mlflow"])
@pytest.mark.parametrize("host", SPELLINGS)
def test_a_worker_refuses_each_spelling_before_its_first_request(as_the_stack, host, service):
    """A spec that reaches the worker without the gateway (`opentinker run`, an edited spec)."""
    from opentinker.env import environment_from_spec

    url = f"http://{host}:{_port(as_the_stack, service)}"
    with pytest.raises(ValueError) as refused:
        environment_from_spec(_spec(url), job_id="job-own")
    assert str(refused.value).startswith(f"env.url: {url} (") and str(refused.value).endswith(OWN)


@pytest.mark.parametrize("service", ["gateway", "mlflow"])
@pytest.mark.parametrize("host", SPELLINGS[:6])
def test_the_env_client_does_not_connect_to_its_own_servers_by_any_spelling(as_the_stack, host, service):
    """The env clients' connections (opentinker.env.confined_net): refused before a byte is sent,
    while the same spelling without the stack's ports in the rule does reach the real server."""
    stacked, bare = Settings().env_hosts, EnvHosts.parse(Settings().env_url_allow)
    url = f"http://{host}:{_port(as_the_stack, service)}{'/v1/health' if service == 'gateway' else '/health'}"
    refused = f"^{host.strip('[]')} is 127.0.0.1 now, one of this service's own servers \\(port {_port(as_the_stack, service)}\\)"
    with confined_client(stacked, timeout=10) as client, pytest.raises(httpx.ConnectError, match=refused):
        client.get(url)
    with confined_client(bare, timeout=10) as client:  # the hole, had the clients not known the stack's ports
        assert client.get(url).status_code < 500  # an answer of the real server


@pytest.mark.parametrize("protocol", ["opentinker", "openenv"])
def test_a_name_rebound_to_its_own_servers_after_the_check_reaches_nothing(monkeypatch, protocol):
    """DNS rebinding toward the stack: env.url names a host that answers an allowed outside address
    (198.51.100.7) when the spec is checked and 127.0.0.1 afterwards, at a port of the stack (a
    counting server stands in for the gateway there). The client checks the address and port as it
    connects: the server receives nothing. The same rebinding to a port that is not the stack's
    reaches it, so the name really leads there."""
    from opentinker.env import environment_from_spec
    from opentinker.env.remote import RemoteGameError
    from tests.test_env_hosts import _app_of

    gateway, served = _served(_app_of(protocol))
    try:
        monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "198.51.100.0/24,127.0.0.0/8")
        monkeypatch.setenv("OPENTINKER_GATEWAY_PORT", str(served.port))
        url = f"http://env.tenant.test:{served.port}"
        _rebinding(monkeypatch, "env.tenant.test", first="198.51.100.7", then="127.0.0.1")
        with pytest.raises((RuntimeError, RemoteGameError), match=rf"env\.tenant\.test is 127\.0\.0\.1 now, one of this service's own servers \(port {served.port}\)"):
            env = environment_from_spec(_spec(url, protocol=protocol), job_id="job-own")
            env.make_game().reset(**env.validation_tasks()[0])
        assert gateway.requests == 0
        monkeypatch.delenv("OPENTINKER_GATEWAY_PORT")
        _rebinding(monkeypatch, "env.tenant.test", first="198.51.100.7", then="127.0.0.1")
        env = environment_from_spec(_spec(url, protocol=protocol), job_id="job-own")
        game = env.make_game()
        assert isinstance(game.reset(**env.validation_tasks()[0]), str)
        game.close()
        assert gateway.requests >= 1
    finally:
        served.stop()


@pytest.mark.parametrize("host", ["127.0.0.1", "0x7f000001", "[::ffff:127.0.0.1]", "localhost."])
def test_the_sandbox_services_port_is_refused_as_an_env_url_and_an_mcp_url(stack_key, as_the_stack, tmp_path, host):
    """The stack's sandbox service runs code for its owner: a tenant's env.url or MCP server there is
    refused by the gateway and the worker, by its fixed port (whether or not it runs here)."""
    from opentinker.control.gateway.confine import confine_env
    from opentinker.core.spec import SpecError
    from opentinker.env import environment_from_spec

    settings, key = stack_key
    url = f"http://{host}:{settings.sandbox_port}"
    config = tiny_spec(tmp_path, env={"game": None, "url": url}).model_dump(mode="json")
    config.pop("job_id", None)
    response = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config}, headers={"Authorization": f"Bearer {key}"},
                          timeout=60, trust_env=False)
    assert response.status_code == 422 and response.json()["detail"].endswith(OWN), response.text
    with pytest.raises(ValueError, match=OWN):
        environment_from_spec(_spec(url), job_id="job-own")
    with pytest.raises(SpecError, match=OWN):
        confine_env(settings, "spelling", {"game": "envs.units:UnitsGame", "tools": [{"mcp": f"{url}/mcp"}]})
    assert EnvHosts.parse(settings.env_url_allow).refusal(f"http://127.0.0.1:{settings.sandbox_port}") is None  # only the stack's rule


def test_a_websocket_is_checked_with_its_port_too(as_the_stack):
    """OpenEnv's WebSocket connects through `address_for`: host and port, as the HTTP clients."""
    hosts = Settings().env_hosts
    with pytest.raises(OSError, match=f"0x7f000001 is 127.0.0.1 now, one of this service's own servers \\(port {as_the_stack.gateway_port}\\)"):
        hosts.address_for(f"ws://0x7f000001:{as_the_stack.gateway_port}/ws")
    assert hosts.address_for("ws://0x7f000001:8300/ws") == "127.0.0.1"


def test_an_address_of_this_machines_interfaces_is_its_own_too(as_the_stack):
    """A stack listening on 0.0.0.0 answers on every interface: an allowlist that admits this
    machine's own network still keeps the stack's ports out."""
    import psutil

    mine = [a.address for nic in psutil.net_if_addrs().values() for a in nic
            if a.family == socket.AF_INET and not a.address.startswith("127.")]
    if not mine:
        pytest.skip("this machine has no IPv4 address beside loopback")
    hosts = Settings(env_url_allow=f"{mine[0]}/32,127.0.0.0/8").env_hosts
    assert hosts.refusal(f"http://{mine[0]}:{as_the_stack.mlflow_port}").endswith(OWN)
    assert hosts.refusal(f"http://{mine[0]}:8300") is None


def test_loopback_ports_that_are_not_the_stacks_still_play(as_the_stack):
    """The default rule lets environment servers run on loopback: every spelling of one, at a port
    the stack does not use, passes the gateway's check and the job plays against it."""
    from envs.math import MathGame
    from opentinker.control.gateway.confine import confine_env
    from opentinker.env import environment_from_spec
    from opentinker.env.server import create_app

    counting, served = _served(lambda: create_app(MathGame))
    try:
        for host in ["0x7f000001", "127.1", "2130706433", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "localhost."]:
            url = f"http://{host}:{served.port}"
            assert confine_env(as_the_stack, "spelling", {"url": url})["url"] == url
            before = counting.requests
            env = environment_from_spec(_spec(url), job_id="job-own")
            game = env.make_game()
            assert isinstance(game.reset(**env.validation_tasks()[0]), str)
            game.close()
            assert counting.requests > before
    finally:
        served.stop()


def _marked_ports(under_pid: int) -> dict[int, str]:
    """Ports the processes of a stack's process tree listen on: {port: the process's name}."""
    import psutil

    tree = {under_pid} | {p.pid for p in psutil.Process(under_pid).children(recursive=True)}
    return {c.laddr.port: psutil.Process(c.pid).name() for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in tree}


def test_no_env_url_reaches_the_stacks_servers_on_random_ports(stack_key, as_the_stack, tmp_path):
    """Ray's agents and workers listen on ports chosen at start (not the stack's fixed ones): the
    gateway and the worker refuse each as an env.url, whatever its spelling, while the bare rule
    (no stack) would have let the client reach it."""
    from opentinker.env import environment_from_spec

    settings, key = stack_key
    fixed = {settings.prefect_port, settings.mlflow_port, settings.gateway_port, settings.ray_port, settings.ray_client_port}
    ray_head = int((settings.state_dir / "pids" / "ray.pid").read_text())
    random_ports = {port: name for port, name in _marked_ports(ray_head).items() if port not in fixed}
    assert random_ports, "the stack's Ray head listens on no port beside its fixed ones"
    for port in sorted(random_ports)[:4]:
        for host in ("127.0.0.1", "0x7f000001", "[::ffff:127.0.0.1]"):
            url = f"http://{host}:{port}"
            config = tiny_spec(tmp_path, env={"game": None, "url": url}).model_dump(mode="json")
            config.pop("job_id", None)
            response = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config},
                                  headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False)
            assert response.status_code == 422 and response.json()["detail"].endswith(OWN), (random_ports[port], response.text)
            with pytest.raises(ValueError, match=OWN):
                environment_from_spec(_spec(url), job_id="job-own")
        assert EnvHosts.parse(settings.env_url_allow).refusal(f"http://127.0.0.1:{port}") is None  # the hole without the mark


def test_no_env_url_reaches_a_jobs_vllm_server(stack_key, as_the_stack, vllm_pool, vllm_tiny_path, tmp_path):
    """A job's vLLM server (loopback, a random port) has vLLM's dev endpoints (`/collective_rpc` runs
    a method in its worker), behind its key since vllm_guard.py, and still: an env.url naming that port is
    refused by the gateway, at the worker's check and at the connection, by any spelling, while the
    bare rule reaches it."""
    from urllib.parse import urlsplit

    settings, key = stack_key
    server = vllm_pool.get(vllm_tiny_path, "merged")
    port = urlsplit(server.url).port
    config = tiny_spec(tmp_path, env={"game": None, "url": f"http://localhost:{port}"}).model_dump(mode="json")
    config.pop("job_id", None)
    response = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config}, headers={"Authorization": f"Bearer {key}"},
                          timeout=60, trust_env=False)
    assert response.status_code == 422 and response.json()["detail"].endswith(OWN), response.text
    hosts, bare = Settings().env_hosts, EnvHosts.parse(Settings().env_url_allow)
    for host in SPELLINGS:
        assert (hosts.refusal(f"http://{host}:{port}") or "").endswith(OWN), host
    with confined_client(hosts, timeout=10) as client, pytest.raises(httpx.ConnectError, match="one of this service's own servers"):
        client.post(f"http://0x7f000001:{port}/reset_prefix_cache")
    with confined_client(bare, timeout=10) as client:  # the bare rule reaches it; its guard asks for the key (test_vllm_owner_only.py)
        assert client.get(f"http://0x7f000001:{port}/is_sleeping").status_code == 401
