"""An OpenAI-compatible HTTP API over a serving engine, so any OpenAI client talks to a trained policy.

    GET  /health               -> {"ok": true}
    GET  /v1/models            -> the served model (and its LoRA adapters, parent = the model)
    POST /v1/chat/completions  messages in, the assistant's reply out (stream=true: server-sent events);
                               a vision-language checkpoint also takes `image_url` parts with data: URLs;
                               `tools` (tool_choice auto/none) are rendered and the reply's calls parsed
                               as the policy was trained to, of declared functions only (tool_calls.py)
    POST /v1/completions       raw prompt(s) in (text or token ids), continuation(s) out (stream=true:
                               server-sent events); `logprobs: 0` gives each sampled token's logprob,
                               `return_token_ids` / `return_tokens_as_token_ids` the tokens as ids
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (a server for adapters, see lora_routes.py)

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
requests, including a prompt plus `max_tokens` over the context length (code
`context_length_exceeded`), a body that is not JSON we read and a chat history no template should
be handed (chat_rules.py, before any route runs), 404 for a model that is not served.
`temperature: 0` is greedy. Streaming sends the reply token by token once it is generated (the CPU engine generates a whole
batch at once), so streaming clients work unchanged but see no earlier first token.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from opentinker.agent.chat import Chunk
from opentinker.backend.rollout import Completion, SamplingParams
from opentinker.core.asgi import BearerToken, BodyLimit
from opentinker.core.own_servers import SERVER_KEEP_ALIVE_S
from opentinker.core.polling import wait_for
from opentinker.env.observation import MAX_IMAGES, from_data_url
from opentinker.inference.call_recorder import EPISODE_HEADER, CallRecorder, RecordingRefused
from opentinker.inference.chat_rules import ROLES, BadChatRequest, CheckedBodies
from opentinker.inference.engine_hf import ContextLengthError, HFEngine
from opentinker.inference.lora_routes import add_lora_routes
from opentinker.inference.tool_calls import message_fields, read_tools, render, reply, stream_deltas, uses_tools

_UNSUPPORTED = ("functions", "logit_bias", "response_format", "top_logprobs", "echo", "best_of", "suffix")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


class _Sampling(BaseModel):
    # OpenAI clients send fields this server ignores (user, presence_penalty=0, ...); the ones
    # that would change the answer and are not implemented are refused by name below.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        """The engine's parameters; `max_new_tokens`: the largest of the request's budgets (each row
        keeps its own, SamplingParams' default of 24 would cut them all there)."""
        greedy = self.temperature == 0
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0 if greedy else self.temperature, top_p=self.top_p,
                              greedy=greedy)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[dict[str, Any]] | None = None

    def content_for(self, takes_images: bool) -> str | list[dict[str, Any]]:
        """The content the chat format takes: text, or (a VLM's) image parts as PIL images
        before the text; `image_url` only as `data:image/…;base64` (nothing is fetched)."""
        if not isinstance(self.content, list):
            return self.content or ""
        parts: list[dict[str, Any]] = []
        for part in self.content:
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url" and takes_images:
                url = part.get("image_url", {}).get("url", "") if isinstance(part.get("image_url"), dict) else ""
                try:
                    parts.append({"type": "image", "image": from_data_url(str(url), "messages: image_url")})
                except (TypeError, ValueError) as err:
                    raise OpenAIError(400, str(err), param="messages") from None
            else:
                supported = "text and image_url (data: URLs)" if takes_images else "text (this model takes no images)"
                raise OpenAIError(400, f"content part type {kind!r} is not supported: {supported}", param="messages")
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=0, description="0: the sampled tokens' logprobs (no top alternatives)")
    return_token_ids: bool = False  # vLLM's: `token_ids` (and `prompt_token_ids`) in every choice
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens as "token_id:<id>"

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


def _cut_at_stop(text: str, completion: Completion, stops: list[str]) -> tuple[str, str]:
    """(text, finish_reason): the text up to the first stop string, if any occurs."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    if cuts:
        return text[: min(cuts)], "stop"
    return text, completion.finish_reason


def _pieces(engine: HFEngine, ids: list[int], text: str) -> Iterator[str]:
    """The final text as per-token deltas (a delta that would end inside a multi-byte character waits)."""
    sent = ""
    for k in range(1, len(ids) + 1):
        partial = engine.decode(ids[:k])
        if partial.endswith("\ufffd"):
            continue
        partial = partial[: len(text)]
        if len(partial) > len(sent) and text.startswith(partial):
            yield partial[len(sent):]
            sent = partial
    if len(sent) < len(text):
        yield text[len(sent):]


def _token_logprobs(engine: HFEngine, completion: Completion, text: str, as_ids: bool) -> tuple[dict[str, Any], list[int]]:
    """OpenAI's completion `logprobs` of the tokens that make up `text` (a stop string may have
    cut it short), and those tokens' ids. Offsets add up the tokens' own texts."""
    ids = completion.token_ids
    pieces = [engine.decode([t]) for t in ids]
    n, offsets, seen, cut = len(ids), [], 0, text != engine.decode(ids)
    for k, piece in enumerate(pieces):
        if cut and k and seen >= len(text):
            n = k
            break
        offsets.append(seen)
        seen += len(piece)
    tokens = [f"token_id:{t}" for t in ids[:n]] if as_ids else pieces[:n]
    return {"tokens": tokens, "token_logprobs": completion.logprobs[:n], "top_logprobs": None, "text_offset": offsets[:n]}, ids[:n]


def _completion_choice(engine: HFEngine, req: CompletionRequest, index: int, completion: Completion, text: str, reason: str,
                       prompt: list[int]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": reason, "logprobs": None}
    if req.logprobs is None and not req.return_token_ids:
        return choice
    logprobs, ids = _token_logprobs(engine, completion, text, req.return_tokens_as_token_ids)
    if req.logprobs is not None:
        choice["logprobs"] = logprobs
    if req.return_token_ids:
        choice |= {"token_ids": ids, "prompt_token_ids": prompt}
    return choice


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


def create_app(engine: HFEngine, model_name: str, api_key: str | None = None, max_tokens_cap: int = 2048,
               max_request_bytes: int = 16 * 1024**2, recorder: CallRecorder | None = None):
    """The API for one served model; `model_name` is the id clients put in `model`. With
    `api_key` (an inference job's token) every request but /health must carry it (401); a
    completion is at most `max_tokens_cap` tokens (the default when a request gives none; more is a
    400); bodies over `max_request_bytes` get 413. With a `recorder` (an endpoint that trains the
    user's agent: call_recorder.py) every chat call names its episode and is recorded as tokens."""
    app = FastAPI(title=f"OpenTinker inference: {model_name}")
    created = int(time.time())

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, err: OpenAIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return OpenAIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param).response()

    def check(req: _Sampling) -> str | None:
        """Refuse what this server cannot do; the LoRA adapter the request names (None: the model)."""
        extra = req.model_extra or {}
        for name in _UNSUPPORTED:
            if extra.get(name) not in (None, False, 0, [], {}):
                raise OpenAIError(400, f"`{name}` is not supported by this server", param=name)
        if req.model is None or req.model == model_name:
            return None
        if engine.adapters and req.model in engine.adapters:
            return req.model
        raise OpenAIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found", kind="NotFoundError")

    def budgets(prompts: list[list[int]], req: _Sampling, param: str) -> list[int]:
        asked = req.limit()
        try:
            allowed = [min(engine.budget(len(p), asked), max_tokens_cap) for p in prompts]
        except ContextLengthError as err:
            raise OpenAIError(400, str(err), param=param, code="context_length_exceeded") from None
        if asked is not None and asked > max_tokens_cap:
            raise OpenAIError(400, f"max_tokens: {asked} is over this server's limit of {max_tokens_cap}", param="max_tokens")
        return allowed

    async def run(prompts: list[list[int]], req: _Sampling, param: str, adapter: str | None,
                  images: list[list[Any]] | None = None) -> list[Completion]:
        expanded = [p for p in prompts for _ in range(req.n)]
        pictures = [row for row in images for _ in range(req.n)] if images else None
        limits = budgets(expanded, req, param)
        try:
            return await asyncio.wrap_future(engine.generate(expanded, limits, req.sampling(max(limits)), req.seed, adapter, pictures))
        except KeyError:  # unloaded while the request waited
            raise OpenAIError(404, f"The model `{adapter}` does not exist.", param="model", code="model_not_found",
                              kind="NotFoundError") from None

    def usage(prompts: list[list[int]], n: int, completions: list[Completion]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "model": model_name}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"object": "model", "created": created, "owned_by": "opentinker", "max_model_len": engine.context_length}
        return {"object": "list", "data": [card | {"id": model_name, "root": engine.checkpoint, "parent": None}] + [
            card | {"id": name, "root": path, "parent": model_name} for name, path in dict(engine.adapters or {}).items()]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        adapter = check(req)
        if (req.model_extra or {}).get("logprobs"):
            raise OpenAIError(400, "`logprobs` is not supported by this server for chat (/v1/completions gives `logprobs: 0`)", param="logprobs")
        try:
            tooling = read_tools(req.model_extra or {})
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content_for(engine.takes_images),
                         **message_fields(i, m.role, m.model_extra or {})} for i, m in enumerate(req.messages)]
        except BadChatRequest as err:
            raise OpenAIError(400, str(err), param=err.param) from None
        if sum(1 for m in messages if not isinstance(m["content"], str) for p in m["content"] if p["type"] == "image") > MAX_IMAGES:
            raise OpenAIError(400, f"messages: at most {MAX_IMAGES} images a request", param="messages")
        try:  # with tools, calls or results: rendered as training renders them (opentinker.tools.formats), text as text
            chat = engine.chat
            chunk = Chunk(chat.encode_rendered(render(chat.tools, chat.as_text(messages), chat.as_text(tooling.tools)), "messages")) \
                if uses_tools(messages, tooling.tools) else engine.chat_prompt(messages)
        except BadChatRequest as err:
            raise OpenAIError(400, str(err), param=err.param) from None
        except ValueError as err:
            raise OpenAIError(400, f"messages: {err}", param="messages") from None
        prompt, episode = chunk.ids, request.headers.get(EPISODE_HEADER)
        try:
            if recorder is not None:
                recorder.admit(episode, len(prompt), req.limit() or 0)
        except RecordingRefused as err:
            raise OpenAIError(err.status, str(err), param=EPISODE_HEADER) from None
        completions = await run([prompt], req, "messages", adapter, [[chunk.visual]] if chunk.visual else None)
        outs = [(c, *_cut_at_stop(engine.decode(c.token_ids), c, req.stops())) for c in completions]
        if recorder is not None:
            for c, text, _ in outs:
                recorder.record(episode, prompt, c, text)
        replies = [reply(engine.chat.tools, text, reason, tooling) if tooling.parse else ({"role": "assistant", "content": text}, reason)
                   for _, text, reason in outs]
        rid, now, served = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), adapter or model_name
        use = usage([prompt], req.n, completions)
        if not req.stream:
            return {"id": rid, "object": "chat.completion", "created": now, "model": served, "usage": use,
                    "choices": [{"index": i, "message": message, "finish_reason": reason, "logprobs": None}
                                for i, (message, reason) in enumerate(replies)]}

        def events() -> Iterator[str]:
            head = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": served}
            for i, ((c, text, _), (message, reason)) in enumerate(zip(outs, replies)):
                yield _sse(head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
                calls = "tool_calls" in message  # parsed whole: its text, then each call in one delta
                for delta in stream_deltas(message) if calls else ({"content": p} for p in _pieces(engine, c.token_ids, text)):
                    yield _sse(head | {"choices": [{"index": i, "delta": delta, "finish_reason": None}]})
                yield _sse(head | {"choices": [{"index": i, "delta": {}, "finish_reason": reason}]})
            if (req.stream_options or {}).get("include_usage"):
                yield _sse(head | {"choices": [], "usage": use})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def complete(req: CompletionRequest):
        adapter = check(req)
        if req.stream and (req.logprobs is not None or req.return_token_ids):
            raise OpenAIError(400, "logprobs and token ids are not streamed by this server: ask without stream", param="stream")
        prompts = [engine.text_prompt(p) for p in req.prompts()]
        if any(not p for p in prompts):
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        completions = await run(prompts, req, "prompt", adapter)
        outs = [(c, *_cut_at_stop(engine.decode(c.token_ids), c, req.stops())) for c in completions]
        rid, now, served = f"cmpl-{uuid.uuid4().hex}", int(time.time()), adapter or model_name
        use = usage(prompts, req.n, completions)
        if not req.stream:
            return {"id": rid, "object": "text_completion", "created": now, "model": served, "usage": use,
                    "choices": [_completion_choice(engine, req, i, c, text, reason, prompts[i // req.n]) for i, (c, text, reason) in enumerate(outs)]}

        def events() -> Iterator[str]:
            head = {"id": rid, "object": "text_completion", "created": now, "model": served}
            for i, (c, text, reason) in enumerate(outs):
                for piece in _pieces(engine, c.token_ids, text):
                    yield _sse(head | {"choices": [{"index": i, "text": piece, "finish_reason": None, "logprobs": None}]})
                yield _sse(head | {"choices": [{"index": i, "text": "", "finish_reason": reason, "logprobs": None}]})
            if (req.stream_options or {}).get("include_usage"):
                yield _sse(head | {"choices": [], "usage": use})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    if engine.adapters is not None:
        add_lora_routes(app, engine, OpenAIError)
    guarded = BodyLimit(CheckedBodies(app), max_request_bytes)  # JSON we read, histories we render (chat_rules.py), else a 400
    return BearerToken(guarded, lambda: [api_key], open_paths=("/health",)) if api_key else guarded


# --- running it ------------------------------------------------------------------------------


@dataclass
class RunningServer:
    """A server started by this process: its URL, and how to tell it is alive and stop it."""

    url: str
    model: str
    engine: str
    _server: Any
    _thread: threading.Thread
    _close: Any = None

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._close is not None:
            self._close()


def advertised_host(host: str) -> str:
    """The name clients dial: the host itself, or this machine's name when bound to every interface."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def serve_in_thread(app: Any, host: str, port: int = 0, model: str = "", engine: str = "hf",
                    close: Any = None, timeout: float = 60.0) -> RunningServer:
    """Run `app` with uvicorn in a daemon thread on `host:port` (0: a free port, bound here, so no
    other process can take it in between); returns once it accepts connections."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # named TCP, so asyncio turns Nagle off (else ~40 ms a reply)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                           timeout_keep_alive=SERVER_KEEP_ALIVE_S))  # longer than its clients keep a connection
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="inference-server", daemon=True)
    thread.start()

    def started() -> bool | None:
        if not thread.is_alive():
            raise RuntimeError(f"the inference server on {host}:{sock.getsockname()[1]} stopped while starting")
        return True if server.started else None

    try:
        wait_for(started, interval=0.05, timeout=timeout, what="the inference server")
    except TimeoutError:
        raise RuntimeError(f"the inference server on {host}:{sock.getsockname()[1]} did not start") from None
    bound = sock.getsockname()[1]
    name = advertised_host(host)
    url = f"http://[{name}]:{bound}" if ":" in name else f"http://{name}:{bound}"
    return RunningServer(url=url, model=model, engine=engine, _server=server, _thread=thread, _close=close)
