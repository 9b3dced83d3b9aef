"""The job's side of the client link: a game that lives in the user's own process, played
through the gateway (the user's client opened the link; nothing listens on the user's machine).

`LinkedGameClass` stands where a game class stands (GameEnvironment, the agent loop), like a
served environment's `RemoteGameClass`. Its calls are relayed by the gateway to the client:

    generate {rng_state, config}             -> {task, rng_state}     (draws continue the job's generator)
    reset    {session, game_kwargs, task}    -> {observation, system_prompt, initial_user_message, example_turns, tools}
    step     {session, action}               -> {observation, reward, done, info}
    call_tool {session, name, arguments}     -> {content} | {error}     (that episode's own tool; env.served_tools)
    close    {session}                       -> {}

Calls made by many threads at about the same time (every episode's step of a turn) travel as
one request (`_Batcher`); the gateway streams each result back as soon as the client answers it,
so one slow game never holds up the others. A failed call fails its episode (RemoteGameError).
When no client is linked, or the gateway itself does not answer (restarting), it is the same
for the job: episode calls fail at once, but drawing tasks (the start of every step) waits up to
`link_timeout_s` for the link to come back (the client reopens it on its own, or
`ServiceClient.fit` again) and then fails the job with the reason.

One client per job: the gateway refuses a second link while one is open (HTTP 409), unless it
asks to take over (`fit(takeover=True)`); the replaced client's socket closes with TAKEN_OVER.

An answer is bounded as a served environment's is (OPENTINKER_ENV_MAX_RESPONSE_BYTES): the gateway
turns a client's answer over it into that call's error with the numbers, and this side counts each
streamed line as it arrives and refuses one past the limit before decoding it (`capped_lines`).
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from opentinker.core.polling import is_blip
from opentinker.core.settings import get_settings
from opentinker.env.base import AbstractGame, GameTool, StepResult, ToolFailure
from opentinker.env.observation import Observation, from_wire
from opentinker.env.remote import AnswerRefused, RemoteGameError, over_limit
from opentinker.env.served_tools import tools_from_listing


TAKEN_OVER = 4410  # close code: another client of the job took the link over (fit(takeover=True))


class LinkDown(RuntimeError):
    """No client served the job's environment within the link timeout: the job cannot go on."""


class NoClient(RemoteGameError):
    """The call found no client (or lost it, or the gateway did not answer): an episode fails; a
    task draw waits and tries again."""


def link_path(job_id: str) -> str:
    """The gateway's job-side endpoint of a job's link (authenticated with the job token)."""
    return f"/v1/internal/jobs/{job_id}/link"


def capped_lines(response: httpx.Response, limit: int) -> Iterator[bytes]:
    """The lines of a streamed NDJSON response, each counted as it arrives and refused
    (AnswerRefused) once it passes `limit` bytes, before any of it is decoded."""
    line = bytearray()
    for chunk in response.iter_raw():
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            line += chunk[start:] if end < 0 else chunk[start:end]
            if len(line) > limit:
                raise AnswerRefused(over_limit(limit, f"{len(line):,} bytes of one answer read and more coming"))
            if end < 0:
                break
            yield bytes(line)
            line.clear()
            start = end + 1
    if line:
        yield bytes(line)


class _Batcher:
    """Calls from many threads sent together: a call waits on its future; the sender takes every
    call queued within `window_s` of the first and posts them as one request, whose streamed
    answer resolves the futures one by one as results arrive."""

    def __init__(self, client: httpx.Client, path: str, timeout_s: float, max_answer_bytes: int, window_s: float = 0.003,
                 max_calls: int = 256):
        self.client, self.path, self.timeout_s, self.max_answer_bytes = client, path, timeout_s, max_answer_bytes
        self.window_s, self.max_calls = window_s, max_calls
        self._queue: queue.Queue[tuple[dict[str, Any], Future]] = queue.Queue()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="link-request")
        threading.Thread(target=self._send_loop, name="link-batcher", daemon=True).start()

    def call(self, op: str, wait_s: float = 0.0, **fields: Any) -> Future:
        future: Future = Future()
        self._queue.put(({"id": f"{self._prefix}-{next(self._ids)}", "op": op, "wait_s": wait_s, **fields}, future))
        return future

    def _send_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            try:
                while len(batch) < self.max_calls:
                    batch.append(self._queue.get(timeout=self.window_s))
            except queue.Empty:
                pass
            self._pool.submit(self._post, batch)

    def _post(self, batch: list[tuple[dict[str, Any], Future]]) -> None:
        pending = {call["id"]: future for call, future in batch}
        wait_s = max(call["wait_s"] for call, _ in batch)
        try:
            with self.client.stream("POST", self.path, json={"calls": [c for c, _ in batch], "timeout_s": self.timeout_s},
                                    timeout=httpx.Timeout(self.timeout_s + wait_s + 10.0, connect=10.0)) as response:
                if response.status_code != 200:
                    response.read()
                    kind = NoClient if response.status_code in (502, 503, 504) else RemoteGameError  # a proxy, the gateway coming back
                    raise kind(f"gateway link: HTTP {response.status_code}: {response.text[:300]}")
                for line in capped_lines(response, self.max_answer_bytes):
                    if not line.strip():
                        continue
                    result = json.loads(line)
                    future = pending.pop(result.get("id"), None)
                    if future is not None:
                        future.set_result(result)
        except Exception as err:  # noqa: BLE001 - every call of the batch learns why
            if is_blip(err):  # no answer from the gateway is a lost link, as a client gone is
                err = NoClient(f"the gateway did not answer ({type(err).__name__}: {err})")
            elif isinstance(err, AnswerRefused):  # the rest of the stream is never read: the connection closes
                err = RemoteGameError(f"gateway link: {err}")
            elif not isinstance(err, RemoteGameError):
                err = RemoteGameError(f"gateway link: {type(err).__name__}: {err}")
            for future in pending.values():
                future.set_exception(err)
            return
        for future in pending.values():
            future.set_exception(RemoteGameError("gateway link: the answer ended without this call"))


class LinkedGame(AbstractGame):
    """One episode of the user's game, in the user's process. The job names the session."""

    hosted_elsewhere = True  # the client starts the episode (seeds, generate_initial_state)

    def __init__(self, link: LinkedGameClass, game_kwargs: dict[str, Any]):
        self._link, self._game_kwargs = link, game_kwargs
        self._session = uuid.uuid4().hex
        self._prompts: dict[str, Any] = {"system_prompt": "", "initial_user_message": "", "example_turns": []}
        self._tools: Any = None
        self._opened = False

    def get_system_prompt(self) -> str:
        return self._prompts["system_prompt"]

    def get_initial_user_message(self) -> str:
        return self._prompts["initial_user_message"]

    def get_example_turns(self) -> list[dict[str, str]]:
        return self._prompts["example_turns"]

    def reset(self, **task: Any) -> str | Observation:
        self._opened = True
        answer = self._link.ask("reset", session=self._session, game_kwargs=self._game_kwargs, task=task)
        self._prompts = {k: answer[k] for k in self._prompts}
        self._tools = answer.get("tools")
        return from_wire(answer["observation"], "reset's observation")

    def step(self, action: str) -> StepResult:
        answer = self._link.ask("step", session=self._session, action=action)
        return StepResult(from_wire(answer["observation"]), answer["reward"], answer["done"], answer["info"])

    def get_tools(self) -> list[GameTool]:
        """The tools the client listed with reset's answer; RemoteGameError for a malformed list."""
        try:
            return tools_from_listing(self._tools, self._call_tool, self._link.batcher.timeout_s)
        except ValueError as err:
            raise RemoteGameError(f"the client's game: the episode's tool list is malformed: {err}") from None

    def _call_tool(self, name: str, arguments: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:  # sent once (a call may have effects); the gateway bounds the wait by the link's timeout
            return self._link.ask("call_tool", session=self._session, name=name, arguments=arguments)
        except RemoteGameError as err:
            raise ToolFailure(str(err)) from None

    def close(self) -> None:
        if self._opened:  # fire and forget: the client drops the session
            self._link.batcher.call("close", session=self._session)


class LinkedGameClass:
    """The user's game class, reached through the gateway; `name` is what the user calls it."""

    def __init__(self, gateway_url: str, job_id: str, token: str, name: str = "game", timeout_s: float = 30.0,
                 link_timeout_s: float = 300.0, max_answer_bytes: int | None = None):
        """`max_answer_bytes`: default OPENTINKER_ENV_MAX_RESPONSE_BYTES."""
        self.__name__ = name
        self.job_id, self.link_timeout_s = job_id, link_timeout_s
        client = httpx.Client(base_url=gateway_url.rstrip("/"), trust_env=False,
                              headers={"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"})
        self.batcher = _Batcher(client, link_path(job_id), timeout_s, max_answer_bytes or get_settings().env_max_response_bytes)

    def ask(self, op: str, wait_s: float = 0.0, **fields: Any) -> dict[str, Any]:
        """One call's answer, or RemoteGameError with the client's (or the gateway's) reason."""
        result = self.batcher.call(op, wait_s, **fields).result()
        if "error" in result:
            raise (NoClient if result.get("link_down") else RemoteGameError)(result["error"])
        return result["ok"]

    def __call__(self, **game_kwargs: Any) -> LinkedGame:
        return LinkedGame(self, game_kwargs)

    def generate_task(self, rng: Any, **config: Any) -> dict[str, Any]:
        """Continue `rng` in the client (its game's own generator, or a seed task); waits for the
        link (no client, or no gateway) up to `link_timeout_s`, then fails the job (LinkDown)."""
        deadline = time.monotonic() + self.link_timeout_s
        backoff = wait_exponential(multiplier=0.5, max=5)  # the last try lands on the deadline
        retrying = Retrying(retry=retry_if_exception_type(NoClient), stop=stop_after_delay(self.link_timeout_s), reraise=True,
                            wait=lambda state: min(backoff(state), max(0.0, deadline - time.monotonic())))
        try:
            answer = retrying(lambda: self.ask("generate", wait_s=max(0.0, deadline - time.monotonic()),
                                               rng_state=rng.bit_generator.state, config=config))
        except NoClient as err:
            raise LinkDown(f"job {self.job_id}: no link to the client's environment for {self.link_timeout_s:g}s "
                           f"(env.link_timeout_s): {err}") from None
        except RemoteGameError as err:
            raise LinkDown(f"job {self.job_id}: the client's game could not draw a task: {err}") from None
        rng.bit_generator.state = answer["rng_state"]
        return answer["task"]

    def __repr__(self) -> str:
        return f"LinkedGame({self.__name__}, job {self.job_id})"
