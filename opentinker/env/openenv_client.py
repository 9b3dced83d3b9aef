"""An OpenEnv server (openenv-core 0.3.0) in the place of a game class: `env: {url, protocol: openenv}`.

OpenEnv keeps an episode's state only on its WebSocket (`/ws`: one connection, one environment;
its HTTP `/reset` and `/step` build a fresh environment per request), so an episode is one
connection, spoken with OpenEnv's own client (`GenericEnvClient`). Our confinement still applies:
the URL is the one the gateway checked (redirects are refused, not followed), the job's token goes
in `Authorization`, `env.timeout_s` bounds the connection and every answer, `env.retries` retries a
connection that never opened (a step is never sent twice), and a failure of any kind costs the
episode (RemoteGameError), never the job.

Text to action (the rule): the action's JSON schema comes from the server's `/schema`. When its only
field besides `metadata` is a string, the model's whole text fills that field. Otherwise the text
must be one JSON object (bare, or alone in a ``` fence), checked against that schema. A refused
action never reaches the server: the turn gets reward 0 and an observation saying why (the episode
goes on); a server answering VALIDATION_ERROR is the same refusal. Every step's info counts
`illegal_moves` (refused) and `moves` (played), so the job reports `illegal_move_rate`.

What a server sends is bounded as for `opentinker.env.remote`: a WebSocket message over
OPENTINKER_ENV_MAX_RESPONSE_BYTES is refused as its frame header (or its decompression) passes the
limit, and `/schema` is read as a counted stream; the episode fails with the numbers. The action
schema and the tools' input schemas are checked for what validating against them may cost
(opentinker.core.schema_cost: size, depth, $refs, combinators) when they are read, and each
action's check is bounded in steps: a schema that could cost more fails the episode in one line.

Observation to text (the rule): OpenEnv sends an observation without reward, done and metadata;
its text is its only field when that is a string, else its `text` or `message` field when that is
a string, else the observation as JSON (sorted keys).

Tools (OpenEnv RFC 003): an MCP environment's tools are the episode's (`get_tools`, after reset),
listed and called with MCP JSON-RPC (`tools/list`, `tools/call`) on the episode's own WebSocket
(OpenEnv's `mcp` message), so a call acts on this episode's environment only; a tool call is not a
step (no reward). An environment without MCP declares none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import re
import threading
import time
from typing import Any

import httpx
from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosedError, PayloadTooBig

from opentinker.core.env_hosts import EnvHosts
from opentinker.core.json_text import JsonTextError, loads_bounded
from opentinker.core.schema_cost import ArgumentsUnchecked, SchemaRefused, bounded_validator, check_cost, first_error
from opentinker.core.settings import get_settings
from opentinker.env.base import SEED_KEY, AbstractGame, GameTool, StepResult, ToolFailure, seed_task
from opentinker.env.confined_net import confined_client
from opentinker.env.remote import AnswerRefused, RemoteGameError, over_limit, read_capped

_BACKOFF_S = 0.1
_CLOSE_TIMEOUT_S = 5.0
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)


class ConnectionAnswered(RuntimeError):
    """The server answered the WebSocket handshake with a refusal: trying again would not help."""


class _NoRedirect(ws_connect):
    """websockets follows redirects (to any host); a tenant's server must not lead us elsewhere."""

    def process_redirect(self, exc: Exception) -> Exception:
        return exc


class ConfinedEnvClient(GenericEnvClient):
    """OpenEnv's client, connecting with the job's token, without redirects and without the
    process's proxy settings, to the address checked as it connects; it also leaves the process's
    NO_PROXY alone (the package's connect() rewrites it, racing other threads)."""

    def __init__(self, base_url: str, timeout_s: float, token: str | None, hosts: EnvHosts | None = None,
                 max_message_bytes: int | None = None):
        super().__init__(base_url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s, mode="simulation")
        self._max_message_size = max_message_bytes or get_settings().env_max_response_bytes  # exact bytes (the package takes MB)
        self._headers = {"Authorization": f"Bearer {token}"} if token else None
        self._hosts = hosts or get_settings().env_hosts

    async def connect(self) -> ConfinedEnvClient:
        if self._ws is None:
            try:
                # the TCP connection goes to the address checked now (opentinker.env.confined_net); TLS and Host keep the URL's name
                address = await asyncio.to_thread(self._hosts.address_for, self._ws_url)
                self._ws = await _NoRedirect(self._ws_url, additional_headers=self._headers, open_timeout=self._connect_timeout,
                                             max_size=self._max_message_size, close_timeout=_CLOSE_TIMEOUT_S, proxy=None, host=address)
            except (OSError, TimeoutError) as err:  # refused, reset, no answer, an address not allowed: nothing was sent
                raise ConnectionError(f"{type(err).__name__}: {err}") from None
            except Exception as err:  # noqa: BLE001 - a 401/403, a redirect, not a WebSocket server: an answer
                raise ConnectionAnswered(f"{type(err).__name__}: {err}") from None
        return self

    async def mcp(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """One MCP JSON-RPC request on this connection, its environment's (RFC 003): the response object."""
        self._rpc_id = getattr(self, "_rpc_id", 0) + 1
        message = {"jsonrpc": "2.0", "method": method, "params": params, "id": self._rpc_id}
        return (await self._send_and_receive({"type": "mcp", "data": message})).get("data") or {}

    async def _receive(self) -> dict[str, Any]:
        """The package's, with a message over the limit said with the numbers (websockets closes with 1009)."""
        socket = self._ws
        try:
            return await super()._receive()
        except ConnectionClosedError:
            refused = getattr(getattr(socket, "protocol", None), "parser_exc", None)
            if isinstance(refused, PayloadTooBig):
                size = getattr(refused, "size", None)
                seen = f"a frame of {size:,} bytes announced" if size else "a compressed message that inflates past it"
                raise AnswerRefused(over_limit(self._max_message_size, seen)) from None
            raise


class ClientLoop:
    """One event loop thread for every episode's connection (OpenEnv's sync wrapper starts a thread per client)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def run(cls, coro: Any, limit_s: float) -> Any:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="openenv-client", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(coro, cls._loop)
        try:
            return future.result(limit_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer in {limit_s:g}s") from None


def action_rule(schema: dict[str, Any]) -> str | None:
    """The field the model's text fills (the schema's only field besides `metadata`, a string), or None: JSON."""
    fields = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    if len(fields) == 1:
        (name, prop), = fields.items()
        if isinstance(prop, dict) and prop.get("type") == "string":
            return name
    return None


def parse_action(text: str, schema: dict[str, Any], validator: Any) -> dict[str, Any]:
    """The action for `text` by the module's rule; ValueError (one line, shown to the model) when
    refused. `validator`: core.schema_cost.bounded_validator of the schema (its check is bounded)."""
    field = action_rule(schema)
    if field is not None:
        action: Any = {field: text}
    else:
        body = text.strip()
        fenced = _FENCE.match(body)
        try:
            action = loads_bounded(fenced.group(1) if fenced else body)
        except JsonTextError as err:
            raise ValueError(f"the action must be one JSON object: {err}") from None
        if not isinstance(action, dict):
            raise ValueError(f"the action must be one JSON object, not {type(action).__name__}")
    try:
        error = first_error(validator, action)
    except ArgumentsUnchecked as err:
        raise ValueError(f"the action: {err}") from None
    if error is not None:
        where = "/".join(map(str, error.absolute_path)) or "the action"
        raise ValueError(f"{where}: {error.message[:300]}")
    return action


def observation_text(observation: Any) -> str:
    """The observation's text by the module's rule."""
    if not isinstance(observation, dict):
        return observation if isinstance(observation, str) else json.dumps(observation, sort_keys=True)
    strings = {k: v for k, v in observation.items() if isinstance(v, str)}
    if len(observation) == 1 and strings:
        return next(iter(strings.values()))
    for key in ("text", "message"):
        if key in strings:
            return strings[key]
    return json.dumps(observation, sort_keys=True, default=str)


class _Server:
    """One OpenEnv server: its base URL, the job's token, and its action schema (read once)."""

    def __init__(self, url: str, timeout_s: float, retries: int, token: str | None, hosts: EnvHosts, max_response_bytes: int):
        self.url, self.timeout_s, self.retries, self.token, self.hosts = url.rstrip("/"), timeout_s, retries, token, hosts
        self.max_response_bytes = max_response_bytes
        self._schema: tuple[dict[str, Any], Any] | None = None
        self._lock = threading.Lock()

    def schema(self) -> tuple[dict[str, Any], Any]:
        """(action schema, its validator), from GET /schema; a failure is retried by the next episode."""
        with self._lock:
            if self._schema is None:
                headers = {"Accept-Encoding": "identity"} | ({"Authorization": f"Bearer {self.token}"} if self.token else {})
                for attempt in range(self.retries + 1):
                    try:
                        deadline = time.monotonic() + self.timeout_s
                        with confined_client(self.hosts, timeout=self.timeout_s) as client, \
                                client.stream("GET", f"{self.url}/schema", headers=headers) as response:
                            body = read_capped(response, self.max_response_bytes, deadline)
                        break
                    except AnswerRefused as err:
                        raise RemoteGameError(f"GET {self.url}/schema: {err}") from None
                    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                        if attempt == self.retries:
                            raise RemoteGameError(f"GET {self.url}/schema: {type(err).__name__}: {err}") from None
                        time.sleep(_BACKOFF_S * 2**attempt)
                    except httpx.TransportError as err:
                        raise RemoteGameError(f"GET {self.url}/schema: {type(err).__name__}: {err or 'no answer'}") from None
                if response.is_error:
                    raise RemoteGameError(f"GET {self.url}/schema: HTTP {response.status_code}: {bytes(body[:300]).decode(errors='replace')}")
                try:
                    action = loads_bounded(bytes(body), max_chars=self.max_response_bytes)["action"]
                    self._schema = (action, bounded_validator(action))  # its cost bounded (core.schema_cost), nothing fetched
                except SchemaRefused as err:
                    raise RemoteGameError(f"GET {self.url}/schema: the action schema {err} (refused)") from None
                except Exception as err:  # noqa: BLE001 - whatever the server sent, one line
                    raise RemoteGameError(f"GET {self.url}/schema: no usable action schema ({type(err).__name__}: {err})") from None
            return self._schema


def _reason(err: BaseException) -> str:
    if isinstance(err, (TimeoutError, asyncio.TimeoutError)):
        return "no answer"
    return str(err) if isinstance(err, RemoteGameError) else f"{type(err).__name__}: {err}"


class OpenEnvGame(AbstractGame):
    """One episode: one WebSocket session on one OpenEnv server, opened by `reset`."""

    hosted_elsewhere = True  # the server starts the episode (the seed goes to its reset)

    def __init__(self, server: _Server, system_prompt: str | None = None):
        self._server = server
        self._system_prompt = system_prompt
        self._client: ConfinedEnvClient | None = None
        self._tool_lock = threading.Lock()
        self.refused = self.played = 0

    def get_system_prompt(self) -> str:
        if self._system_prompt is not None:
            return self._system_prompt
        schema, _ = self._server.schema()
        field = action_rule(schema)
        if field is not None:
            return ""
        shown = {**schema, "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
        return f"Answer each turn with one JSON object, the action, matching this JSON schema: {json.dumps(shown, sort_keys=True)}"

    def _call(self, coro: Any, what: str) -> Any:
        try:
            return ClientLoop.run(coro, 2 * self._server.timeout_s + _CLOSE_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - every failure here costs the episode
            self.close()
            raise RemoteGameError(f"{what} {self._server.url}: {_reason(err)}") from None

    def reset(self, **task: Any) -> str:
        self._server.schema()  # no session before the action's schema is known
        kwargs = {("seed" if k == SEED_KEY else k): v for k, v in task.items()}
        for attempt in range(self._server.retries + 1):
            self.close()
            self._client = ConfinedEnvClient(self._server.url, self._server.timeout_s, self._server.token, self._server.hosts,
                                             self._server.max_response_bytes)
            try:
                ClientLoop.run(self._client.connect(), 2 * self._server.timeout_s)
                break
            except Exception as err:  # noqa: BLE001 - only a connection that never opened is tried again
                if attempt == self._server.retries or not isinstance(err, ConnectionError):
                    self.close()
                    raise RemoteGameError(f"connect {self._server.url}: {err}") from None
                time.sleep(_BACKOFF_S * 2**attempt)
        result = self._call(self._client.reset(**kwargs), "reset")
        return observation_text(result.observation)

    def _counts(self) -> dict[str, int]:
        return {"illegal_moves": self.refused, "moves": self.played}

    def step(self, action: str) -> StepResult:
        if self._client is None:
            raise RemoteGameError("step before reset")
        schema, validator = self._server.schema()
        try:
            payload = parse_action(action, schema, validator)
        except ValueError as err:
            return self._refuse(str(err))
        try:
            result = ClientLoop.run(self._client.step(payload), 2 * self._server.timeout_s + _CLOSE_TIMEOUT_S)
        except RuntimeError as err:
            if "(code: VALIDATION_ERROR)" in str(err):  # the server refused the action; the session lives
                return self._refuse(str(err).removeprefix("Server error: "))
            self.close()
            raise RemoteGameError(f"step {self._server.url}: {err}") from None
        except Exception as err:  # noqa: BLE001 - a timeout, a dropped connection: the episode is lost
            self.close()
            raise RemoteGameError(f"step {self._server.url}: {_reason(err)}") from None
        self.played += 1
        reward = 0.0 if result.reward is None else float(result.reward)
        return StepResult(observation_text(result.observation), reward, bool(result.done), self._counts())

    def get_tools(self) -> list[GameTool]:
        """An MCP environment's tools, listed on this episode's connection; [] for one without MCP."""
        answer = self._mcp("tools/list", {})
        if "error" in answer:
            if "does not support MCP" in str(answer["error"].get("message", "")):
                return []
            raise RemoteGameError(f"tools/list {self._server.url}: {str(answer['error'].get('message'))[:300]}")
        tools = []
        for t in (answer.get("result") or {}).get("tools") or []:
            schema = t.get("inputSchema") or t.get("input_schema") or {"type": "object", "properties": {}}
            try:
                check_cost(schema)
            except SchemaRefused as err:
                raise RemoteGameError(f"tools/list {self._server.url}: the tool {str(t.get('name'))[:80]!r}'s input schema {err} "
                                      "(refused)") from None
            tools.append(GameTool(str(t.get("name")), str(t.get("description") or ""), self._tool(str(t.get("name"))), schema,
                                  timeout_s=2 * self._server.timeout_s + _CLOSE_TIMEOUT_S))
        return tools

    def _mcp(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        with self._tool_lock:  # one request and its answer at a time on the connection
            if self._client is None:
                raise RemoteGameError(f"{method} before reset (or after the episode's connection was lost)")
            return self._call(self._client.mcp(method, params), method)

    def _tool(self, name: str) -> Any:
        def run(arguments: dict[str, Any]) -> str:
            try:
                answer = self._mcp("tools/call", {"name": name, "arguments": arguments})
            except RemoteGameError as err:
                raise ToolFailure(str(err)) from None
            if "error" in answer:
                raise ToolFailure(str(answer["error"].get("message") or "the tool failed")[:2000])
            result = answer.get("result") or {}
            parts = [p.get("text", "") if p.get("type") == "text" else f"[{p.get('type')} content]"
                     for p in result.get("content") or [] if isinstance(p, dict)]
            text = "\n".join(parts) if parts else json.dumps(result.get("structured_content", result), sort_keys=True, default=str)
            if result.get("is_error") or result.get("isError"):
                raise ToolFailure(text or "the tool failed")
            return text

        return run

    def _refuse(self, why: str) -> StepResult:
        self.refused += 1
        field = action_rule(self._server.schema()[0])
        rule = "your whole reply is the action's text" if field else "reply with one JSON object matching the action's schema"
        return StepResult(f"Your action was refused ({why}); {rule}.", 0.0, False, self._counts())

    def close(self) -> None:
        """Best effort and quick: the server ends the session with the connection."""
        client, self._client = self._client, None
        if client is not None:
            try:
                ClientLoop.run(client.disconnect(), _CLOSE_TIMEOUT_S + 1)
            except Exception:  # noqa: BLE001, S110 - a dead server's session dies with it
                pass


class OpenEnvGameClass:
    """OpenEnv servers in the place of a game class; several URLs are shards of one environment.
    Tasks are seeds (data-free) unless the job gives a dataset: a task's keys go to OpenEnv's reset."""

    def __init__(self, urls: str | list[str], timeout_s: float = 30.0, retries: int = 2, token: str | None = None,
                 hosts: EnvHosts | None = None, max_response_bytes: int | None = None):
        """`hosts`: where connections may go (default: this machine's OPENTINKER_ENV_URL_ALLOW);
        `max_response_bytes`: default OPENTINKER_ENV_MAX_RESPONSE_BYTES."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("env.url: give at least one URL")
        settings = get_settings() if hosts is None or max_response_bytes is None else None
        hosts = hosts or settings.env_hosts
        limit = max_response_bytes or settings.env_max_response_bytes
        self.servers = [_Server(url, timeout_s, retries, token, hosts, limit) for url in urls]
        self.__name__ = f"OpenEnv({', '.join(s.url for s in self.servers)})"
        self._turn = itertools.count()

    def __call__(self, system_prompt: str | None = None, **_: Any) -> OpenEnvGame:
        return OpenEnvGame(self.servers[next(self._turn) % len(self.servers)], system_prompt)

    @staticmethod
    def generate_task(rng: Any, **config: Any) -> dict[str, Any]:
        return seed_task(rng)

    def close(self) -> None:
        """Nothing pooled: each episode's connection closes with it."""

    def __repr__(self) -> str:
        return self.__name__
