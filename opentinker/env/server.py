"""Serve any AbstractGame over HTTP, so environments run on other machines than training.

One session is one game instance (one episode). Endpoints are plain `def`, so FastAPI runs game
code in its threadpool and many episodes progress concurrently. An exception in game code
answers HTTP 500 `{"detail": "<ExcType>: message"}` and the server keeps serving.

    GET    /health                  -> {"ok", "game", "sessions"}
    POST   /sessions                {"game_kwargs"} -> {"session_id", "system_prompt", "initial_user_message", "example_turns"}
    POST   /sessions/{id}/reset     {"task"} -> {"observation", "system_prompt", "initial_user_message", "example_turns", "tools"}
    POST   /sessions/{id}/step      {"action"} -> {"observation", "reward", "done", "info"}
    POST   /sessions/{id}/tools/{name}  {"arguments"} -> {"content"} | {"error"}
    DELETE /sessions/{id}           -> {"ok"}  (calls game.close())
    POST   /generate_task           {"seed" | "rng_state", "config"} -> {"task", "rng_state"}

Tools: reset's answer lists the episode's `get_tools()` (asked once, after its reset; see
env.served_tools), and a call runs that episode's own tool within the tool's timeout. A tool's
failure is the call's answer (`{"error"}`, HTTP 200), not an HTTP error: the model reads it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field, model_validator

from opentinker.core.asgi import BearerToken, BodyLimit
from opentinker.env.base import AbstractGame
from opentinker.env.environment import import_game
from opentinker.env.hosting import generate_reply, generator_from_state, prompts_of, reset_reply, step_reply
from opentinker.env.served_tools import call_reply, tool_listing, tools_by_name



class NewSession(BaseModel):
    game_kwargs: dict[str, Any] = Field(default_factory=dict)


class Reset(BaseModel):
    task: dict[str, Any] = Field(default_factory=dict)


class Step(BaseModel):
    action: str


class ToolCall(BaseModel):
    arguments: dict[str, Any] = Field(default_factory=dict)


class GenerateTask(BaseModel):
    """`seed`: a fresh `default_rng(seed)`. `rng_state`: continue the caller's own generator, so a
    remote game draws exactly the tasks the same class would draw in-process."""

    seed: int | None = None
    rng_state: dict[str, Any] | None = None
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> GenerateTask:
        if (self.seed is None) == (self.rng_state is None):
            raise ValueError("give exactly one of seed or rng_state")
        return self


def _guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run game code; its failure becomes the HTTP error the client reports for one episode."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as err:
        raise HTTPException(501, f"NotImplementedError: {err}") from None
    except Exception as err:  # noqa: BLE001 - a game bug fails one request, never the server
        raise HTTPException(500, f"{type(err).__name__}: {err}") from None


def _episode_tools(game: AbstractGame) -> list[Any]:
    tools = getattr(game, "get_tools", lambda: [])()  # a game that is not an AbstractGame may have none
    return list(tools or [])


def _generator(req: GenerateTask) -> np.random.Generator:
    if req.rng_state is None:
        return np.random.default_rng(req.seed)
    try:
        return generator_from_state(req.rng_state)
    except ValueError as err:
        raise HTTPException(400, str(err)) from None


class _Sessions:
    """Live games by session id, and each episode's tools; the lock guards the dicts, never game code."""

    def __init__(self) -> None:
        self._games: dict[str, AbstractGame] = {}
        self._tools: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def add(self, game: AbstractGame) -> str:
        session_id = uuid.uuid4().hex
        with self._lock:
            self._games[session_id] = game
        return session_id

    def get(self, session_id: str, remove: bool = False) -> AbstractGame:
        with self._lock:
            game = self._games.pop(session_id, None) if remove else self._games.get(session_id)
            if remove:
                self._tools.pop(session_id, None)
        if game is None:
            raise HTTPException(404, f"unknown session {session_id}")
        return game

    def set_tools(self, session_id: str, tools: list[Any]) -> None:
        with self._lock:
            if session_id in self._games:
                self._tools[session_id] = tools_by_name(tools)

    def tool(self, session_id: str, name: str) -> Any:
        self.get(session_id)
        with self._lock:
            tool = self._tools.get(session_id, {}).get(name)
        if tool is None:
            raise HTTPException(404, f"this episode has no tool named {name[:80]!r}")
        return tool

    def __len__(self) -> int:
        with self._lock:
            return len(self._games)


def create_app(game_class: type[AbstractGame], tokens: list[str] | None = None, max_request_bytes: int = 1024**2):
    """The app for `game_class`. With `tokens`, every request but /health must carry one of them
    (`Authorization: Bearer …`: a job sends its job token); bodies over `max_request_bytes` get 413."""
    if not (isinstance(game_class, type) and issubclass(game_class, AbstractGame)):
        raise TypeError(f"{game_class!r} is not an AbstractGame subclass")
    name = game_class.__name__
    app = FastAPI(title=f"OpenTinker environment: {name}")
    sessions = _Sessions()

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "game": name, "sessions": len(sessions)}

    @app.post("/sessions")
    def new_session(req: NewSession) -> dict[str, Any]:
        game = _guarded(game_class, **req.game_kwargs)
        prompts = _guarded(prompts_of, game)
        return {"session_id": sessions.add(game), **prompts}

    @app.post("/sessions/{session_id}/reset")
    def reset(session_id: str, req: Reset) -> dict[str, Any]:
        game = sessions.get(session_id)
        answer = _guarded(reset_reply, game, req.task)
        tools = _guarded(_episode_tools, game)
        sessions.set_tools(session_id, tools)
        return {**answer, "tools": _guarded(tool_listing, tools)}

    @app.post("/sessions/{session_id}/tools/{name}")
    def call_tool(session_id: str, name: str, req: ToolCall) -> dict[str, Any]:
        return call_reply(sessions.tool(session_id, name), req.arguments)

    @app.post("/sessions/{session_id}/step")
    def step(session_id: str, req: Step) -> dict[str, Any]:
        return _guarded(step_reply, sessions.get(session_id), req.action)

    @app.delete("/sessions/{session_id}")
    def close(session_id: str) -> dict[str, Any]:
        _guarded(sessions.get(session_id, remove=True).close)
        return {"ok": True}

    @app.post("/generate_task")
    def generate_task(req: GenerateTask) -> dict[str, Any]:
        return _guarded(generate_reply, game_class, _generator(req), req.config)

    guarded = BodyLimit(app, max_request_bytes)
    return BearerToken(guarded, lambda: tokens) if tokens else guarded


def serve(game_path: str, host: str = "127.0.0.1", port: int = 8300, tokens: list[str] | None = None) -> None:
    """Import 'package.module:ClassName' (the user's own code: no allowlist here) and serve it until
    interrupted; `tokens`: the job tokens it answers (None: anyone who reaches it)."""
    import uvicorn

    # Idle connections live longer here than in clients (httpx drops them after 5 s), so a client
    # never sends a step on a connection the server is closing at that moment.
    uvicorn.run(create_app(import_game(game_path), tokens), host=host, port=port, access_log=False, timeout_keep_alive=75)
