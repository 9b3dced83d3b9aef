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
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import httpx

from opentinker.core.env_hosts import EnvHosts
from opentinker.core.settings import get_settings
from opentinker.env.base import UNAVAILABLE, AbstractGame, StepResult
from opentinker.env.confined_net import confined_client
from opentinker.env.observation import Observation, from_wire

_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_NO_BACKEND = {502, 503, 504}  # a proxy in front of a dead server
_BACKOFF_S = 0.1
_CLOSE_TIMEOUT_S = 5.0  # episodes close one after another: a hung server must not stall the batch


class RemoteGameError(RuntimeError):
    """A served environment answered an error (or none): costs one episode."""


class ShardUnreachable(RemoteGameError):
    """No answer from the server at all: another shard may still serve the call."""


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


class _Shard:
    """One environment server: a pooled HTTP client with retries and readable errors."""

    def __init__(self, url: str, timeout_s: float, retries: int, token: str | None, hosts: EnvHosts):
        self.url = url.rstrip("/")
        self.retries = retries
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = confined_client(hosts, base_url=self.url, timeout=timeout_s, headers=headers)  # only to checked addresses

    def request(self, method: str, path: str, body: Any = None, *, idempotent: bool = False, retries: int | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        where = f"{method} {self.url}{path}"
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                response = self.client.request(method, path, json=body, timeout=timeout_s or self.timeout_s)
                break
            except httpx.TransportError as err:
                again = isinstance(err, _NOT_SENT) or (idempotent and not isinstance(err, httpx.TimeoutException))
                if not again or attempt == retries:
                    raise ShardUnreachable(f"{where}: {type(err).__name__}: {str(err) or 'no answer'}") from None
                time.sleep(_BACKOFF_S * 2**attempt)
        if response.status_code in _NO_BACKEND:
            raise ShardUnreachable(f"{where}: HTTP {response.status_code}: {_detail(response)}")
        if response.is_error:
            raise RemoteGameError(f"{where}: HTTP {response.status_code}: {_detail(response)}")
        return response.json()


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
            self._session = self._prompts["session_id"]
        return self._session

    def _path(self, action: str) -> str:
        return f"/sessions/{self._open()}/{action}"

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
        self._prompts = self._shard.request("POST", self._path("reset"), {"task": task}, idempotent=True)
        return from_wire(self._prompts["observation"], "reset's observation")

    def step(self, action: str) -> StepResult:
        answer = self._shard.request("POST", self._path("step"), {"action": action})
        return StepResult(from_wire(answer["observation"]), answer["reward"], answer["done"], answer["info"])

    def close(self) -> None:
        """Best effort and quick: one try with a short timeout (the server's sessions die with it)."""
        if self._session is not None:
            session, self._session = self._session, None
            self._shard.request("DELETE", f"/sessions/{session}", retries=0, timeout_s=min(self._shard.timeout_s, _CLOSE_TIMEOUT_S))


class RemoteGameClass:
    """A served environment in the place of a game class; several URLs are shards of one game."""

    def __init__(self, urls: str | list[str], timeout_s: float = 30.0, retries: int = 2, token: str | None = None,
                 hosts: EnvHosts | None = None):
        """`hosts`: where connections may go (default: this machine's OPENTINKER_ENV_URL_ALLOW)."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("env.url: give at least one URL")
        hosts = hosts or get_settings().env_hosts
        self.shards = [_Shard(url, timeout_s, retries, token, hosts) for url in urls]
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
            except ShardUnreachable as err:
                errors.append(str(err))
                continue
            rng.bit_generator.state = answer["rng_state"]
            return answer["task"]
        return {UNAVAILABLE: f"no shard answered at {', '.join(s.url for s in self.shards)} ({'; '.join(errors)})"}

    def close(self) -> None:
        for shard in self.shards:
            shard.client.close()

    def __repr__(self) -> str:
        return self.__name__
