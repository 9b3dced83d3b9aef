"""MCP servers' tools as a job's declared tools: a real FastMCP server over streamable HTTP on
127.0.0.1 (uvicorn in a thread), reached with the official `mcp` SDK through the confined client;
and an OpenEnv MCP environment (RFC 003) whose tools act on the episode's own environment."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Optional

import pytest

pytest.importorskip("mcp", reason="pip install mcp fastmcp")
from fastmcp import FastMCP  # noqa: E402

from opentinker.core.env_hosts import EnvHosts  # noqa: E402
from opentinker.core.settings import Settings  # noqa: E402
from opentinker.env.confined_net import confined_async_client  # noqa: E402
from opentinker.tools.declared import Tool, ToolError  # noqa: E402
from opentinker.tools.mcp import McpTools  # noqa: E402
from opentinker.tools.sources import as_tools, merge_tools  # noqa: E402
from tests.served import ServedApp  # noqa: E402

LOOPBACK = EnvHosts.parse("127.0.0.0/8")
FACTORS = {("blorp", "zonk"): 7.25, ("zonk", "blorp"): 1 / 7.25}  # units only the server knows
SECRETS = {"alpha": "tangerine-41", "beta": "cobalt-7"}
TIMEOUT_S = 1.5
SLEEP_S = 5.0


def unit_server() -> FastMCP:
    mcp = FastMCP("units")

    @mcp.tool
    def convert(value: float, unit_from: str, unit_to: str) -> str:
        """Convert a value between the server's own units."""
        return f"{value * FACTORS[(unit_from, unit_to)]:.4f} {unit_to}"

    @mcp.tool
    def lookup(key: str) -> str:
        """The server's secret for a key."""
        return SECRETS[key]

    @mcp.tool
    async def lookup_slowly(key: str) -> str:
        """The same, after 0.3 s."""
        await asyncio.sleep(0.3)
        return SECRETS[key]

    @mcp.tool
    def explode(reason: str) -> str:
        """Always fails."""
        raise ValueError(f"exploded: {reason}")

    @mcp.tool
    async def sleepy() -> str:
        """Answers long after any sane timeout."""
        await asyncio.sleep(SLEEP_S)
        return "late"

    @mcp.tool
    def huge() -> str:
        """10 MB of text."""
        return "x" * 10_000_000

    return mcp


class Counting:
    """An ASGI app counting the HTTP requests it receives."""

    def __init__(self, app: Any):
        self.app, self.requests = app, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.requests += 1
        await self.app(scope, receive, send)


@pytest.fixture(scope="module", params=["modern", "legacy-json", "legacy-sse"])
def server(request):
    """The server, and the protocol the client speaks: 2026's (the default, both sides: JSON answers),
    or the initialize handshake an older server needs (answers as JSON, or as SSE events)."""
    served = ServedApp(lambda: unit_server().http_app(path="/mcp", json_response=request.param != "legacy-sse"))
    served.protocol = request.param
    yield served
    served.stop()


@pytest.fixture
def mcp_tools(server, monkeypatch):
    if server.protocol != "modern":
        import functools

        import mcp

        monkeypatch.setattr(mcp, "Client", functools.partial(mcp.Client, mode="legacy"))
    tools = McpTools(f"{server.url}/mcp", LOOPBACK, timeout_s=TIMEOUT_S, max_response_bytes=4 * 1024**2)
    yield tools
    tools.close()


def by_name(tools: list[Tool]) -> dict[str, Tool]:
    return {t.name: t for t in tools}


def test_listing_gives_the_tools_with_their_schemas(server, mcp_tools):
    tools = by_name(mcp_tools.tools())
    assert mcp_tools._client.protocol_version == ("2026-07-28" if server.protocol == "modern" else "2025-11-25")
    assert set(tools) == {"convert", "lookup", "lookup_slowly", "explode", "sleepy", "huge"}
    convert = tools["convert"]
    assert convert.description == "Convert a value between the server's own units."
    assert convert.parameters["type"] == "object"
    assert convert.parameters["properties"] == {"value": {"type": "number"}, "unit_from": {"type": "string"}, "unit_to": {"type": "string"}}
    assert sorted(convert.parameters["required"]) == ["unit_from", "unit_to", "value"]
    assert convert.schema()["function"]["name"] == "convert" and convert.timeout_s >= TIMEOUT_S


def test_a_call_returns_the_servers_answer(mcp_tools):
    tools = by_name(mcp_tools.tools())
    assert tools["convert"].run({"value": 2, "unit_from": "blorp", "unit_to": "zonk"}) == "14.5000 zonk"
    assert tools["lookup"].run({"key": "beta"}) == "cobalt-7"


def test_a_failing_tool_is_a_tool_error_with_its_message_and_the_session_goes_on(mcp_tools):
    tools = by_name(mcp_tools.tools())
    with pytest.raises(ToolError, match="exploded: on purpose"):
        tools["explode"].run({"reason": "on purpose"})
    with pytest.raises(ToolError, match="KeyError|gamma"):  # the server's own failure: an unknown key
        tools["lookup"].run({"key": "gamma"})
    with pytest.raises(ToolError):  # a JSON-RPC error: no such tool on the server
        mcp_tools.call("nonexistent", {})
    assert tools["lookup"].run({"key": "alpha"}) == "tangerine-41" and mcp_tools.reconnects == 0


def test_a_tool_past_its_timeout_fails_in_time_and_the_session_goes_on(mcp_tools):
    tools = by_name(mcp_tools.tools())
    start = time.monotonic()
    with pytest.raises(ToolError, match=rf"^sleepy: no answer in {TIMEOUT_S:g}s \(the tool's timeout\)$"):
        tools["sleepy"].run({})
    assert TIMEOUT_S - 0.1 < time.monotonic() - start < TIMEOUT_S + 1.5
    assert tools["lookup"].run({"key": "alpha"}) == "tangerine-41" and mcp_tools.reconnects == 0


def test_a_10_mb_answer_is_refused_at_the_limit_and_the_session_goes_on(mcp_tools):
    tools = by_name(mcp_tools.tools())
    with pytest.raises(ToolError, match=r"over the limit of OPENTINKER_ENV_MAX_RESPONSE_BYTES \(4,194,304 bytes\)") as refused:
        tools["huge"].run({})
    assert len(str(refused.value)) < 400  # one line, none of the answer
    assert tools["lookup"].run({"key": "beta"}) == "cobalt-7" and mcp_tools.reconnects == 0


def test_16_concurrent_calls_from_threads_are_answered_through_one_session(mcp_tools):
    tools = by_name(mcp_tools.tools())
    session = mcp_tools._client
    answers: dict[int, str] = {}

    def one(i: int) -> None:
        answers[i] = tools["lookup_slowly"].run({"key": "alpha" if i % 2 else "beta"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == {i: "tangerine-41" if i % 2 else "cobalt-7" for i in range(16)}
    assert time.monotonic() - start < 16 * 0.3 * 0.75  # they overlapped (one after another: 4.8 s)
    assert mcp_tools._client is session and mcp_tools.reconnects == 0


def test_a_session_that_died_is_opened_again_by_the_next_call():
    served = ServedApp(lambda: unit_server().http_app(path="/mcp"))
    tools = McpTools(f"{served.url}/mcp", LOOPBACK, timeout_s=TIMEOUT_S)
    try:
        lookup = by_name(tools.tools())["lookup"]
        assert lookup.run({"key": "alpha"}) == "tangerine-41"
        served.stop()
        with pytest.raises(ToolError):
            lookup.run({"key": "alpha"})
        served.start()
        answers = []
        for _ in range(2):  # the call that finds the session dead may fail; the next one reconnects
            try:
                answers.append(lookup.run({"key": "beta"}))
            except ToolError:
                pass
        assert answers and answers[-1] == "cobalt-7" and tools.reconnects >= 1
    finally:
        tools.close()
        served.stop()


@pytest.mark.parametrize("url", ["http://169.254.169.254/mcp", "http://10.0.0.1/mcp", "own"])
def test_a_url_the_rule_refuses_fails_at_listing_with_one_line(monkeypatch, url):
    monkeypatch.setenv("OPENTINKER_ENV_URL_ALLOW", "127.0.0.0/8")
    settings = Settings()
    url = f"http://127.0.0.1:{settings.gateway_port}/mcp" if url == "own" else url
    tools = McpTools(url, timeout_s=TIMEOUT_S)  # the settings' own rule
    with pytest.raises(ValueError) as refused:
        tools.tools()
    why = str(refused.value)
    assert "\n" not in why and why.startswith(f"env.tools.mcp: {url} ")
    assert why.endswith("one of this service's own servers, not an environment") if "127.0.0.1" in url \
        else why.endswith("not among the addresses this service's operator allows for environments (OPENTINKER_ENV_URL_ALLOW)")


def _rebinding(monkeypatch, name: str, first: str, then: str) -> None:
    real, asked = socket.getaddrinfo, []

    def getaddrinfo(host, *args, **kwargs):
        if host != name:
            return real(host, *args, **kwargs)
        asked.append(host)
        return real(first if len(asked) == 1 else then, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_name_rebound_after_the_check_reaches_nothing_there(monkeypatch):
    """DNS rebinding: the name answers an allowed address to the check, an internal one after.
    The connection is checked as it is made: the internal server receives nothing."""
    allowed = ServedApp(lambda: unit_server().http_app(path="/mcp"))
    counting = Counting(unit_server().http_app(path="/mcp"))
    internal = ServedApp(lambda: counting, host="127.0.0.2", port=allowed.port)
    try:
        _rebinding(monkeypatch, "mcp.tenant.test", first="127.0.0.1", then="127.0.0.2")
        tools = McpTools(f"http://mcp.tenant.test:{allowed.port}/mcp", EnvHosts.parse("127.0.0.1/32"), timeout_s=TIMEOUT_S)
        with pytest.raises(RuntimeError, match=r"^env\.tools\.mcp: http://mcp\.tenant\.test:\d+/mcp: no MCP server's tools listed "
                                               r"\(.*mcp\.tenant\.test resolves to 127\.0\.0\.2 now, not among the addresses"):
            tools.tools()
        assert counting.requests == 0
    finally:
        allowed.stop()
        internal.stop()


def test_the_async_client_checks_each_connection():
    served = ServedApp(lambda: unit_server().http_app(path="/mcp"))

    async def get(hosts: EnvHosts, flavour: str) -> int:
        async with confined_async_client(hosts, flavour=flavour, timeout=5) as client:
            return (await client.get(f"{served.url}/nowhere")).status_code

    try:
        for flavour in ("httpx", "httpx2"):
            assert asyncio.run(get(LOOPBACK, flavour)) == 404
            with pytest.raises(Exception, match="resolves to 127.0.0.1 now, not among the addresses"):
                asyncio.run(get(EnvHosts.parse("10.0.0.0/8"), flavour))
    finally:
        served.stop()


def test_a_server_that_is_not_mcp_or_does_not_answer_fails_at_listing_with_one_line():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def hang(request):
        await asyncio.sleep(SLEEP_S)
        return PlainTextResponse("late")

    plain = ServedApp(lambda: Starlette(routes=[Route("/mcp", lambda r: PlainTextResponse("hello"), methods=["GET", "POST"]),
                                                Route("/slow", hang, methods=["GET", "POST"])]))
    try:
        for path, why in (("/mcp", r"Unexpected content type: text/plain"), ("/other", r"Not Found"),
                          ("/slow", rf"no answer in {TIMEOUT_S:g}s")):
            start = time.monotonic()
            with pytest.raises(RuntimeError) as failed:
                McpTools(f"{plain.url}{path}", LOOPBACK, timeout_s=TIMEOUT_S).tools()
            line = str(failed.value)
            assert "\n" not in line and line.startswith(f"env.tools.mcp: {plain.url}{path}: no MCP server's tools listed (")
            assert __import__("re").search(why, line), line
            assert time.monotonic() - start < TIMEOUT_S + 3
    finally:
        plain.stop()


def test_duplicate_names_across_servers_are_an_error():
    def make(name: str) -> Tool:
        return Tool(name, "", lambda args: "")

    assert [t.name for t in merge_tools([[make("a"), make("b")], [make("c")]])] == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"^the tool 'b' is declared by http://one/mcp and by http://two/mcp: each tool name must be unique"):
        merge_tools([[make("a"), make("b")], [make("b")]], sources=["http://one/mcp", "http://two/mcp"])
    with pytest.raises(ValueError, match="does not match"):
        as_tools([make("bad name!")])


def test_a_server_tool_name_that_is_not_a_function_name_fails_at_listing():
    odd = FastMCP("odd")

    @odd.tool(name="look up!")
    def look_up() -> str:
        return "x"

    served = ServedApp(lambda: odd.http_app(path="/mcp"))
    try:
        with pytest.raises(ValueError, match=r"^env\.tools\.mcp: http://127\.0\.0\.1:\d+/mcp: the tool name 'look up!' does not match "):
            McpTools(f"{served.url}/mcp", LOOPBACK, timeout_s=TIMEOUT_S).tools()
    finally:
        served.stop()


# --- an OpenEnv MCP environment (RFC 003) -------------------------------------------------------

openenv = pytest.importorskip("openenv", reason="pip install 'opentinker[openenv]'")
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from opentinker.env.openenv_client import OpenEnvGameClass  # noqa: E402
from opentinker.env.openenv_server import create_openenv_app  # noqa: E402
from tests.openenv_games import EchoEnv  # noqa: E402


class CounterAction(Action):
    message: str = ""


class CounterObservation(Observation):
    text: str = ""


class CounterEnv(MCPEnvironment):
    """A counter the model moves with tools; a plain step reports it and ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("counter")
        self.count = 0

        @mcp.tool
        def add(n: int) -> str:
            """Add n to this episode's counter."""
            self.count += n
            return f"count {self.count}"

        @mcp.tool
        def peek() -> str:
            """This episode's counter."""
            return f"count {self.count}"

        @mcp.tool
        def fail() -> str:
            """Always fails."""
            raise ValueError("the counter jammed")

        super().__init__(mcp)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> CounterObservation:
        self.count = 0
        return CounterObservation(text="count 0")

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> CounterObservation:
        return CounterObservation(text=f"final count {self.count}", reward=float(self.count), done=True)

    @property
    def state(self) -> State:
        return State(step_count=0)


def test_an_openenv_mcp_environments_tools_act_on_that_episode_only():
    served = ServedApp(lambda: create_openenv_app(CounterEnv, CounterAction, CounterObservation))
    plain = ServedApp(lambda: create_openenv_app(EchoEnv))
    games = OpenEnvGameClass([served.url], timeout_s=5, retries=0, hosts=LOOPBACK, max_response_bytes=1024**2)
    try:
        first, second = games(), games()
        assert first.reset(__seed__=1) == "count 0" and second.reset(__seed__=2) == "count 0"
        tools = by_name(as_tools(first.get_tools()))
        assert set(tools) == {"add", "peek", "fail"}
        assert tools["add"].parameters["properties"] == {"n": {"type": "integer"}} and tools["add"].description == "Add n to this episode's counter."
        assert tools["add"].run({"n": 3}) == "count 3" and tools["add"].run({"n": 4}) == "count 7"
        with pytest.raises(ToolError, match="the counter jammed"):
            tools["fail"].run({})
        assert by_name(as_tools(second.get_tools()))["peek"].run({}) == "count 0"  # the other episode's state is its own
        assert first.step("done").observation == "final count 7" and first.step  # the episode's step sees its tools' work
        first.close()
        second.close()
        echo = OpenEnvGameClass([plain.url], timeout_s=5, retries=0, hosts=LOOPBACK, max_response_bytes=1024**2)()
        echo.reset(__seed__=1)
        assert echo.get_tools() == []  # an environment without MCP declares none
        echo.close()
    finally:
        served.stop()
        plain.stop()

