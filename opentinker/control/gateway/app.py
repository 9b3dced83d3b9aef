"""The authenticated job gateway: the one URL clients use (`SchedulerClient(url=…)`).

Prefect OSS and MLflow have no per-user auth, so they stay on the private side (loopback in the
embedded stack) and this thin FastAPI app is the trust boundary: it maps an API key to a tenant
and answers only about that tenant's jobs (another tenant's job is a 404, not a 403, so job ids
do not leak). API keys travel in the `Authorization: Bearer` header only; they are never put in
specs, flow parameters, MLflow params or logs.

    uvicorn --factory opentinker.control.gateway.app:create_app   (the embedded stack starts it)
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request, WebSocket
from fastapi import Path as PathParam
from fastapi import Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, Field
from starlette.background import BackgroundTask

from opentinker.control.console.bounds import ReadBounds
from opentinker.control.console.routes import console_router
from opentinker.control.gateway.jobs import CheckpointNotFound, JobConflict, JobNotFound, TenantJobs, TooManyJobs
from opentinker.control.gateway.link import LinkHub, valid_calls
from opentinker.control.gateway.tenants import TenantStore
from opentinker.control.scheduler import SchedulingError
from opentinker.core.asgi import BodyLimit, ServerErrors
from opentinker.core.errors import one_line
from opentinker.core.settings import Settings, get_settings
from opentinker.core.spec import SpecError
from opentinker.core.spec_limits import MAX_FIELD_CHARS, control_problem, field_name
from opentinker.core.tokens import bearer, is_job_token


log = logging.getLogger("opentinker.gateway")


def _plain(text: str) -> str:
    if problem := control_problem(text):
        raise ValueError(problem)
    return text


Text = Annotated[str, Field(max_length=MAX_FIELD_CHARS), AfterValidator(_plain)]
"""A string a request names something with: at most MAX_FIELD_CHARS, no control character (422)."""

JobId = Annotated[str, PathParam(max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
ArtifactPath = Annotated[str, PathParam(max_length=MAX_FIELD_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$")]
ArtifactQuery = Annotated[str | None, Query(max_length=MAX_FIELD_CHARS, pattern=r"^[^\x00-\x1f\x7f]*$")]
LOG_PAGE = 200  # the most lines Prefect answers at once
MAX_LOG_OFFSET = 10**9  # beyond any job's log; a larger number would overflow the database's integers


def _validation_line(err: RequestValidationError) -> str:
    """A request that does not fit its model, as one line: `field: reason; …` (the input itself
    is never echoed back, FastAPI's default answer would hold all of it)."""
    lines = []
    for e in err.errors():
        loc = list(e.get("loc", ()))
        loc = loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "cookie") else loc
        msg = " ".join(str(e.get("msg", "invalid")).removeprefix("Value error, ").split())
        if e.get("type") == "string_pattern_mismatch":
            msg = "contains a control character or is empty"
        elif e.get("type") == "json_invalid":
            loc, msg = [], f"not JSON ({(e.get('ctx') or {}).get('error', 'invalid')})"
        lines.append(f"{field_name(loc) if loc else 'body'}: {msg[:300]}")
    more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
    return "; ".join(lines[:5]) + more


class SubmitRequest(BaseModel):
    config: dict[str, Any] = Field(description="a job spec, RL (env may be left out until fit()) or SFT (a data section)")
    num_gpus: float | None = Field(None, ge=0, description="overrides resources.num_gpus")


class StartRequest(BaseModel):
    env: dict[str, Any] = Field(description="the spec's env section: {game: 'module:Class'} or {url: …}, plus config")
    steps: int | None = Field(None, gt=0)


class InferenceRequest(BaseModel):
    model_path: Text = Field(description="a checkpoint in your storage (job id, job/step path or URL) or models:/<name>@<alias>")
    num_gpus: float = Field(0, ge=0)
    engine: Literal["auto", "hf", "vllm"] = "auto"
    max_model_len: int | None = Field(None, gt=0)
    ttl_s: float | None = Field(None, gt=0, description="stop serving after this many seconds (default: until cancelled)")


def create_app(settings: Settings | None = None, tinker_sessions: Any = None, console_bounds: ReadBounds | None = None):
    """The gateway; `console_bounds` sets how much of it the console may take (its defaults when None)."""
    settings = settings or get_settings()
    store = TenantStore(settings.state_dir / "tenants.json")
    hub = LinkHub()
    app = FastAPI(title="OpenTinker gateway", version="1")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        """Anything unforeseen: one line for the client, the traceback in the gateway's log."""
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse({"detail": one_line(err)}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _validation_line(err)}, status_code=422)

    def tenant_of(headers) -> TenantJobs:
        tenant = store.authenticate(bearer(headers.get("authorization")))
        if tenant is None:
            raise HTTPException(401, "missing or unknown API key", headers={"WWW-Authenticate": "Bearer"})
        return TenantJobs(settings, tenant)

    def tenant_jobs(request: Request) -> TenantJobs:
        return tenant_of(request.headers)

    def guarded(fn, *args: Any) -> Any:
        try:
            return fn(*args)
        except JobNotFound as err:
            raise HTTPException(404, f"no job {err.args[0]!r}") from None
        except CheckpointNotFound as err:
            raise HTTPException(404, str(err)) from None
        except (SpecError, SchedulingError) as err:
            raise HTTPException(422, str(err)) from None
        except JobConflict as err:
            raise HTTPException(409, str(err)) from None
        except TooManyJobs as err:
            raise HTTPException(429, str(err)) from None

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        """On the event loop: it never waits for a thread of the pool the routes below share."""
        return {"ok": True}

    @app.get("/v1/whoami")
    def whoami(jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return {"tenant": jobs.tenant, "storage": jobs.storage_url, "experiment": jobs.tenant,
                "game_allowlist": list(settings.allowed_games)}

    # --- the client link: the tenant's client holds a WebSocket, the job posts its calls ------
    @app.websocket("/v1/jobs/{job_id}/link")
    async def client_link(socket: WebSocket, job_id: str) -> None:
        import asyncio

        try:
            jobs = tenant_of(socket.headers)
            owned = len(job_id) <= 256 and not control_problem(job_id) and await asyncio.to_thread(jobs.owns, job_id)
        except HTTPException:
            owned = False
        if not owned:  # a missing key, another tenant's job, no such job: all look the same
            await socket.close(code=1008, reason="no such job for this API key")
            return
        client = socket.query_params.get("client") or ""  # the EnvironmentLink's id: its own reconnects replace it
        await hub.serve_client(job_id, socket, client if client.isalnum() and len(client) <= 64 else None,
                               takeover=socket.query_params.get("takeover") == "1")

    @app.post("/v1/internal/jobs/{job_id}/link")
    async def job_link(job_id: JobId, request: Request) -> StreamingResponse:
        if not is_job_token(settings.stack_secret(), job_id, bearer(request.headers.get("authorization"))):
            raise HTTPException(401, "this endpoint takes the job's token")
        try:
            calls, timeout_s = valid_calls(await request.json())
        except ValueError as err:
            raise HTTPException(422, str(err)) from None
        return StreamingResponse(hub.relay(job_id, calls, timeout_s), media_type="application/x-ndjson")

    @app.post("/v1/jobs", status_code=201)
    def submit(body: SubmitRequest, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return guarded(jobs.submit, body.config, body.num_gpus)

    @app.get("/v1/jobs")
    def list_jobs(jobs: TenantJobs = Depends(tenant_jobs)) -> list[dict[str, Any]]:
        return jobs.list()

    @app.get("/v1/jobs/{job_id}")
    def status(job_id: JobId, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return guarded(jobs.status, job_id)

    @app.post("/v1/jobs/{job_id}/start")
    def start(job_id: JobId, body: StartRequest, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return guarded(jobs.start, job_id, body.env, body.steps)

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: JobId, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return guarded(jobs.cancel, job_id)

    @app.get("/v1/jobs/{job_id}/metrics")
    def metrics(job_id: JobId, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return guarded(jobs.metrics, job_id)

    @app.get("/v1/jobs/{job_id}/logs")
    def logs(job_id: JobId, offset: Annotated[int, Query(ge=0, le=MAX_LOG_OFFSET)] = 0,
             limit: Annotated[int, Query(ge=1, le=LOG_PAGE)] = LOG_PAGE, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        """A page of the job's log lines (its flow run's: the job's own), oldest first, from the
        `offset`-th; `next_offset` continues, and `complete` says that no more will come."""
        return guarded(jobs.logs, job_id, offset, limit)

    @app.get("/v1/jobs/{job_id}/artifacts")
    def artifacts(job_id: JobId, path: ArtifactQuery = None, jobs: TenantJobs = Depends(tenant_jobs)) -> list[dict[str, Any]]:
        return guarded(jobs.artifacts, job_id, path)

    @app.get("/v1/jobs/{job_id}/artifacts/{path:path}")
    def artifact(job_id: JobId, path: ArtifactPath, jobs: TenantJobs = Depends(tenant_jobs)) -> FileResponse:
        if ".." in Path(path).parts:
            raise HTTPException(400, "artifact path must stay inside the run")
        tmp = tempfile.TemporaryDirectory()
        local = guarded(jobs.download_artifact, job_id, path, tmp.name)
        if Path(local).is_dir():
            tmp.cleanup()
            raise HTTPException(400, f"{path} is a folder: list it with ?path={path}")
        return FileResponse(local, filename=Path(local).name, background=BackgroundTask(tmp.cleanup))

    @app.get("/v1/jobs/{job_id}/checkpoints")
    def list_checkpoints(job_id: JobId, jobs: TenantJobs = Depends(tenant_jobs)) -> list[dict[str, Any]]:
        """The job's step folders, oldest first: valid, or the reason resume skips it."""
        return guarded(jobs.list_checkpoints, job_id)

    @app.delete("/v1/jobs/{job_id}/checkpoints/{step}")
    def delete_checkpoint(job_id: JobId, step: Annotated[int, PathParam(ge=0)], jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        return guarded(jobs.delete_checkpoint, job_id, step)

    @app.post("/v1/inference", status_code=201)
    def submit_inference(body: InferenceRequest, jobs: TenantJobs = Depends(tenant_jobs)) -> dict[str, Any]:
        """Serve a checkpoint behind an OpenAI-compatible API; the job's status gives its URL once it serves."""
        from opentinker.control.gateway import inference

        return guarded(lambda: inference.submit(jobs, body.model_path, body.num_gpus, engine=body.engine,
                                                max_model_len=body.max_model_len, ttl_s=body.ttl_s))

    from opentinker.control.gateway.tinker_api import add_tinker_routes
    from opentinker.control.gateway.tinker_sessions import PrefectSessions

    app.include_router(console_router(settings, store, console_bounds))
    refused_body = add_tinker_routes(app, settings, store, tinker_sessions or PrefectSessions(settings))
    return ServerErrors(BodyLimit(app, settings.max_request_bytes, on_refused=refused_body), log)
