"""The client's side of the link: the user's game, hosted in the user's own process for a job
that runs elsewhere. The client opens a WebSocket to the gateway (nothing listens here, so it
works wherever the client can reach the gateway) and answers the job's calls (see
opentinker.env.linked): each call runs in a thread of its own, under the same hosting rules as
every other host, and its answer goes back as soon as it is ready. An episode's tools
(`get_tools()`, asked after its reset) are listed with reset's answer and called by `call_tool`,
each within its own timeout (opentinker.env.served_tools).

A link that drops (the gateway restarted, the network) is reopened with backoff for up to
`reconnect_timeout_s`, under the same client id, so the gateway lets it replace its old socket;
the games it hosts stay, so episodes that were not mid-call go on. It ends for good, with
`lost` saying why, when another client takes the job's link over or it cannot be reopened.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from opentinker.env.hosting import generate_reply, generator_from_state, reset_reply, step_reply
from opentinker.env.linked import TAKEN_OVER
from opentinker.env.served_tools import call_reply, tool_listing, tools_by_name

log = logging.getLogger(__name__)
MAX_FRAME_BYTES = 16 * 1024**2
FRAME_BUDGET = MAX_FRAME_BYTES // 2  # answers sent together fill a frame up to this (a larger one goes alone)
MAX_ANSWER_BYTES = MAX_FRAME_BYTES - 1024  # an answer alone in a frame, with room for the frame's wrapper


def _encoded(result: dict[str, Any]) -> str:
    """An answer as JSON; one too large for a frame becomes its call's error (the episode fails, the link stays)."""
    text = json.dumps(result)
    if len(text) > MAX_ANSWER_BYTES:
        text = json.dumps({"id": result.get("id"), "error": f"the answer is {len(text):,} bytes, over what one link frame "
                                                            f"carries ({MAX_ANSWER_BYTES:,})"})
    return text


def websocket_url(gateway_url: str, job_id: str) -> str:
    base = gateway_url.rstrip("/")
    scheme = "wss" if base.startswith("https://") else "ws"
    return f"{scheme}://{base.split('://', 1)[1]}/v1/jobs/{job_id}/link"


class LinkRefused(RuntimeError):
    """The gateway will not link this client to the job (another client holds the link, or the
    job is not this key's): trying again would not help."""


class EnvironmentLink:
    """Serve `game_class` to job `job_id` until `close()` (or the process ends)."""

    def __init__(self, gateway_url: str, api_key: str | None, job_id: str, game_class: type, game_kwargs: dict[str, Any] | None = None,
                 threads: int = 64, takeover: bool = False, reconnect_timeout_s: float = 900.0):
        self.game_class, self.game_kwargs, self.job_id = game_class, dict(game_kwargs or {}), job_id
        self.client_id = uuid.uuid4().hex
        self.url = f"{websocket_url(gateway_url, job_id)}?client={self.client_id}"
        self._takeover, self.reconnect_timeout_s = takeover, reconnect_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._sessions: dict[str, Any] = {}
        self._tools: dict[str, dict[str, Any]] = {}  # each session's tools (get_tools(), asked after its reset)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env-link")
        self._outbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._socket = None
        self._closed = threading.Event()
        self.lost: str | None = None  # why the link ended for good (taken over, not reopened)
        self.calls = self.frames = self.reopened = 0  # calls answered, frames of calls received, reconnections

    def open(self) -> EnvironmentLink:
        """Connect (LinkRefused or ConnectionError with the reason when that fails) and serve in the background."""
        self._socket = self._connect(takeover=self._takeover)
        threading.Thread(target=self._serve, name="env-link-reader", daemon=True).start()
        threading.Thread(target=self._write, name="env-link-writer", daemon=True).start()
        return self

    def _connect(self, takeover: bool = False) -> Any:
        from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
        from websockets.sync.client import connect

        try:
            return connect(self.url + ("&takeover=1" if takeover else ""), additional_headers=self._headers,
                           max_size=MAX_FRAME_BYTES, open_timeout=30)
        except InvalidStatus as err:
            status = err.response.status_code
            if status >= 500:  # a proxy in front of a gateway coming back up
                raise ConnectionError(f"the gateway answered HTTP {status}") from None
            try:
                detail = json.loads(err.response.body)["detail"]
            except (ValueError, KeyError, TypeError):
                detail = f"HTTP {status}"
            raise LinkRefused(f"the gateway refused the environment link of job {self.job_id}: {detail}") from None
        except (OSError, InvalidHandshake, ConnectionClosed) as err:  # unreachable, or gone (or still starting) mid-handshake
            raise ConnectionError(f"cannot reach the gateway at {self.url.split('?')[0]}: {type(err).__name__}: {err}") from None

    @property
    def alive(self) -> bool:
        from websockets.protocol import State

        return self._socket is not None and self._socket.state is State.OPEN

    def close(self) -> None:
        self._closed.set()
        if self._socket is not None:
            self._socket.close()
        self._outbox.put(None)
        for game in list(self._sessions.values()):
            _close_game(game)
        self._sessions.clear()
        self._tools.clear()

    def _serve(self) -> None:
        """Read calls until the socket closes; then reopen it, or say why the link ended."""
        while True:
            self._read(self._socket)
            if self._closed.is_set():
                return
            if self._socket.close_code == TAKEN_OVER:
                self.lost = (f"another client took over the environment link of job {self.job_id} (fit(takeover=True)); "
                             "the job goes on with it, this fit() stops")
                return
            log.warning("environment link of job %s dropped; reopening it", self.job_id)
            try:
                socket = self._reopen()
            except Exception as err:  # noqa: BLE001 - refused, unreachable past the timeout, or anything else: fit() is told
                log.warning("environment link of job %s not reopened", self.job_id, exc_info=not isinstance(err, (LinkRefused, ConnectionError)))
                self.lost = (f"the environment link of job {self.job_id} could not be reopened ({err}); the job waits "
                             "env.link_timeout_s for a client: fit() again")
                return
            if socket is None:  # closed meanwhile
                return
            self._socket, self.reopened = socket, self.reopened + 1
            log.warning("environment link of job %s reopened", self.job_id)
            if self._closed.is_set():
                socket.close()
                return

    def _reopen(self) -> Any:
        """The link again, tried with backoff (0.5 s doubling to 5 s) for `reconnect_timeout_s`;
        None once close() was called."""
        retrying = Retrying(retry=retry_if_exception_type(ConnectionError), wait=wait_exponential(multiplier=0.5, max=5),
                            stop=stop_after_delay(self.reconnect_timeout_s) | (lambda _: self._closed.is_set()),
                            sleep=self._closed.wait, reraise=True)
        try:
            return retrying(lambda: None if self._closed.is_set() else self._connect())
        except ConnectionError:
            if self._closed.is_set():
                return None
            raise

    # --- serving ---------------------------------------------------------------------------
    def _read(self, socket: Any) -> None:
        try:
            for frame in socket:
                try:
                    calls = json.loads(frame)["calls"]
                except (ValueError, KeyError, TypeError):
                    log.warning("dropped a malformed frame from the gateway")
                    continue
                self.frames += 1
                for call in calls:
                    self._pool.submit(self._answer, call)
        except Exception as err:  # noqa: BLE001 - the link closed: the job sees its calls fail
            log.info("environment link of job %s closed: %s", self.job_id, err)

    def _write(self) -> None:
        """Send answers as they are ready, those ready together in one frame of at most half the
        frame limit (the gateway closes a link whose frame is over it); an answer too large for a
        frame alone goes as that call's error."""
        while (item := self._outbox.get()) is not None:
            batch, size = [], 0
            while item is not None:
                text = _encoded(item)
                if batch and size + len(text) > FRAME_BUDGET:
                    self._outbox.put(item)  # first in the next frame (it may come after newer answers: ids pair them)
                    break
                batch.append(text)
                size += len(text)
                if self._outbox.empty() or len(batch) >= 256:
                    break
                item = self._outbox.get_nowait()
                if item is None:
                    self._outbox.put(None)
            try:
                self._socket.send('{"results": [' + ", ".join(batch) + "]}")
            except Exception:  # noqa: BLE001 - dropped: the gateway failed what this socket owed
                continue

    def _answer(self, call: dict[str, Any]) -> None:
        call_id = call.get("id")
        try:
            result = {"id": call_id, "ok": self._run(call)}
        except Exception as err:  # noqa: BLE001 - a game bug costs one episode, never the link
            result = {"id": call_id, "error": f"{type(err).__name__}: {err}"}
        self.calls += 1
        self._outbox.put(result)

    def _run(self, call: dict[str, Any]) -> Any:
        op = call.get("op")
        if op == "generate":
            return generate_reply(self.game_class, generator_from_state(call["rng_state"]), dict(call.get("config") or {}))
        if op == "reset":
            game = self.game_class(**{**self.game_kwargs, **dict(call.get("game_kwargs") or {})})
            self._sessions[call["session"]] = game
            answer = reset_reply(game, dict(call.get("task") or {}))
            tools = list(getattr(game, "get_tools", lambda: [])() or [])  # a game that is not an AbstractGame may have none
            self._tools[call["session"]] = tools_by_name(tools)
            return {**answer, "tools": tool_listing(tools)}
        if op == "step":
            return step_reply(self._sessions[call["session"]], str(call["action"]))
        if op == "call_tool":
            tool = self._tools.get(call["session"], {}).get(str(call.get("name")))
            if tool is None:
                raise LookupError(f"this episode has no tool named {str(call.get('name'))[:80]!r}")
            return call_reply(tool, call.get("arguments"))
        if op == "close":
            _close_game(self._sessions.pop(call["session"], None))
            self._tools.pop(call["session"], None)
            return {}
        raise ValueError(f"unknown call {op!r}")


def _close_game(game: Any) -> None:
    try:
        if game is not None:
            game.close()
    except Exception:  # noqa: BLE001 - closing is best effort
        pass
