"""The client side of `opentinker.env.server`: a served environment used exactly like a game class.

`RemoteGameClass(urls)` stands where a game class stands (GameEnvironment, the agent loop):
`cls(**game_kwargs)` returns a RemoteGame bound to one shard (round-robin), and
`cls.generate_task(rng, **config)` continues the caller's generator on a server, so a job draws
the same tasks as with the class imported in-process.

Failures raise RemoteGameError; the agent loop turns that into one failed, counted episode.
Retries (short backoff): a request that never reached the server (connect error) is retried
`retries` times; idempotent calls (generate_task, reset) are also retried after other network
errors. `step` and session creation are never sent twice: a second step would play the action
twice, a second creation would leak a session. Timeouts are not retried.
`generate_task` never raises for an unreachable environment, which would end the job: it
returns a sentinel task whose `reset` raises, so only the episodes of that task fail.

What a server sends is bounded (`read_capped`): a response is read as a stream, counted, and
refused past OPENTINKER_ENV_MAX_RESPONSE_BYTES or past `timeout_s` in all, before any of it is
decoded (a server answering 100 MB observations once took a job to 16.7 GB and the OOM killer).
A failure's reason names the route, not the session (`POST <server>/sessions/…/step: …`), so the
same failure of many episodes groups as one in `rollout/first_failure`; the log has the session.

Tools: `get_tools()` gives the tools the server listed with reset's answer (checked: a malformed
list costs the episode, see env.served_tools); a call goes to the episode's own session and is
sent once (it may have effects), waiting for the tool's timeout, at most `timeout_s`. A failed
call (the tool's error, or no answer) is a ToolFailure the model reads.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from typing import Any

import httpx

from opentinker.core.env_hosts import EnvHosts
from opentinker.core.settings import get_settings
from opentinker.env.base import UNAVAILABLE, AbstractGame, GameTool, StepResult, ToolFailure
from opentinker.env.confined_net import confined_client
from opentinker.env.observation import Observation, from_wire
from opentinker.env.served_tools import tools_from_listing

log = logging.getLogger(__name__)
LIMIT_SETTING = "OPENTINKER_ENV_MAX_RESPONSE_BYTES"
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_NO_BACKEND = {502, 503, 504}  # a proxy in front of a dead server
_BACKOFF_S = 0.1
_CLOSE_TIMEOUT_S = 5.0  # episodes close one after another: a hung server must not stall the batch


class RemoteGameError(RuntimeError):
    """A served environment answered an error (or none): costs one episode."""


class ShardUnreachable(RemoteGameError):
    """No answer from the server at all: another shard may still serve the call."""


class AnswerRefused(RemoteGameError):
    """An answer over the size limit, compressed, or not complete by its deadline: the rest is
    never read (the connection closes)."""


def over_limit(limit: int, seen: str) -> str:
    """The one wording of every answer refused for its size."""
    return f"the answer is over the limit of {LIMIT_SETTING} ({limit:,} bytes): {seen}"


def read_capped(response: httpx.Response, limit: int, deadline: float | None = None) -> bytearray:
    """The body of a streamed response, counted as it arrives and refused (AnswerRefused) once it passes
    `limit` bytes or the `deadline` (time.monotonic()), before any of it is decoded; the caller's
    `stream()` block then closes the connection instead of reading the rest. Bodies come as they
    are on the wire (the clients ask for `Accept-Encoding: identity`): a compressed one is refused,
    since a few KB of gzip can inflate to gigabytes."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerRefused(over_limit(limit, f"{int(declared):,} bytes announced (Content-Length)"))
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", ""):
        raise AnswerRefused(f"the answer is compressed (Content-Encoding: {encoding[:40]}), which the job does not accept")
    body = bytearray()
    for chunk in response.iter_raw():
        if len(body) + len(chunk) > limit:
            raise AnswerRefused(over_limit(limit, f"{len(body) + len(chunk):,} bytes read and more coming"))
        if deadline is not None and time.monotonic() > deadline:
            raise AnswerRefused(f"the answer was not complete in time ({len(body) + len(chunk):,} bytes read)")
        body += chunk
    return body


def _detail(body: bytes | bytearray) -> str:
    try:
        return str(json.loads(body)["detail"])[:500]
    except (ValueError, KeyError, TypeError):
        return bytes(body[:500]).decode(errors="replace")


class _Shard:
    """One environment server: a pooled HTTP client with retries and readable errors."""

    def __init__(self, url: str, timeout_s: float, retries: int, token: str | None, hosts: EnvHosts, max_response_bytes: int):
        self.url = url.rstrip("/")
        self.retries = retries
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        headers = {"Accept-Encoding": "identity"} | ({"Authorization": f"Bearer {token}"} if token else {})
        self.client = confined_client(hosts, base_url=self.url, timeout=timeout_s, headers=headers)  # only to checked addresses

    def request(self, method: str, path: str, body: Any = None, *, session: str | None = None, idempotent: bool = False,
                retries: int | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """The answer's JSON; RemoteGameError (ShardUnreachable: no answer) with a reason that
        shows `session` as `…` (the full path goes to the log)."""
        where = f"{method} {self.url}{path.replace(session, '…') if session else path}"
        try:
            return self._request(method, path, body, where, idempotent, self.retries if retries is None else retries,
                                 timeout_s or self.timeout_s)
        except RemoteGameError as err:
            log.warning("%s %s%s: %s", method, self.url, path, str(err).removeprefix(f"{where}: "))
            raise type(err)(str(err).replace(session, "…") if session else str(err)) from None

    def _request(self, method: str, path: str, body: Any, where: str, idempotent: bool, retries: int, timeout_s: float) -> dict[str, Any]:
        for attempt in range(retries + 1):
            deadline = time.monotonic() + timeout_s  # the whole answer, not each read: a trickle ends too
            try:
                with self.client.stream(method, path, json=body, timeout=timeout_s) as response:
                    content = read_capped(response, self.max_response_bytes, deadline)
                break
            except AnswerRefused as err:
                raise AnswerRefused(f"{where}: {err}") from None
            except httpx.TransportError as err:
                again = isinstance(err, _NOT_SENT) or (idempotent and not isinstance(err, httpx.TimeoutException))
                if not again or attempt == retries:
                    raise ShardUnreachable(f"{where}: {type(err).__name__}: {str(err) or 'no answer'}") from None
                time.sleep(_BACKOFF_S * 2**attempt)
        if response.status_code in _NO_BACKEND:
            raise ShardUnreachable(f"{where}: HTTP {response.status_code}: {_detail(content)}")
        if response.is_error:
            raise RemoteGameError(f"{where}: HTTP {response.status_code}: {_detail(content)}")
        try:
            answer = json.loads(content)
        except ValueError as err:
            raise RemoteGameError(f"{where}: the answer is not JSON ({err})") from None
        if not isinstance(answer, dict):
            raise RemoteGameError(f"{where}: the answer is {type(answer).__name__}, not a JSON object")
        return answer


class RemoteGame(AbstractGame):
    """One episode on one shard. The session opens on first use, so creating a game never fails
    (the runtime creates games outside the episode guard)."""

    hosted_elsewhere = True  # the server starts the episode (seeds, generate_initial_state)

    def __init__(self, shard: _Shard, game_kwargs: dict[str, Any]):
        self._shard = shard
        self._game_kwargs = game_kwargs
        self._session: str | None = None
        self._prompts: dict[str, Any] = {}

    def _open(self) -> str:
        if self._session is None:
            self._prompts = self._shard.request("POST", "/sessions", {"game_kwargs": self._game_kwargs})
            self._session = str(self._prompts["session_id"])
        return self._session

    def _in_session(self, action: str, body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        session = self._open()
        return self._shard.request("POST", f"/sessions/{session}/{action}", body, session=session, **kwargs)

    def _prompt(self, key: str) -> Any:
        self._open()
        return self._prompts[key]

    def get_system_prompt(self) -> str:
        return self._prompt("system_prompt")

    def get_initial_user_message(self) -> str:
        return self._prompt("initial_user_message")

    def get_example_turns(self) -> list[dict[str, str]]:
        return self._prompt("example_turns")

    def reset(self, **task: Any) -> str | Observation:
        if UNAVAILABLE in task:
            raise RemoteGameError(f"no task for this episode: {task[UNAVAILABLE]}")
        self._prompts = self._in_session("reset", {"task": task}, idempotent=True)
        return from_wire(self._prompts["observation"], "reset's observation")

    def step(self, action: str) -> StepResult:
        answer = self._in_session("step", {"action": action})
        return StepResult(from_wire(answer["observation"]), answer["reward"], answer["done"], answer["info"])

    def get_tools(self) -> list[GameTool]:
        """The tools the server listed with reset's answer; RemoteGameError for a malformed list."""
        try:
            return tools_from_listing(self._prompts.get("tools"), self._call_tool, self._shard.timeout_s)
        except ValueError as err:
            raise RemoteGameError(f"{self._shard.url}: the episode's tool list is malformed: {err}") from None

    def _call_tool(self, name: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        session = self._session
        if session is None:
            raise ToolFailure("the episode's session is closed")
        try:
            return self._shard.request("POST", f"/sessions/{session}/tools/{name}", {"arguments": arguments}, session=session,
                                       retries=0, timeout_s=timeout_s)
        except RemoteGameError as err:
            raise ToolFailure(str(err)) from None

    def close(self) -> None:
        """Best effort and quick: one try with a short timeout (the server's sessions die with it)."""
        if self._session is not None:
            session, self._session = self._session, None
            self._shard.request("DELETE", f"/sessions/{session}", session=session, retries=0,
                                timeout_s=min(self._shard.timeout_s, _CLOSE_TIMEOUT_S))


class RemoteGameClass:
    """A served environment in the place of a game class; several URLs are shards of one game."""

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
        self.shards = [_Shard(url, timeout_s, retries, token, hosts, limit) for url in urls]
        self.__name__ = f"RemoteGame({', '.join(s.url for s in self.shards)})"
        self._turn = itertools.count()  # next() on a count is atomic: safe from many threads

    def _rotation(self) -> list[_Shard]:
        start = next(self._turn) % len(self.shards)
        return self.shards[start:] + self.shards[:start]

    def __call__(self, **game_kwargs: Any) -> RemoteGame:
        return RemoteGame(self._rotation()[0], game_kwargs)

    def generate_task(self, rng: Any, **config: Any) -> dict[str, Any]:
        """The server continues `rng` (a numpy Generator) and hands its state back, so the
        stream equals the in-process class's. When no shard answers: the sentinel task."""
        errors = []
        for shard in self._rotation():
            try:
                answer = shard.request("POST", "/generate_task", {"rng_state": rng.bit_generator.state, "config": config}, idempotent=True)
            except (ShardUnreachable, AnswerRefused) as err:  # a task too large to read costs its episodes, as none does
                errors.append(err)
                continue
            try:
                rng.bit_generator.state = answer["rng_state"]
                task = answer["task"]
                if not isinstance(task, dict):
                    raise TypeError(f"its task is {type(task).__name__}, not an object")
            except (KeyError, TypeError, ValueError) as err:  # the job fails with this line: no task stream goes on from garbage
                raise RemoteGameError(f"POST {shard.url}/generate_task: not a task answer ({type(err).__name__}: {err})") from None
            return task
        lead = "no shard answered at" if all(isinstance(e, ShardUnreachable) for e in errors) else "no task from"
        return {UNAVAILABLE: f"{lead} {', '.join(s.url for s in self.shards)} ({'; '.join(map(str, errors))})"}

    def close(self) -> None:
        for shard in self.shards:
            shard.client.close()

    def __repr__(self) -> str:
        return self.__name__
