"""Guards the project's HTTP servers wear (gateway, inference, environment server), as plain ASGI
middleware: a cap on request bodies (413), a bearer token (401), and a 500 that leaves the
connection usable (ServerErrors).

Plain ASGI so that each app, whatever framework built it, gets the same behaviour before any of
its code runs: an oversized body is refused while it streams in, never buffered whole.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from opentinker.core.tokens import bearer

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


async def _reply(send: Callable, status: int, detail: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """413 for a request body over `max_bytes` (by Content-Length, or counted as it arrives: the
    app then sees the client as gone, and whatever it still answers is dropped). `on_refused(scope,
    head)`, awaited before the 413, is told of each refusal with the body's first bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[Scope, bytes], Awaitable[None]] | None = None):
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    async def _refuse(self, scope: Scope, send: Callable, head: bytes, detail: str) -> None:
        if self.on_refused is not None:
            try:
                await self.on_refused(scope, head)
            except Exception:  # noqa: BLE001 - the 413 goes out whatever the hook does
                logging.getLogger(__name__).warning("on_refused failed", exc_info=True)
        await _reply(send, 413, detail)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            first = await receive() if self.on_refused is not None else {}
            return await self._refuse(scope, send, first.get("body", b""),
                                      f"request body of {int(length)} bytes is over the limit of {self.max_bytes}")
        seen, refused, started, head = 0, False, False, b""

        async def counted() -> dict:
            nonlocal seen, refused, head
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                head = head or message.get("body", b"")
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(scope, send, head, f"request body is over the limit of {self.max_bytes} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def tracked(message: dict) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, tracked)


class BearerToken:
    """401 unless the request (HTTP or WebSocket) carries `Authorization: Bearer <token>` with one of
    `tokens()` (read at each request, so a server can learn new ones); paths in `open_paths` pass."""

    def __init__(self, app: ASGIApp, tokens: Callable[[], Iterable[str]], open_paths: Iterable[str] = ("/health",)):
        self.app, self.tokens, self.open_paths = app, tokens, set(open_paths)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            return await self.app(scope, receive, send)
        token = bearer(dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1"))
        if token and any(hmac.compare_digest(token, t) for t in self.tokens()):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong token"})
            return
        await _reply(send, 401, "missing or wrong token: send Authorization: Bearer <token>", [(b"www-authenticate", b"Bearer")])


class ServerErrors:
    """An exception out of `app` ends as a 500 with one line of JSON, and the connection stays
    usable: the exception goes to `log`, not to the server. (Starlette answers the 500 and then
    raises the exception again, and uvicorn closes a connection whose app raised: the client's
    next request on that keep-alive connection was reset.) A response cut off half way is still
    raised: its connection cannot be reused."""

    def __init__(self, app: ASGIApp, log: logging.Logger):
        self.app, self.log = app, log

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = finished = False

        async def tracked(message: dict) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as err:  # the one place unforeseen errors end
            if started and not finished:
                raise
            if finished:  # the app's own handler answered (and logged) it already
                self.log.debug("%s %s: %s after its response", scope.get("method"), scope.get("path"), type(err).__name__)
                return
            from opentinker.core.errors import one_line

            self.log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await _reply(send, 500, one_line(err))
