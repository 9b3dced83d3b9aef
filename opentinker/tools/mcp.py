"""An MCP server's tools as a job's declared tools, over streamable HTTP with the official `mcp` SDK.

`McpTools(url, hosts).tools()` runs when the job starts: it checks the URL by the rule of `env.url`
(opentinker.core.env_hosts: the operator's OPENTINKER_ENV_URL_ALLOW, never the stack's own servers),
opens one MCP session, lists the server's tools (every page of `tools/list`) and returns them as
`Tool`s. A URL the rule refuses, a server that is not MCP, one that does not answer within
`timeout_s`, or a listing with a bad tool name fails there with one line naming the URL (ValueError
or RuntimeError): the job does not start.

The session lives in one event-loop thread of its own; every episode's call (from its worker
thread, many at once) is submitted to it and waited for at most `timeout_s`, so one session serves
them all. A session that died (its connection closed, the server forgot it) is opened again once,
by the next call; the call that found it dead fails. Every connection goes to the address checked
as it is made (opentinker.env.confined_net: DNS rebinding), without the process's proxies.

What the model reads: the call's text parts, joined by newlines; an image, audio or resource part
is described in one line; no text part but structured content: that, as JSON. A result marked
`isError`, a JSON-RPC error, or no answer in `timeout_s`: ToolError with the reason.
Size: each HTTP answer of the server is counted as it streams in and refused past
`max_response_bytes` (default OPENTINKER_ENV_MAX_RESPONSE_BYTES, the environments' limit): the call
fails with ToolError naming the limit, the rest is never read (no truncated answer: a cut JSON-RPC
message is no answer at all), and the session goes on. Compressed answers are refused likewise
(the client asks for `identity`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from typing import Any

from opentinker.core.env_hosts import EnvHosts
from opentinker.core.schema_cost import SchemaRefused
from opentinker.core.settings import get_settings
from opentinker.env.confined_net import confined_async_transport
from opentinker.env.remote import LIMIT_SETTING
from opentinker.tools.declared import NAME_PATTERN, Tool, ToolError
from opentinker.tools.toolbox import validator_of

MAX_TOOLS = 256  # a server listing more would fill the prompt with schemas
MAX_PAGES = 64
_MARGIN_S = 2.0  # the calling thread waits this much past timeout_s for the loop's own timeout to answer
_CLOSE_S = 5.0
_READ_TIMES = 4  # an HTTP read error ends the SDK's whole session: a call's answer, abandoned at timeout_s, may come until then
_SLACK_S = 1.0  # a call's opening of a session counts too: the whole call ends by timeout_s + this
_REFUSED = "opentinker: refused "  # the prefix of our own refusals, as the SDK passes them on in its messages


def _leaf(err: BaseException) -> BaseException:
    """The first real exception inside anyio's exception groups."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return err


def _reason(err: BaseException) -> str:
    """One line: why a call or the listing failed."""
    err = _leaf(err)
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return "no answer in time"
    text = str(getattr(err, "message", "") or err or type(err).__name__)
    if _REFUSED in text:
        text = text[text.index(_REFUSED) + len(_REFUSED):]
    elif not isinstance(err, (RuntimeError, ValueError)) or type(err).__name__ == "MCPError":
        text = f"{type(err).__name__}: {text}"
    return " ".join(text.split())[:500]


def _lost(err: BaseException) -> bool:
    """Whether a call's failure says the session itself is gone (closed, or forgotten by the server)."""
    err = _leaf(err)
    message = str(getattr(err, "message", ""))
    if type(err).__name__ == "MCPError":
        return (err.code == -32000 and not message.startswith("SSE stream failed")) or message == "Session terminated"
    return False  # our own timeout (a cancellation) leaves the session as it was; a dead one is found by `_session`


def describe(part: Any) -> str:
    """One content part of a result as the model reads it: text as is, anything else in one line."""
    kind = getattr(part, "type", None)
    if kind == "text":
        return str(part.text)
    if kind in ("image", "audio"):
        return f"[{kind}: {getattr(part, 'mime_type', None) or getattr(part, 'mimeType', '?')}, {len(part.data or ''):,} base64 characters]"
    if kind == "resource_link":
        return f"[resource link: {part.uri}{f' ({part.name})' if getattr(part, 'name', None) else ''}]"
    if kind == "resource":
        resource = part.resource
        size = len(getattr(resource, "text", None) or getattr(resource, "blob", None) or "")
        return f"[resource: {resource.uri} ({getattr(resource, 'mime_type', None) or 'no type'}), {size:,} characters]"
    return f"[{kind or type(part).__name__} content]"


def result_text(result: Any, limit: int) -> str:
    """A CallToolResult as the model reads it; ToolError when it is marked isError or over `limit` bytes."""
    parts = [describe(p) for p in (result.content or [])]
    structured = getattr(result, "structured_content", None)
    text = "\n".join(parts) if parts else (json.dumps(structured, sort_keys=True, default=str) if structured is not None else "")
    if len(text.encode()) > limit:
        raise ToolError(f"the answer is over the limit of {LIMIT_SETTING} ({limit:,} bytes)")
    if result.is_error:
        raise ToolError(text or "the tool failed")
    return text


def _capped_transport(hosts: EnvHosts, limit: int) -> Any:
    """The confined httpx2 transport with every non-SSE answer counted as it streams in and refused
    past `limit` (a compressed one too), by an error the SDK turns into that request's failure (it
    does not end the session); SSE answers are capped per event by the SDK (`max_sse_event_size`)."""
    import httpx2

    inner = confined_async_transport(hosts, flavour="httpx2")

    class Refused(httpx2.StreamError):
        pass

    class Counted(httpx2.AsyncByteStream):
        def __init__(self, stream: Any, announced: str, encoding: str):
            self.stream, self.announced, self.encoding = stream, announced, encoding

        async def __aiter__(self) -> Any:
            if self.encoding not in ("", "identity"):
                raise Refused(f"{_REFUSED}the answer is compressed (Content-Encoding: {self.encoding[:40]})")
            if self.announced.isdigit() and int(self.announced) > limit:
                raise Refused(f"{_REFUSED}the answer is over the limit of {LIMIT_SETTING} ({limit:,} bytes): "
                              f"{int(self.announced):,} bytes announced")
            seen = 0
            async for chunk in self.stream:
                seen += len(chunk)
                if seen > limit:
                    raise Refused(f"{_REFUSED}the answer is over the limit of {LIMIT_SETTING} ({limit:,} bytes): "
                                  f"{seen:,} bytes read and more coming")
                yield chunk

        async def aclose(self) -> None:
            await self.stream.aclose()

    class Capped(httpx2.AsyncBaseTransport):
        async def handle_async_request(self, request: Any) -> Any:
            response = await inner.handle_async_request(request)
            if response.headers.get("content-type", "").lower().startswith("text/event-stream"):
                return response
            stream = Counted(response.stream, response.headers.get("content-length", ""),
                             response.headers.get("content-encoding", "").strip().lower())
            return httpx2.Response(response.status_code, headers=response.headers, stream=stream, request=request,
                                   extensions=response.extensions)

        async def aclose(self) -> None:
            await inner.aclose()

    return Capped()


class McpTools:
    """One MCP server's tools for one job: `tools()` at its start, `close()` at its end."""

    def __init__(self, url: str, hosts: EnvHosts | None = None, timeout_s: float = 30.0, max_response_bytes: int | None = None,
                 headers: dict[str, str] | None = None, field: str = "env.tools.mcp"):
        """`hosts`: where connections may go (default: this machine's OPENTINKER_ENV_URL_ALLOW);
        `timeout_s` bounds the listing and each call; `max_response_bytes` (default
        OPENTINKER_ENV_MAX_RESPONSE_BYTES) bounds each answer; `headers` go with every request
        (e.g. Authorization); `field` names the URL in messages (the spec's key)."""
        settings = get_settings() if hosts is None or max_response_bytes is None else None
        self.url, self.field, self.timeout_s = url, field, float(timeout_s)
        self.hosts = hosts or settings.env_hosts
        self.max_response_bytes = max_response_bytes or settings.env_max_response_bytes
        self.headers = dict(headers or {})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._client: Any = None  # the live mcp.Client, touched only on the loop
        self._holder: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._opening: asyncio.Lock | None = None
        self.reconnects = 0

    # --- the loop thread ---------------------------------------------------------------------

    def _run(self, coro: Any, limit_s: float) -> Any:
        """`coro` on this server's loop, waited for at most `limit_s` (then cancelled: TimeoutError)."""
        with self._start_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp {self.url}", daemon=True)
                self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(limit_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer in {limit_s:g}s") from None

    async def _hold(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Open the session and keep it open until `stop` (or until it dies): the SDK's contexts are
        entered and left in this one task, as anyio requires."""
        import httpx2
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        client: Any = None
        try:
            http = httpx2.AsyncClient(transport=_capped_transport(self.hosts, self.max_response_bytes), trust_env=False,
                                      headers={"Accept-Encoding": "identity", **self.headers},
                                      timeout=httpx2.Timeout(self.timeout_s, read=_READ_TIMES * self.timeout_s))
            transport = streamable_http_client(self.url, http_client=http, max_sse_event_size=self.max_response_bytes)
            async with http, Client(transport, read_timeout_seconds=self.timeout_s, cache=None) as client:
                self._client = client
                ready.set_result(client)
                await stop.wait()
        except BaseException as err:  # noqa: BLE001 - the opener hears why; a dead session is opened again later
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else ConnectionError("the session was cancelled"))
        finally:
            if self._client is client:
                self._client = None

    async def _session(self) -> Any:
        """The live session, opened now when there is none (the first time, or after it died)."""
        self._opening = self._opening or asyncio.Lock()
        async with self._opening:
            if self._client is not None and self._holder is not None and not self._holder.done():
                return self._client
            if self._holder is not None:
                self.reconnects += 1
            ready, self._stop = asyncio.get_running_loop().create_future(), asyncio.Event()
            self._holder = asyncio.ensure_future(self._hold(ready, self._stop))
            try:
                return await ready
            except BaseException:
                self._holder.cancel()
                raise

    def _retire(self, client: Any) -> None:
        """Give up a session that died, so the next call opens another."""
        if client is not None and client is self._client and self._stop is not None:
            self._client = None
            self._stop.set()

    # --- listing and calls ----------------------------------------------------------------------

    async def _list(self) -> list[Any]:
        async with asyncio.timeout(self.timeout_s):
            client = await self._session()
            found, cursor = [], None
            for _ in range(MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                found += page.tools
                cursor = page.next_cursor
                if not cursor or len(found) > MAX_TOOLS:
                    break
            else:
                raise RuntimeError(f"the listing goes on past {MAX_PAGES} pages")
            return found

    def tools(self) -> list[Tool]:
        """The server's tools; ValueError (the rule refuses the URL, a bad tool) or RuntimeError (no
        MCP server answered) with one line naming the URL."""
        if why := self.hosts.refusal(self.url, self.field):
            raise ValueError(why)
        try:
            listed = self._run(self._list(), self.timeout_s + _MARGIN_S)
        except Exception as err:  # noqa: BLE001 - whatever failed, one line
            self.close()
            reason = f"no answer in {self.timeout_s:g}s" if _reason(err) == "no answer in time" else _reason(err)
            raise RuntimeError(f"{self.field}: {self.url}: no MCP server's tools listed ({reason})") from None
        try:
            return self._declared(listed)
        except ValueError:
            self.close()
            raise

    def _declared(self, listed: list[Any]) -> list[Tool]:
        if len(listed) > MAX_TOOLS:
            raise ValueError(f"{self.field}: {self.url}: lists more than {MAX_TOOLS} tools")
        out, seen = [], set()
        for item in listed:
            name = str(item.name)
            if not re.match(NAME_PATTERN, name):
                raise ValueError(f"{self.field}: {self.url}: the tool name {name[:80]!r} does not match {NAME_PATTERN}")
            if name in seen:
                raise ValueError(f"{self.field}: {self.url}: lists the tool {name!r} twice")
            seen.add(name)
            schema = getattr(item, "input_schema", None) or getattr(item, "inputSchema", None) or {"type": "object", "properties": {}}
            if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                raise ValueError(f"{self.field}: {self.url}: the tool {name!r}'s inputSchema is not a JSON Schema object")
            tool = Tool(name, str(item.description or ""), self._caller(name), {"type": "object", **schema},
                        timeout_s=self.timeout_s + _MARGIN_S)
            try:
                validator_of(tool)  # its cost bounded now, and its validator built once for the job
            except SchemaRefused as err:
                raise ValueError(f"{self.field}: {self.url}: the tool {name!r}'s input schema {err} (refused)") from None
            out.append(tool)
        return out

    def _caller(self, name: str) -> Any:
        def run(arguments: dict[str, Any]) -> str:
            return self.call(name, arguments)

        return run

    async def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        async with asyncio.timeout(self.timeout_s + _SLACK_S):  # the SDK's read timeout (timeout_s) comes first
            client = await self._session()
            try:
                return await client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s)
            except BaseException as err:
                if _lost(err):
                    self._retire(client)
                raise

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """One `tools/call` through the shared session: the text the model reads, or ToolError."""
        try:
            result = self._run(self._call(name, arguments), self.timeout_s + _MARGIN_S)
        except ToolError:
            raise
        except BaseException as err:  # noqa: BLE001 - a failed call is the model's to read, never the job's end
            why = _reason(err)
            if why == "no answer in time" or "timed out" in why:
                why = f"no answer in {self.timeout_s:g}s (the tool's timeout)"
            elif "Server-sent event exceeded" in why:  # the SDK's own cap of one SSE event, set to ours
                why = f"the answer is over the limit of {LIMIT_SETTING} ({self.max_response_bytes:,} bytes): one event past it"
            raise ToolError(f"{name}: {why}") from None
        return result_text(result, self.max_response_bytes)

    def close(self) -> None:
        """End the session and the loop thread (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return

        async def shut() -> None:
            if self._stop is not None:
                self._stop.set()
            if self._holder is not None:
                await asyncio.wait([self._holder], timeout=_CLOSE_S)

        try:
            self._run(shut(), _CLOSE_S + 1)
        except Exception:  # noqa: BLE001, S110 - a session that will not close dies with its thread
            pass
        with self._start_lock:
            self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(_CLOSE_S)
        if not loop.is_running():
            loop.close()

    def __repr__(self) -> str:
        return f"McpTools({self.url})"
