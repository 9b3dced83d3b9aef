"""The Tinker REST client's side of the gateway: training runs, checkpoints, exported adapters
(signed download links), sessions; what is not offered says so in one line. Everything is read
from the tenant's own storage (runs, checkpoints) or its own sessions; another tenant's ids read
as missing (404).

Deletes leave nothing behind: a checkpoint that a registered model version uses is not deleted
(the refusal names the model, version and aliases), and a run left with no checkpoint leaves the
listing once its session has ended. A sampler made from a deleted checkpoint stops serving
(tinker/sampling.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

import httpx
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response

from opentinker.core.json_text import JsonTextError, loads_bounded
from opentinker.tinker import paths
from opentinker.tinker.paths import SessionStarting

DOWNLOAD_TTL_S = 3600.0
log = logging.getLogger("opentinker.gateway")


def bad(detail: str, status: int = 400) -> HTTPException:
    """A client error in the SDK's habit: never 409 (retried for minutes), one line in `detail`."""
    return HTTPException(status, detail[:2000])


def download_token(secret: str, tenant: str, path: str, file_name: str, expires: float) -> str:
    """A URL-safe grant to read one file of one tenant's checkpoint until `expires` (HMAC-signed)."""
    import base64
    import hashlib
    import hmac

    payload = base64.urlsafe_b64encode(json.dumps([tenant, path, file_name, int(expires)]).encode()).decode().rstrip("=")
    signature = hmac.new(secret.encode(), f"download:{payload}".encode(), hashlib.sha256).hexdigest()[:40]
    return f"{payload}.{signature}"


def read_download_token(secret: str, token: str) -> tuple[str, str, str] | None:
    """(tenant, tinker path, file) of a valid, unexpired grant; None otherwise."""
    import base64
    import hashlib
    import hmac
    import time

    payload, _, signature = token.partition(".")
    expected = hmac.new(secret.encode(), f"download:{payload}".encode(), hashlib.sha256).hexdigest()[:40]
    if not signature or not hmac.compare_digest(signature, expected):
        return None
    try:
        tenant, path, file_name, expires = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (ValueError, TypeError):
        return None
    if time.time() > float(expires):
        return None
    return str(tenant), str(path), str(file_name)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else, a number out of float range included."""
    raw = await request.body()  # its size is the gateway's body limit's to bound
    try:
        body = loads_bounded(raw, max_chars=max(len(raw), 1))
    except JsonTextError as err:
        raise bad(f"the body is not JSON ({err})") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


def add_rest_routes(router: APIRouter, settings: Any, sessions: Any, tenant: Callable, owned_session: Callable,
                    client: httpx.AsyncClient) -> None:
    """The REST routes on `router`; `tenant` is the key dependency, `owned_session` the id check.
    `sessions.registry_url`, where it has one, is the MLflow server its sessions register checkpoints
    in (None: they register none); otherwise the stack's (settings.mlflow_url)."""

    json_body = read_json
    registry_url = getattr(sessions, "registry_url", settings.mlflow_url)

    # -- the REST client: runs and checkpoints in the tenant's storage ----------------------------
    def checkpoints_of(name: str) -> paths.TenantCheckpoints:
        return paths.TenantCheckpoints(sessions.storage_url(name))

    def owned_run(name: str, run_id: str) -> str:
        if not paths.MODEL.match(run_id or "") or not run_id.startswith(f"{name}-"):
            raise bad(f"no training run {run_id[:200]!r}", 404)
        return run_id

    def page(items: list[Any], limit: int, offset: int) -> tuple[list[Any], dict[str, int]]:
        limit = max(1, min(int(limit), 1000))
        offset = max(0, int(offset))
        return items[offset : offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}

    @router.get("/training_runs")
    def list_training_runs(limit: int = 20, offset: int = 0, name: str = Depends(tenant)) -> dict[str, Any]:
        runs, cursor = page(checkpoints_of(name).runs(), limit, offset)
        return {"training_runs": runs, "cursor": cursor}

    @router.get("/training_runs/{run_id}")
    def get_training_run(run_id: str, name: str = Depends(tenant)) -> dict[str, Any]:
        try:
            return checkpoints_of(name).training_run(owned_run(name, run_id))
        except paths.NotFound as err:
            raise bad(str(err), 404) from None

    @router.get("/training_runs/{run_id}/checkpoints")
    def list_checkpoints(run_id: str, name: str = Depends(tenant)) -> dict[str, Any]:
        store = checkpoints_of(name)
        try:
            store.read_run(owned_run(name, run_id))
        except paths.NotFound as err:
            raise bad(str(err), 404) from None
        return {"checkpoints": store.checkpoints(run_id)}

    def refuse_if_registered(store: paths.TenantCheckpoints, path: paths.TinkerPath) -> None:
        """A checkpoint that a registered version points at stays: deleting it would leave that version
        (and `champion`, if on it) pointing at nothing. A version is removed by the operator."""
        if registry_url is None:
            return
        from opentinker.storage.registry import versions_using

        try:
            used = versions_using(store.url(path), registry_url)
        except Exception as err:  # noqa: BLE001 - down or failing: never delete blind (the SDK retries a 503 for 5 minutes)
            log.warning("registry check for %s failed: %s", path, err)
            raise HTTPException(503, f"{path} was not deleted: the model registry did not answer (is a registered version "
                                     "using it?); try again later") from None
        if used:
            said = "; ".join(f"version {v['version']} of registered model {v['name']!r} (aliases: {', '.join(v['aliases']) or 'none'})"
                             for v in used)
            first = used[0]
            raise bad(f"{path} was not deleted: {said} uses it. Have that version deleted first (an operator runs "
                      f"`opentinker models delete {first['name']} {first['version']}`), then delete the checkpoint")

    def session_live(name: str, session_id: str) -> bool:
        """Whether the session may still save (asked afresh: a cached endpoint may be an ended session's)."""
        sessions.forget(session_id)
        try:
            sessions.endpoint(name, session_id)
        except LookupError:  # ended (SessionGone) or unknown
            return False
        except Exception:  # noqa: BLE001 - starting, or the scheduler did not answer: keep the run
            return True
        return True

    def drop_run_if_empty(name: str, store: paths.TenantCheckpoints, run_id: str) -> None:
        """A run with no checkpoint left leaves the listing once its session has ended (nothing can save
        to it again); a live session's run stays, since its training client may save again."""
        if not store.checkpoints(run_id) and not session_live(name, paths.session_of(run_id)):
            store.remove_run(run_id)

    @router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", status_code=204)
    def delete_checkpoint(run_id: str, checkpoint_id: str, name: str = Depends(tenant)) -> Response:
        store = checkpoints_of(name)
        try:
            kind, ckpt = paths.parse_checkpoint_id(checkpoint_id)
            path = paths.TinkerPath(owned_run(name, run_id), kind, ckpt)
            if not store.exists(path):
                raise paths.NotFound(f"no checkpoint {path}")
            refuse_if_registered(store, path)
            store.delete(path)
        except paths.PathError as err:
            raise bad(str(err)) from None
        except paths.NotFound as err:
            raise bad(str(err), 404) from None
        drop_run_if_empty(name, store, run_id)
        return Response(status_code=204)

    @router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", status_code=204)
    async def set_checkpoint_ttl(run_id: str, checkpoint_id: str, request: Request, name: str = Depends(tenant)) -> Response:
        """`ttl_seconds` from now (an hour to ten years), or null: never expires."""
        body = await json_body(request)
        try:
            kind, ckpt = paths.parse_checkpoint_id(checkpoint_id)
            path = paths.TinkerPath(owned_run(name, run_id), kind, ckpt)
            await asyncio.to_thread(checkpoints_of(name).set_ttl, path, body.get("ttl_seconds"))
        except paths.PathError as err:
            raise bad(str(err)) from None
        except paths.NotFound as err:
            raise bad(str(err), 404) from None
        return Response(status_code=204)

    @router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    def external_weights_urls(run_id: str, checkpoint_id: str, name: str = Depends(tenant)) -> dict[str, Any]:
        """Signed URLs (an hour) for each file of an exported adapter: the URL alone opens it, no key."""
        import time

        try:
            kind, ckpt = paths.parse_checkpoint_id(checkpoint_id)
            path = paths.TinkerPath(owned_run(name, run_id), kind, ckpt)
            if kind != "external_weights":
                raise paths.PathError(f"{checkpoint_id}: only external_weights checkpoints (save_weights_external) are downloaded")
            files = checkpoints_of(name).files(path)
        except paths.PathError as err:
            raise bad(str(err)) from None
        except paths.NotFound as err:
            raise bad(str(err), 404) from None
        expires = time.time() + DOWNLOAD_TTL_S
        base = settings.public_gateway_url
        urls = {f: f"{base}/api/v1/downloads/{download_token(settings.stack_secret(), name, str(path), f, expires)}" for f in files}
        return {"urls": urls, "expires": paths.iso_in(DOWNLOAD_TTL_S)}

    @router.get("/downloads/{token}")
    def download(token: str) -> Response:
        """A file of an exported adapter, for whoever holds its signed URL (until it expires)."""
        grant = read_download_token(settings.stack_secret(), token)
        if grant is None:
            raise bad("this download link is invalid or has expired", 404)
        tenant_name, text, file_name = grant
        try:
            data = checkpoints_of(tenant_name).read(paths.parse_path(text), file_name)
        except (paths.PathError, paths.NotFound) as err:
            raise bad(str(err), 404) from None
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{file_name}"'})

    @router.get("/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0, name: str = Depends(tenant)) -> dict[str, Any]:
        found, _ = page(await asyncio.to_thread(sessions.list, name), limit, offset)
        return {"sessions": found}

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str, name: str = Depends(tenant)) -> dict[str, Any]:
        session_id = owned_session(name, session_id)
        if session_id not in await asyncio.to_thread(sessions.list, name):
            raise bad(f"no session {session_id!r}", 404)
        runs = checkpoints_of(name).run_ids(f"{session_id}:")
        samplers: list[str] = []
        try:
            url, token = await asyncio.to_thread(sessions.endpoint, name, session_id)
            reply = await client.post(f"{url}/direct/describe", json={}, headers={"Authorization": f"Bearer {token}"})
            samplers = reply.json().get("sampler_ids", []) if reply.status_code == 200 else []
        except (LookupError, SessionStarting, httpx.TransportError):
            pass  # an ended session still lists its training runs
        return {"training_run_ids": runs, "sampler_ids": samplers}

    def not_offered(what: str):
        def route(name: str = Depends(tenant)) -> None:
            raise bad(f"{what} is not offered by this server (checkpoints stay in your own storage; "
                       "see docs/tinker.md, 'Tinker API')")
        return route

    for method, route_path, what in (("POST", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", "publishing a checkpoint"),
                                      ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", "publishing a checkpoint"),
                                      ("POST", "/copy_weights", "copy_weights"), ("POST", "/sessions/search", "searching sessions"),
                                      ("PUT", "/sessions/{session_id}/project", "projects"),
                                      ("GET", "/sessions/{session_id}/trace_export", "trace export")):
        router.add_api_route(route_path, not_offered(what), methods=[method], name=f"not_offered_{method}_{route_path}")

    @router.get("/checkpoints")
    def list_user_checkpoints(limit: int = 100, offset: int = 0, name: str = Depends(tenant)) -> dict[str, Any]:
        store = checkpoints_of(name)
        found = [c for run in store.run_ids() for c in store.checkpoints(run)]
        items, cursor = page(sorted(found, key=lambda c: c["time"], reverse=True), limit, offset)
        return {"checkpoints": items, "cursor": cursor}

    @router.post("/weights_info")
    async def weights_info(request: Request, name: str = Depends(tenant)) -> dict[str, Any]:
        body = await json_body(request)
        try:
            path = paths.parse_path(str(body.get("tinker_path", "")))
            owned_run(name, path.model_id)
            info = await asyncio.to_thread(checkpoints_of(name).policy_info, path)
        except paths.PathError as err:
            raise bad(str(err)) from None
        except paths.NotFound as err:
            raise bad(str(err), 404) from None
        shape = info.get("tinker") or {}
        return {"base_model": checkpoints_of(name).read_run(path.model_id)["base_model"], "is_lora": True,
                "lora_rank": shape.get("rank"), "train_attn": shape.get("train_attn"), "train_mlp": shape.get("train_mlp"),
                "train_unembed": shape.get("train_unembed")}
