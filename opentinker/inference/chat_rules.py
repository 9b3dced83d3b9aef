"""What both servers hold a chat request and a reply's tool calls to, the same on either engine: ours
(server.py, tool_calls.py) and vLLM's (vllm_guard.py before vLLM reads a request, vllm_tools.py on
its replies). It runs inside vLLM's process too, so it imports only the standard library and
opentinker.core.json_text.

A request body must be JSON we read (`loads_bounded`: nesting, size, numbers, UTF-8), and a chat
history one the template can render: known roles, text or content parts, and an assistant's calls
as `{"function": {"name", "arguments"}}` whose arguments are a JSON object (as text or as an
object). Anything else is a 400 naming the message and the reason, before any engine or template
sees it: a history call whose arguments nest 5,000 deep was a 500 (RecursionError) on both engines.

A reply's `<tool_call>` blocks are tool calls only when every one of them parses, as training
parses them, and names a function the request declared; otherwise the whole reply is content, the
model's text as it wrote it, and the server logs one line saying why (`undeclared`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from opentinker.core.json_text import JsonTextError, loads_bounded

ROLES = ("system", "developer", "user", "assistant", "tool")


class BadChatRequest(ValueError):
    """A request this server refuses (a 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


def shown(value: Any, limit: int = 60) -> str:
    """A value as an error line quotes it: short, whatever the client sent."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def read_body(raw: bytes) -> Any:
    """The request body's JSON (its size is the body limit's to bound: BodyLimit runs first)."""
    try:
        return loads_bounded(raw, max_chars=max(len(raw), 1))
    except JsonTextError as err:
        raise BadChatRequest(f"the request body is not JSON this server reads: {err}", None) from None


def call_arguments(call: Any, where: str) -> dict[str, Any]:
    """An assistant's tool call's arguments as an object (OpenAI sends them as JSON text)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise BadChatRequest(f'{where}: a tool call is {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments)
        except JsonTextError as err:
            raise BadChatRequest(f"{where}.function.arguments: not JSON this server reads ({err})") from None
    if not isinstance(arguments, dict):
        raise BadChatRequest(f"{where}.function.arguments: must be a JSON object, not {shown(arguments)}")
    return arguments


def _content_ok(content: Any) -> bool:
    return content is None or isinstance(content, str) or (
        isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content))


def check_messages(messages: Any) -> None:
    """BadChatRequest, naming the message, for a history no template should be handed."""
    if not isinstance(messages, list):
        raise BadChatRequest("messages: must be a list of messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadChatRequest(f"{where}: must be an object with a role and content")
        role = message.get("role")
        if role not in ROLES:
            raise BadChatRequest(f"{where}.role: {shown(role)} is not a role this server renders ({', '.join(ROLES)})")
        if not _content_ok(message.get("content")):
            raise BadChatRequest(f"{where}.content: must be text, a list of content parts or null")
        for field in ("name", "tool_call_id"):
            if message.get(field) is not None and not isinstance(message[field], str):
                raise BadChatRequest(f"{where}.{field}: must be text")
        calls = message.get("tool_calls")
        if calls in (None, []):
            continue
        if role != "assistant" or not isinstance(calls, list):
            raise BadChatRequest(f"{where}.tool_calls: only an assistant message carries tool calls, as a list")
        for j, call in enumerate(calls):
            call_arguments(call, f"{where}.tool_calls[{j}]")


def check_body(raw: bytes) -> None:
    """A POST body: JSON we read, and a chat's history one we render."""
    data = read_body(raw)
    if isinstance(data, dict) and "messages" in data:
        check_messages(data["messages"])


def declared_names(tools: Any) -> set[str]:
    """The function names a request's `tools` declare."""
    return {t["function"]["name"] for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)}


def undeclared(names: Iterable[str], declared: set[str]) -> str | None:
    """Why calls of `names` are not returned as tool calls (None: every one is declared)."""
    unknown = sorted({n for n in names if n not in declared})
    if not unknown:
        return None
    return (f"the reply calls {', '.join(shown(n) for n in unknown)}, which the request did not declare (it declared "
            f"{', '.join(sorted(declared)) or 'none'}): returned as content")


# --- the ASGI guard ----------------------------------------------------------------------------


async def _refuse(send: Callable, err: BadChatRequest) -> None:
    body = json.dumps({"error": {"message": str(err), "type": "invalid_request_error", "param": err.param, "code": None}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class CheckedBodies:
    """ASGI: a POST body in JSON (or of no stated type) is read whole and checked (`check_body`)
    before the app sees it: a 400 in OpenAI's error body, else the same bytes handed on. Wear it
    inside BodyLimit, which bounds what is read."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        headers = dict(scope.get("headers") or []) if scope["type"] == "http" else {}
        kind = headers.get(b"content-type", b"").lower()
        if scope["type"] != "http" or scope.get("method") != "POST" or (kind and b"json" not in kind):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away (or BodyLimit refused the body, and answered)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body:
            try:
                check_body(body)
            except BadChatRequest as err:
                return await _refuse(send, err)
        handed = False

        async def replay() -> dict[str, Any]:
            nonlocal handed
            if handed:
                return await receive()  # what follows the body: the disconnect, when it comes
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
