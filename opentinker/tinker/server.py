"""The session's own HTTP door, which only the gateway dials (it asks for the session's job token).

    POST /submit/{op}      a future call (body as the SDK sent it) -> {"request_id", ...}
    POST /result           {"request_id", "timeout"} -> the result (protobuf or JSON), or try_again
    POST /direct/{op}      get_info, create_sampling_session, heartbeat, finish, describe, skip -> JSON
    GET  /samplers/{id}    the sampler's base model and path

The gateway has authenticated the tenant and checked that the session is theirs; this server
trusts that and nothing else (the job token). Bad input is a 400 with one line; an unknown
model, sampler or request a 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from opentinker.core.asgi import BearerToken, BodyLimit
from opentinker.tinker.session import USER_ERRORS, TinkerSession
from opentinker.tinker.wire import MAX_BODY_BYTES

PROTOBUF = "application/x-protobuf"
DIRECT = ("get_info", "create_sampling_session", "heartbeat", "finish", "describe", "skip", "expire")


def _refusal(err: BaseException) -> JSONResponse:
    status = 404 if isinstance(err, LookupError) else 400
    return JSONResponse({"detail": str(err).splitlines()[0] if str(err) else type(err).__name__}, status_code=status)


def create_app(session: TinkerSession, token: str) -> Any:
    app = FastAPI(title=f"tinker session {session.session_id}")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "session_id": session.session_id}

    @app.post("/submit/{op}")
    async def submit(op: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = raw if op == "forward_backward" else await request.json()
            return JSONResponse(await asyncio.to_thread(session.submit, op, body))
        except USER_ERRORS as err:
            return _refusal(err)

    @app.post("/result")
    async def result(request: Request) -> Response:
        ask = await request.json()
        try:
            out = await asyncio.to_thread(session.result, str(ask.get("request_id", "")), min(float(ask.get("timeout", 30.0)), 40.0))
        except USER_ERRORS as err:
            return _refusal(err)
        if out is None:
            return JSONResponse({"type": "try_again", "request_id": ask.get("request_id"), "queue_state": "active"})
        if isinstance(out, bytes):
            return Response(out, media_type=PROTOBUF)
        return JSONResponse(out)

    @app.post("/direct/{op}")
    async def direct(op: str, request: Request) -> Response:
        body = await request.json()
        if op not in DIRECT:
            return JSONResponse({"detail": f"unknown call {op!r}"}, status_code=404)
        try:
            if op == "heartbeat":
                session.touch()
                return JSONResponse({})
            if op == "describe":
                return JSONResponse({"sampler_ids": sorted(session.samplers.records), "training_run_ids": sorted(session.models),
                                     "idle_s": session.idle_seconds()})
            if op == "expire":  # the gateway's: its client is gone and its tenant needs the place (flows/tinker_session.py ends it)
                session.expired = str(body.get("reason") or "expired")
                return JSONResponse({})
            if op == "finish":
                session.finished = str((body.get("reason") or {}).get("type") or "success")
                return JSONResponse({})
            return JSONResponse(await asyncio.to_thread(getattr(session, op), body))
        except USER_ERRORS as err:
            return _refusal(err)

    @app.get("/samplers/{sampler_id}")
    def sampler(sampler_id: str) -> Response:
        try:
            return JSONResponse(session.get_sampler(sampler_id))
        except USER_ERRORS as err:
            return _refusal(err)

    return BodyLimit(BearerToken(app, lambda: [token]), MAX_BODY_BYTES)
