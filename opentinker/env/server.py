"""Serve any AbstractGame over HTTP, so environments run on other machines than training.

One session is one game instance (one episode). Endpoints are plain `def`, so FastAPI runs game
code in its threadpool and many episodes progress concurrently. An exception in game code
answers HTTP 500 `{"detail": "<ExcType>: message"}` and the server keeps serving.

    GET    /health                  -> {"ok", "game", "sessions"}
    POST   /sessions                {"game_kwargs"} -> {"session_id", "system_prompt", "initial_user_message", "example_turns"}
    POST   /sessions/{id}/reset     {"task"} -> {"observation", "system_prompt", "initial_user_message", "example_turns"}
    POST   /sessions/{id}/step      {"action"} -> {"observation", "reward", "done", "info"}
    DELETE /sessions/{id}           -> {"ok"}  (calls game.close())
    POST   /generate_task           {"seed" | "rng_state", "config"} -> {"task", "rng_state"}
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field, model_validator

from opentinker.env.base import AbstractGame, StepResult
from opentinker.env.environment import import_game
from opentinker.env.hosting import start_episode

# Bit generators a client may hand over by state; never an arbitrary attribute of numpy.random.
_BIT_GENERATORS = {"PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937"}


class NewSession(BaseModel):
    game_kwargs: dict[str, Any] = Field(default_factory=dict)


class Reset(BaseModel):
    task: dict[str, Any] = Field(default_factory=dict)


class Step(BaseModel):
    action: str


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


def _plain(value: Any) -> Any:
    """JSON-safe copy of what game code returned (numpy scalars and arrays included); a NaN
    fails here, inside the guard, rather than while the response is rendered."""

    def default(x: Any) -> Any:
        if isinstance(x, (np.generic, np.ndarray)):
            return x.tolist()
        raise TypeError(f"{type(x).__name__} is not JSON serializable")

    return json.loads(json.dumps(value, default=default, allow_nan=False))


def _guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run game code; its failure becomes the HTTP error the client reports for one episode."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as err:
        raise HTTPException(501, f"NotImplementedError: {err}") from None
    except Exception as err:  # noqa: BLE001 - a game bug fails one request, never the server
        raise HTTPException(500, f"{type(err).__name__}: {err}") from None


def _generator(req: GenerateTask) -> np.random.Generator:
    if req.rng_state is None:
        return np.random.default_rng(req.seed)
    name = req.rng_state.get("bit_generator")
    if name not in _BIT_GENERATORS:
        raise HTTPException(400, f"unknown bit generator {name!r}")
    bit_generator = getattr(np.random, name)()
    try:
        bit_generator.state = req.rng_state
    except (TypeError, ValueError, KeyError) as err:
        raise HTTPException(400, f"invalid rng_state: {err}") from None
    return np.random.Generator(bit_generator)


def _prompts(game: AbstractGame) -> dict[str, Any]:
    """Sent after creation and after every reset, since a prompt may depend on the task."""
    return _plain({
        "system_prompt": game.get_system_prompt(),
        "initial_user_message": game.get_initial_user_message(),
        "example_turns": game.get_example_turns(),
    })


def _reset(game: AbstractGame, task: dict[str, Any]) -> dict[str, Any]:
    return {"observation": start_episode(game, task), **_prompts(game)}


def _step(game: AbstractGame, action: str) -> dict[str, Any]:
    result = game.step(action)
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__}, expected StepResult")
    return _plain({"observation": result.observation, "reward": result.reward, "done": result.done, "info": result.info})


class _Sessions:
    """Live games by session id; the lock guards the dict, never game code."""

    def __init__(self) -> None:
        self._games: dict[str, AbstractGame] = {}
        self._lock = threading.Lock()

    def add(self, game: AbstractGame) -> str:
        session_id = uuid.uuid4().hex
        with self._lock:
            self._games[session_id] = game
        return session_id

    def get(self, session_id: str, remove: bool = False) -> AbstractGame:
        with self._lock:
            game = self._games.pop(session_id, None) if remove else self._games.get(session_id)
        if game is None:
            raise HTTPException(404, f"unknown session {session_id}")
        return game

    def __len__(self) -> int:
        with self._lock:
            return len(self._games)


def create_app(game_class: type[AbstractGame]) -> FastAPI:
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
        prompts = _guarded(_prompts, game)
        return {"session_id": sessions.add(game), **prompts}

    @app.post("/sessions/{session_id}/reset")
    def reset(session_id: str, req: Reset) -> dict[str, Any]:
        return _guarded(_reset, sessions.get(session_id), req.task)

    @app.post("/sessions/{session_id}/step")
    def step(session_id: str, req: Step) -> dict[str, Any]:
        return _guarded(_step, sessions.get(session_id), req.action)

    @app.delete("/sessions/{session_id}")
    def close(session_id: str) -> dict[str, Any]:
        _guarded(sessions.get(session_id, remove=True).close)
        return {"ok": True}

    @app.post("/generate_task")
    def generate_task(req: GenerateTask) -> dict[str, Any]:
        rng = _generator(req)
        task = _guarded(lambda: _plain(game_class.generate_task(rng, **req.config)))
        return {"task": task, "rng_state": rng.bit_generator.state}

    return app


def serve(game_path: str, host: str = "127.0.0.1", port: int = 8300) -> None:
    """Import 'package.module:ClassName' and serve it until interrupted."""
    import uvicorn

    uvicorn.run(create_app(import_game(game_path)), host=host, port=port, access_log=False)
