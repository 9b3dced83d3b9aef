"""The operator's allowlist of addresses environment servers may be at (OPENTINKER_ENV_URL_ALLOW):
the rule on hand-picked URLs, the gateway refusing such a spec, and a worker refusing to send a
single request to a real server on 127.0.0.1 once 127.0.0.1 is not allowed (the server counts
every request it gets), while the default (loopback) plays."""

import re
import socket

import pytest
from pydantic import ValidationError

from envs.math import MathGame
from opentinker.control.gateway.confine import confine_env
from opentinker.core.env_hosts import EnvHosts
from opentinker.core.settings import Settings
from opentinker.core.spec import SpecError, parse_spec
from opentinker.env import environment_from_spec
from opentinker.env.remote import RemoteGameError
from opentinker.env.server import create_app
from tests.served import ServedApp

REFUSED = r"is not among the addresses this service's operator allows for environments \(OPENTINKER_ENV_URL_ALLOW\)$"


def refusal(allow: str, url: str) -> str | None:
    return EnvHosts.parse(allow).refusal(url)


DEFAULT = Settings.model_fields["env_url_allow"].default


@pytest.mark.parametrize("url", ["http://127.0.0.1:8300", "http://127.9.9.9/", "https://[::1]:8000/x", "ws://127.0.0.1:1/ws",
                                 "http://localhost:8300", "http://[::ffff:127.0.0.1]:80"])
def test_loopback_is_allowed_by_default(url):
    assert DEFAULT == "127.0.0.0/8,::1"
    assert refusal(DEFAULT, url) is None


@pytest.mark.parametrize("url, address", [("http://10.0.0.5:80", "10.0.0.5"), ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
                                          ("http://192.168.1.1", "192.168.1.1"), ("https://8.8.8.8", "8.8.8.8"),
                                          ("http://[fd00::1]:80", "fd00::1"), ("http://[::ffff:10.0.0.5]/", "::ffff:10.0.0.5: 10.0.0.5"),
                                          ("http://0.0.0.0:80", "0.0.0.0")])
def test_everything_else_is_refused_by_default_with_one_line(url, address):
    why = refusal(DEFAULT, url)
    assert why == (f"env.url: {url} ({address}) is not among the addresses this service's operator allows for "
                   "environments (OPENTINKER_ENV_URL_ALLOW)")


def test_networks_names_suffixes_and_anything():
    allow = "10.0.0.0/8, fd00::/8, 192.168.1.7, env.Corp.example, *.example.internal"
    assert refusal(allow, "http://10.200.3.4:8000") is None
    assert refusal(allow, "http://[fd12::5]:8000") is None
    assert refusal(allow, "http://192.168.1.7") is None
    assert refusal(allow, "http://192.168.1.8") is not None
    assert refusal(allow, "http://11.0.0.1") is not None
    assert refusal(allow, "http://127.0.0.1:8300") is not None  # loopback only by default, not once the operator lists others
    assert refusal(allow, "http://ENV.corp.example:80/") is None  # a name entry: exact, any case, trusted without resolving
    assert refusal(allow, "http://a.example.internal") is None and refusal(allow, "http://b.a.example.internal.") is None
    assert refusal(allow, "http://evil-example.internal.invalid") is not None  # a suffix is a whole label
    assert refusal(allow, "http://notexample.internal.invalid") is not None
    assert refusal("*", "http://169.254.169.254") is None and refusal("*", "wss://10.0.0.1/ws") is None
    assert refusal("", "http://127.0.0.1") is not None  # empty: no env.url at all


def test_names_are_resolved_and_every_address_counts():
    assert refusal("10.0.0.0/8", "http://localhost:80").startswith("env.url: http://localhost:80 (localhost: ")
    why = refusal(DEFAULT, "http://no-such-host.invalid:8000")
    assert why.startswith("env.url: http://no-such-host.invalid:8000 (no-such-host.invalid) does not resolve")
    assert why.endswith("(OPENTINKER_ENV_URL_ALLOW)")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://127.0.0.1:70/", "ftp://127.0.0.1/", "http:///nohost", "127.0.0.1:80"])
def test_other_schemes_and_hostless_urls_are_refused(url):
    assert refusal("*", url).startswith(f"env.url: {url}")


@pytest.mark.parametrize("entry", ["10.0.0.5/8", "10.0.0.0/33", "10.0.0", "http://10.0.0.1", "foo bar", "*.", "*foo.com", "a..b"])
def test_a_malformed_entry_fails_when_the_settings_load(monkeypatch, entry):
    monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", f"127.0.0.1,{entry}")
    with pytest.raises(ValidationError, match=rf"OPENTINKER_ENV_URL_ALLOW: '{re.escape(entry)}' is not an IP address, "
                                              r"a network \(CIDR\), a host name, '\*\.domain' or '\*'"):
        Settings()


def test_the_setting_is_read_from_the_environment_once(monkeypatch):
    monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "10.0.0.0/8,*.example.internal")
    settings = Settings()
    assert settings.env_hosts is settings.env_hosts
    assert settings.env_hosts.refusal("http://10.1.2.3") is None and settings.env_hosts.refusal("http://127.0.0.1") is not None


def test_the_gateway_refuses_a_spec_with_an_address_not_allowed():
    settings = Settings()
    for url in ("http://10.0.0.5:80", ["http://127.0.0.1:8300", "http://169.254.169.254/latest"]):
        with pytest.raises(SpecError, match=rf"^env\.url: http://(10\.0\.0\.5:80 \(10\.0\.0\.5\)|169\.254\.169\.254/latest \(169\.254\.169\.254\)) {REFUSED}"):
            confine_env(settings, "alice", {"url": url})
    with pytest.raises(SpecError, match="is one of this service's own servers"):  # the older refusal still comes first
        confine_env(settings, "alice", {"url": f"http://127.0.0.1:{settings.gateway_port}"})
    assert confine_env(settings, "alice", {"url": "http://127.0.0.1:8300"})["url"] == "http://127.0.0.1:8300"
    allowed = Settings(env_url_allow="10.0.0.0/8")
    assert confine_env(allowed, "alice", {"url": "http://10.0.0.5:80", "protocol": "openenv"})["protocol"] == "openenv"


class Counting:
    """An ASGI app that counts every request (HTTP or WebSocket) before passing it on."""

    def __init__(self, app):
        self.app, self.requests = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            self.requests += 1
        await self.app(scope, receive, send)


def _served(make_app, host="127.0.0.1", port=None):
    counting = Counting(make_app())
    return counting, ServedApp(lambda: counting, host, port)


def _app_of(protocol: str):
    """A maker of a real server speaking `protocol` (ours: MathGame; OpenEnv's: EchoEnv)."""
    if protocol == "openenv":
        pytest.importorskip("openenv", reason="pip install 'opentinker[openenv]'")
        from opentinker.env.openenv_server import create_openenv_app
        from tests.openenv_games import EchoEnv

        return lambda: create_openenv_app(EchoEnv)
    return lambda: create_app(MathGame)


def _rebinding(monkeypatch, name: str, first: str, then: str) -> None:
    """DNS a tenant controls: `name` answers `first` to the first lookup (the spec's check), `then` after."""
    real, asked = socket.getaddrinfo, []

    def getaddrinfo(host, *args, **kwargs):
        if host != name:
            return real(host, *args, **kwargs)
        asked.append(host)
        return real(first if len(asked) == 1 else then, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("protocol", ["opentinker", "openenv"])
def test_a_name_that_answers_another_address_after_the_check_reaches_nothing_there(monkeypatch, protocol):
    """DNS rebinding, attempted: env.url names a host whose DNS answers an allowed address when the
    spec is checked and the operator's internal server (127.0.0.2 here, not allowed) afterwards. The
    client checks again as it connects and connects only to what it checked: the internal server
    receives nothing, and the episode fails with the line."""
    make = _app_of(protocol)
    allowed, served = _served(make)
    internal, hidden = _served(make, host="127.0.0.2", port=served.port)
    try:
        monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "127.0.0.1/32")
        _rebinding(monkeypatch, "env.tenant.test", first="127.0.0.1", then="127.0.0.2")
        url = f"http://env.tenant.test:{served.port}"
        # the spec's check passes (127.0.0.1); then our protocol's job cannot draw its tasks (it does not start),
        # an OpenEnv job's episode fails at its reset: both with the line
        with pytest.raises((RuntimeError, RemoteGameError), match=r"env\.tenant\.test resolves to 127\.0\.0\.2 now, not among the addresses"):
            env = environment_from_spec(_spec(url, protocol=protocol), job_id="job-hosts")
            env.make_game().reset(**env.validation_tasks()[0])
        assert internal.requests == 0
        # the same name answering the allowed address every time plays
        _rebinding(monkeypatch, "env.tenant.test", first="127.0.0.1", then="127.0.0.1")
        env = environment_from_spec(_spec(url, protocol=protocol), job_id="job-hosts")
        game = env.make_game()
        assert isinstance(game.reset(**env.validation_tasks()[0]), str)
        game.close()
        assert allowed.requests >= 1 and internal.requests == 0
    finally:
        served.stop()
        hidden.stop()


def _spec(url, **env):
    return parse_spec({"model": {"name": "tiny-random"}, "env": {"url": url, "timeout_s": 5, "retries": 0,
                                                                  "config": {"val_size": 2}, **env}, "seed": 3})


def test_a_worker_sends_nothing_to_an_address_not_allowed(monkeypatch):
    counting, served = _served(lambda: create_app(MathGame))
    try:
        monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "10.0.0.0/8")
        for url in (served.url, [served.url.replace("127.0.0.1", "localhost")]):
            with pytest.raises(ValueError, match=rf"^env\.url: {served.url.split(':')[0]}://(127\.0\.0\.1|localhost):\d+ \([^)]+\) {REFUSED}"):
                environment_from_spec(_spec(url), job_id="job-hosts")
        assert counting.requests == 0
        monkeypatch.delenv("OPENTINKER_ENV_URL_ALLOW")  # the default: loopback
        env = environment_from_spec(_spec(served.url), job_id="job-hosts")
        assert len(env.validation_tasks()) == 2 and counting.requests >= 2
        game = env.make_game()
        assert isinstance(game.reset(**env.validation_tasks()[0]), str) and game.step("Answer: 0").done
        game.close()
    finally:
        served.stop()


def test_an_openenv_worker_sends_nothing_to_an_address_not_allowed(monkeypatch):
    pytest.importorskip("openenv", reason="pip install 'opentinker[openenv]'")
    from opentinker.env.openenv_server import create_openenv_app
    from tests.openenv_games import EchoEnv

    counting, served = _served(lambda: create_openenv_app(EchoEnv))
    try:
        monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "10.0.0.0/8,*.example.internal")
        with pytest.raises(ValueError, match=rf"^env\.url: {served.url} \(127\.0\.0\.1\) {REFUSED}"):
            environment_from_spec(_spec(served.url, protocol="openenv"), job_id="job-hosts")
        assert counting.requests == 0
        monkeypatch.delenv("OPENTINKER_ENV_URL_ALLOW")
        env = environment_from_spec(_spec(served.url, protocol="openenv"), job_id="job-hosts")
        game = env.make_game()
        assert "ready (seed 1)" in game.reset(__seed__=1)
        game.close()
        assert counting.requests >= 2  # GET /schema, then the episode's WebSocket
    finally:
        served.stop()


def test_the_gateway_answers_422_with_the_line_before_submission(tmp_path):
    """The real gateway app over HTTP, with no Prefect behind it: the refusal comes before the scheduler."""
    import httpx

    from opentinker.control.gateway.app import create_app
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.inference.server import serve_in_thread

    settings = Settings(state_dir=tmp_path / "state", host="127.0.0.1")
    key = TenantStore(settings.state_dir / "tenants.json").create("mallory")
    server = serve_in_thread(create_app(settings), "127.0.0.1", 0)
    try:
        spec = {"model": {"name": "tiny-random"}, "env": {"url": "http://169.254.169.254/latest/meta-data/"}}
        response = httpx.post(f"{server.url}/v1/jobs", json={"config": spec}, headers={"Authorization": f"Bearer {key}"},
                              timeout=30, trust_env=False)
        assert response.status_code == 422, response.text
        assert re.match(rf"^env\.url: http://169\.254\.169\.254/latest/meta-data/ \(169\.254\.169\.254\) {REFUSED}",
                        response.json()["detail"])
    finally:
        server.stop()


@pytest.mark.parametrize("protocol", ["opentinker", "openenv"])
def test_a_worker_reaches_the_checked_host_itself_not_through_a_proxy_of_the_environment(monkeypatch, protocol):
    """HTTP(S)_PROXY in a worker's environment would carry a job's requests to wherever the proxy
    reaches: the env client connects to the checked address itself (our protocol's requests;
    OpenEnv's schema request and WebSocket)."""
    counting, served = _served(_app_of(protocol))
    proxy, proxied = _served(_app_of(protocol))
    try:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "WS_PROXY", "http_proxy", "all_proxy", "ws_proxy"):
            monkeypatch.setenv(name, proxied.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        env = environment_from_spec(_spec(served.url, protocol=protocol), job_id="job-hosts")
        game = env.make_game()
        assert isinstance(game.reset(**env.validation_tasks()[0]), str)
        game.close()
        assert counting.requests >= 2 and proxy.requests == 0
    finally:
        served.stop()
        proxied.stop()
