"""The Tinker API on the gateway: the REST surface the official `tinker` SDK (0.38.0) speaks.

`TINKER_BASE_URL=<gateway>` and `TINKER_API_KEY=<a key from opentinker tenant add>` are all a
Tinker program needs. The key arrives as `X-API-Key`; every id the client sends (session, model,
sampler, request, `tinker://` path) is checked against the tenant before anything is forwarded, so
another tenant's things read exactly like missing ones (404). A session is a job (a Prefect flow
run holding a slot, its model in a Ray actor); the gateway finds the session's own server and
relays each call to it with the session's job token. The gateway holds no state of its own: a
restart of it loses nothing.

Errors follow the SDK's habits: a client mistake is a 400 (never 409, which the SDK retries for
minutes) with one line in `detail`; a tenant at its limit of sessions a 429 marked `x-should-retry:
false` (raised at once, not retried); an ended session a 410 saying how it ended and how to go on;
a failed future is `{"error", "category"}`; an unknown thing is a 404.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import httpx
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from opentinker.control.gateway.tinker_rest import add_rest_routes, bad, read_json
from opentinker.tinker import paths, wire
from opentinker.tinker.models import UnknownModel, capabilities, resolve_base
from opentinker.tinker.paths import SessionGone, SessionLimit, SessionStarting

log = logging.getLogger("opentinker.gateway.tinker")

PROTOBUF = "application/x-protobuf"
NO_SESSION_HEADER = "x-opentinker-no-session"  # a base-model worker's answer for a session it does not host (opentinker.orchestration.base_worker)
POLL_HOLD_S = 30.0  # a retrieve_future is held this long before try_again (the SDK's poll times out at 45 s)
START_WAIT_S = 45.0  # a call to a session still starting waits this long, then 503 (the SDK retries)
FUTURE_CALLS = ("create_model", "forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "save_weights_external",
                "load_weights", "asample")
NOT_REFUSALS = (401, 408, 409, 410, 429)  # a wrong key, a session gone, or what the SDK sends again (same seq_id)
SEQUENCED = ("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "save_weights_external", "load_weights")


def add_tinker_routes(app: FastAPI, settings: Any, store: Any, sessions: Any) -> Callable[[dict, bytes], Awaitable[None]]:
    """`store`: the TenantStore; `sessions`: where sessions live (`create`, `endpoint`, `finish`,
    `storage_url`), the stack's Prefect flow runs (tinker_sessions.PrefectSessions). Returns the
    gateway's hook for bodies its limit refuses (asgi.BodyLimit's `on_refused`)."""
    router = APIRouter(prefix="/api/v1")
    client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), trust_env=False)  # to our own session servers, never via a proxy

    def tenant(request: Request) -> str:
        name = store.authenticate(request.headers.get("x-api-key"))
        if name is None:
            raise HTTPException(401, "missing or unknown API key (X-API-Key)")
        return name

    def owned_session(tenant_name: str, identifier: str) -> str:
        session_id = paths.session_of(identifier) if isinstance(identifier, str) else None
        if session_id is None or not session_id.startswith(f"{tenant_name}-"):
            raise bad(f"no such id {str(identifier)[:200]!r}", 404)
        return session_id

    async def endpoint(tenant_name: str, session_id: str) -> tuple[str, str]:
        deadline = asyncio.get_running_loop().time() + START_WAIT_S
        while True:
            try:
                return await asyncio.to_thread(sessions.endpoint, tenant_name, session_id)
            except SessionStarting as err:
                if asyncio.get_running_loop().time() > deadline:
                    raise HTTPException(503, f"session {session_id} is still starting ({err})", headers={"Retry-After": "1"}) from None
            except SessionGone as err:
                raise bad(str(err), 410) from None
            except LookupError:
                raise bad(f"no session {session_id!r}", 404) from None
            await asyncio.sleep(0.5)

    async def relay(tenant_name: str, session_id: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url, token = await endpoint(tenant_name, session_id)
        try:
            reply = await client.request(method, f"{url}{path}", headers={"Authorization": f"Bearer {token}"}, **kwargs)
        except httpx.TransportError as err:
            reply, why = None, type(err).__name__
        else:
            why = "it left its base-model worker" if reply.headers.get(NO_SESSION_HEADER) else None
        if why is not None:  # gone, or going: the next try reads how it ended
            sessions.forget(session_id)
            if reply is None:  # nothing answers at its address: a blip, or its process died (said now, not after minutes of retries)
                await unanswered(tenant_name, session_id, url)
            raise HTTPException(503, f"session {session_id} did not answer ({why}); retrying", headers={"Retry-After": "1"})
        return reply

    async def unanswered(tenant_name: str, session_id: str, url: str) -> None:
        """Returns if the session's server answers again within seconds; 410 with how it ended if not."""
        try:
            await asyncio.to_thread(sessions.unanswered, tenant_name, session_id, url)
        except SessionGone as err:
            raise bad(str(err), 410) from None
        except LookupError:
            raise bad(f"no session {session_id!r}", 404) from None

    def passed_on(reply: httpx.Response) -> Response:
        if reply.status_code >= 400:
            try:
                detail = reply.json().get("detail", reply.text)
            except ValueError:
                detail = reply.text
            raise bad(str(detail), reply.status_code if reply.status_code in (400, 401, 404, 413) else 502)
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    json_body = read_json

    # -- client set-up -------------------------------------------------------------------------
    @router.post("/client/config")
    def client_config(name: str = Depends(tenant)) -> dict[str, Any]:
        return {"pjwt_auth_enabled": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                "sample_join_sampling_session": False}

    @router.post("/client/dynamic_config")
    def dynamic_config(name: str = Depends(tenant)) -> dict[str, Any]:
        return {"sample_cancel_enabled": False}

    @router.post("/telemetry")
    def telemetry(name: str = Depends(tenant)) -> dict[str, Any]:
        return {"status": "accepted"}

    @router.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok"}

    @router.get("/get_server_capabilities")
    def server_capabilities(name: str = Depends(tenant)) -> dict[str, Any]:
        return capabilities(settings.models_folder)

    # -- sessions --------------------------------------------------------------------------------
    @router.post("/create_session")
    async def create_session(request: Request, name: str = Depends(tenant)) -> dict[str, Any]:
        body = await json_body(request)
        try:
            session_id = await asyncio.to_thread(sessions.create, name, body)
        except SessionLimit as err:  # 429 as documented; the SDK obeys x-should-retry and raises it at once
            raise HTTPException(429, str(err), headers={"x-should-retry": "false"}) from None
        except ValueError as err:  # a pool that cannot hold it
            raise bad(str(err)) from None
        return {"session_id": session_id}

    @router.post("/session_heartbeat")
    async def heartbeat(request: Request, name: str = Depends(tenant)) -> dict[str, Any]:
        session_id = owned_session(name, (await json_body(request)).get("session_id"))
        try:
            url, token = await asyncio.to_thread(sessions.endpoint, name, session_id)
        except SessionStarting:
            return {}
        except SessionGone as err:
            raise bad(str(err), 410) from None
        except LookupError:
            raise bad(f"no session {session_id!r}", 404) from None
        try:
            await client.post(f"{url}/direct/heartbeat", json={}, headers={"Authorization": f"Bearer {token}"})
        except httpx.TransportError:
            sessions.forget(session_id)
        return {}

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request, name: str = Depends(tenant)) -> dict[str, Any]:
        session_id = owned_session(name, session_id)
        body = await json_body(request)
        await asyncio.to_thread(sessions.finish, name, session_id, body)
        return {}

    # -- futures: accept now, relay to the session -------------------------------------------------
    def target_session(name: str, op: str, body: Any) -> str:
        if op == "forward_backward":
            model_id, _ = body
            return owned_session(name, model_id)
        if op == "asample":
            return owned_session(name, body.get("sampling_session_id"))
        return owned_session(name, body.get("model_id") or body.get("session_id"))

    async def never_coming(name: str, model_id: Any, seq_id: Any) -> None:
        """A training client's call the gateway refused (a bad path, another tenant's, a body too
        large): its session is told that seq_id will not come, so the client's next call does not
        wait out the gap (sequencing.GAP_WAIT_S)."""
        if not isinstance(model_id, str) or not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id <= 0:
            return
        try:
            session_id = owned_session(name, model_id)
            url, token = await asyncio.to_thread(sessions.endpoint, name, session_id)
            await client.post(f"{url}/direct/skip", json={"model_id": model_id, "seq_id": seq_id},
                              headers={"Authorization": f"Bearer {token}"}, timeout=10)
        except (HTTPException, LookupError, SessionStarting, httpx.HTTPError):
            log.info("could not tell %s that seq_id %s was refused", model_id, seq_id, exc_info=True)

    async def refused_body(scope: dict, head: bytes) -> None:
        """The gateway's body limit refused a request (413): a forward_backward's seq_id is given up."""
        if scope.get("path") != "/api/v1/forward_backward":
            return
        name = store.authenticate(dict(scope.get("headers") or []).get(b"x-api-key", b"").decode("latin-1") or None)
        header = wire.header_of_prefix(head)
        if name is not None and header is not None:
            await never_coming(name, *header)

    def make_future_route(op: str) -> None:
        async def route(request: Request, name: str = Depends(tenant)) -> Response:
            header: list[Any] = [None, None]  # (model_id, seq_id) of a training client's call, once read
            try:
                return await submit(request, name, header)
            except HTTPException as err:
                if op in SEQUENCED and 400 <= err.status_code < 500 and err.status_code not in NOT_REFUSALS:
                    await never_coming(name, *header)
                raise

        async def submit(request: Request, name: str, header: list) -> Response:
            if op == "forward_backward":
                try:
                    raw = wire.decompress(await request.body(), request.headers.get("content-encoding"))
                    header[:] = wire.header_of(raw)
                    session_id = target_session(name, op, header)
                except wire.WireError as err:
                    raise bad(str(err)) from None
                return passed_on(await relay(name, session_id, "POST", f"/submit/{op}", content=raw))
            body = await json_body(request)
            header[:] = body.get("model_id"), body.get("seq_id")
            session_id = target_session(name, op, body)
            if op == "create_model":
                try:
                    resolve_base(settings.models_folder, str(body.get("base_model", "")))
                except UnknownModel as err:
                    raise bad(str(err)) from None
            for key in ("path", "model_path"):
                value = body.get(key)
                if isinstance(value, str) and value.startswith("tinker://"):
                    try:
                        owned_session(name, paths.parse_path(value).model_id)
                    except paths.PathError as err:
                        raise bad(str(err)) from None
            return passed_on(await relay(name, session_id, "POST", f"/submit/{op}", json=body))

        router.add_api_route(f"/{op}", route, methods=["POST"], name=f"tinker_{op}")

    for op in FUTURE_CALLS:
        make_future_route(op)

    @router.post("/retrieve_future")
    async def retrieve_future(request: Request, name: str = Depends(tenant)) -> Response:
        body = await json_body(request)
        request_id = body.get("request_id")
        session_id = owned_session(name, request_id)
        try:
            reply = await relay(name, session_id, "POST", "/result", json={"request_id": request_id, "timeout": POLL_HOLD_S})
        except HTTPException as err:
            if err.status_code == 410:  # the session is gone: its futures fail, once, clearly
                return JSONResponse({"error": err.detail, "category": "user"})
            raise
        if reply.status_code == 200 and reply.headers.get("content-type", "").startswith("application/json") and len(reply.content) < 512:
            waiting = reply.json()
            if waiting.get("type") == "try_again":  # as 408 the SDK re-polls at once without a warning per poll
                return JSONResponse(waiting, status_code=408)
        return passed_on(reply)

    # -- direct calls relayed ------------------------------------------------------------------------
    @router.post("/get_info")
    async def get_info(request: Request, name: str = Depends(tenant)) -> Response:
        body = await json_body(request)
        return passed_on(await relay(name, owned_session(name, body.get("model_id")), "POST", "/direct/get_info", json=body))

    @router.post("/create_sampling_session")
    async def create_sampling_session(request: Request, name: str = Depends(tenant)) -> Response:
        body = await json_body(request)
        session_id = owned_session(name, body.get("session_id"))
        if isinstance(body.get("model_path"), str):
            try:
                owned_session(name, paths.parse_path(body["model_path"]).model_id)
            except paths.PathError as err:
                raise bad(str(err)) from None
        if body.get("base_model") is not None:
            try:
                resolve_base(settings.models_folder, str(body["base_model"]))
            except UnknownModel as err:
                raise bad(str(err)) from None
        return passed_on(await relay(name, session_id, "POST", "/direct/create_sampling_session", json=body))

    @router.get("/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, name: str = Depends(tenant)) -> Response:
        return passed_on(await relay(name, owned_session(name, sampler_id), "GET", f"/samplers/{sampler_id}"))

    add_rest_routes(router, settings, sessions, tenant, owned_session, client)
    app.include_router(router)
    return refused_body
