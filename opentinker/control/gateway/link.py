"""The gateway's relay of the client link: the user's client holds a WebSocket to the gateway
(it opens no port), the job posts its environment calls to the gateway, and the gateway passes
them to the client and streams each answer back as it arrives (see opentinker.env.linked).

One client per job: while a link is open, another client's link is refused (409) unless it asks
to take over, and then the old client's socket closes with TAKEN_OVER so that its fit() is told.
The same client reopening its link (its old socket not yet seen dead) replaces it quietly. The
check and the claim run with no await between them, so of racing clients exactly one links.
When a link closes, the calls it still owed fail (their episodes fail and are counted); calls
arriving while no client is linked wait up to their `wait_s` for one (task draws do, episode
calls do not) and otherwise fail with the reason.
Anything malformed a client sends is dropped: it can cost that job's episodes, never the gateway.
An answer over OPENTINKER_ENV_MAX_RESPONSE_BYTES reaches the job as that call's error, with the
numbers; a frame over the gateway's WebSocket limit (uvicorn's ws_max_size) closes the link, and
the calls it owed fail saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from opentinker.core.settings import get_settings
from opentinker.env.linked import TAKEN_OVER
from opentinker.env.remote import over_limit

log = logging.getLogger(__name__)
OPS = ("generate", "reset", "step", "call_tool", "close")
MAX_CALLS = 1024
MESSAGE_TOO_BIG = 1009  # the WebSocket close code of a frame over the server's limit


@dataclass
class _Link:
    socket: WebSocket
    client: str | None = None  # the id the client's EnvironmentLink sends: its own reconnects replace it
    owed: set[str] = field(default_factory=set)  # ids of calls sent to this client and not answered yet
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LinkHub:
    """Links by job id, and the futures of the calls they owe."""

    def __init__(self, max_answer_bytes: int | None = None) -> None:
        """`max_answer_bytes`: the most one answer may hold as relayed (default OPENTINKER_ENV_MAX_RESPONSE_BYTES)."""
        self.max_answer_bytes = max_answer_bytes or get_settings().env_max_response_bytes
        self._links: dict[str, _Link] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._pending: dict[str, asyncio.Future] = {}

    def linked(self, job_id: str) -> bool:
        return job_id in self._links

    def _event(self, job_id: str) -> asyncio.Event:
        return self._changed.setdefault(job_id, asyncio.Event())

    # --- the client's side ------------------------------------------------------------------
    async def serve_client(self, job_id: str, socket: WebSocket, client: str | None = None, takeover: bool = False) -> None:
        """Hold a client's link until it closes; answers resolve the calls they name."""
        old = self._links.get(job_id)
        if old is not None and not takeover and (client is None or client != old.client):
            await _deny(socket, "another client is linked to this job (its fit() serves the game); fit(takeover=True) replaces it")
            return
        link = self._links[job_id] = _Link(socket, client)  # claimed: nothing awaited since the check
        try:
            async with link.send_lock:  # calls for this link wait until it is accepted
                await socket.accept()
        except Exception:  # noqa: BLE001 - the client left during the handshake
            if self._links.get(job_id) is link:
                del self._links[job_id]
            return
        if old is not None:
            self._fail(old, "the client's environment link was replaced by a new one")
            taken = old.client is None or old.client != client
            await _close_quietly(old.socket, TAKEN_OVER if taken else 1000, "taken over by another client" if taken else "reopened")
        self._event(job_id).set()
        closed = None
        try:
            while True:
                frame = await socket.receive_text()
                for result in _results(frame):
                    future = self._pending.pop(result["id"], None) if result["id"] in link.owed else None
                    link.owed.discard(result["id"])
                    if future is not None and not future.done():
                        future.set_result(result)
        except WebSocketDisconnect as err:
            closed = err.code
        finally:
            if self._links.get(job_id) is link:
                del self._links[job_id]
            self._fail(link, "the client's environment link closed: it sent a frame over the gateway's WebSocket limit (close code "
                             "1009), so the answers in it were lost" if closed == MESSAGE_TOO_BIG
                       else "the client's environment link closed (the episodes it was playing failed)")

    def _fail(self, link: _Link, reason: str) -> None:
        for call_id in link.owed:
            future = self._pending.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result({"id": call_id, "error": reason, "link_down": True})
        link.owed.clear()

    # --- the job's side ---------------------------------------------------------------------
    async def _wait_link(self, job_id: str, wait_s: float) -> _Link | None:
        deadline = time.monotonic() + wait_s
        while (link := self._links.get(job_id)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            event = self._event(job_id)
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
        return link

    def _capped(self, result: dict[str, Any]) -> bytes:
        """The answer's line, or that call's error when it is over the limit (the job reads no more)."""
        line = _line(result)
        if len(line) - 1 > self.max_answer_bytes:
            return _line({"id": result["id"], "error": over_limit(self.max_answer_bytes, f"{len(line) - 1:,} bytes from the client")})
        return line

    async def relay(self, job_id: str, calls: list[dict[str, Any]], timeout_s: float) -> AsyncIterator[bytes]:
        """Send `calls` to the job's client and yield one NDJSON line per call as it is answered
        (an error line for a call the client did not answer within `timeout_s`)."""
        wait_s = max((float(c.get("wait_s") or 0) for c in calls), default=0.0)
        link = await self._wait_link(job_id, wait_s)
        if link is None:
            reason = (f"no client is linked to job {job_id}" + (f" (waited {wait_s:g}s)" if wait_s else "")
                      + ": the game runs in the process that called ServiceClient.fit; call fit() again to reconnect")
            for call in calls:
                yield _line({"id": call["id"], "error": reason, "link_down": True})
            return
        loop = asyncio.get_running_loop()
        futures = {}
        for call in calls:
            futures[call["id"]] = self._pending[call["id"]] = loop.create_future()
            link.owed.add(call["id"])
        try:
            async with link.send_lock:
                await link.socket.send_text(json.dumps({"calls": [{k: v for k, v in c.items() if k != "wait_s"} for c in calls]}))
        except Exception as err:  # noqa: BLE001 - the link broke while sending: these calls fail
            self._fail(link, f"the client's environment link broke ({type(err).__name__})")
        deadline = loop.time() + timeout_s
        waiting = set(futures.values())
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    yield self._capped(future.result())
                if not done:
                    break
        finally:
            for call_id, future in futures.items():
                if not future.done():
                    self._pending.pop(call_id, None)
                    link.owed.discard(call_id)
                    future.cancel()
        for call_id, future in futures.items():
            if future.cancelled():
                yield _line({"id": call_id, "error": f"the client did not answer within {timeout_s:g}s"})


def valid_calls(body: Any) -> tuple[list[dict[str, Any]], float]:
    """(calls, timeout) of a job's request, or ValueError saying what is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("calls"), list) or not body["calls"]:
        raise ValueError("expected {\"calls\": [...], \"timeout_s\": …}")
    calls = body["calls"]
    if len(calls) > MAX_CALLS:
        raise ValueError(f"at most {MAX_CALLS} calls per request")
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("op") not in OPS:
            raise ValueError(f"each call needs an id and an op among {', '.join(OPS)}")
    timeout = body.get("timeout_s", 30.0)
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
        raise ValueError("timeout_s must be a number of seconds in (0, 3600]")
    return calls, float(timeout)


def _results(frame: str) -> list[dict[str, Any]]:
    """The well-formed results of a client frame; the rest is dropped (and logged)."""
    try:
        results = json.loads(frame)["results"]
        assert isinstance(results, list)
    except (ValueError, KeyError, TypeError, AssertionError):
        log.warning("dropped a malformed frame from a client link")
        return []
    return [r for r in results if isinstance(r, dict) and isinstance(r.get("id"), str) and ("ok" in r or "error" in r)]


def _line(result: dict[str, Any]) -> bytes:
    return (json.dumps(result) + "\n").encode()


async def _close_quietly(socket: WebSocket, code: int, reason: str) -> None:
    try:
        await socket.close(code=code, reason=reason)
    except Exception:  # noqa: BLE001 - it may be gone already
        pass


async def _deny(socket: WebSocket, detail: str) -> None:
    """Refuse a handshake with 409 and the reason (a server without denial responses: 403)."""
    try:
        await socket.send_denial_response(JSONResponse({"detail": detail}, status_code=409))
    except RuntimeError:
        await socket.close(code=1008)
