"""SandboxFusion's `POST /run_code`, answered by our bubblewrap sandbox, for its owner only.

The request and response are SandboxFusion's (sandbox-fusion 0.3.7's `RunCodeRequest` and
`RunCodeResponse`, and verl's `memory_limit_MB`), so the field's code recipes and the unmodified
`sandbox_fusion` client use it as they are. Python only ("python", or "python3"): another language
is a `Failed` response saying so (not `SandboxError`, which the client retries five times).

Only its owner gets in: every request carries the service's key, as `Authorization: Bearer KEY`
or, for clients that cannot send headers (sandbox_fusion's `run_code`, verl's tool, which take an
endpoint URL), as a path prefix: `http://127.0.0.1:PORT/k/KEY/run_code`, i.e. the endpoint
`http://127.0.0.1:PORT/k/KEY`. Keys are compared with hmac.compare_digest; uvicorn's access log is
off (it would write the key). Request bodies over 1 MiB are refused (413), and runs share the
sandbox's slots (one owner: `SandboxLimits.max_running` at once; sandbox.py). It listens on
127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict

from opentinker.core.asgi import BodyLimit, ServerErrors
from opentinker.core.own_servers import SERVER_KEEP_ALIVE_S
from opentinker.core.polling import wait_for
from opentinker.core.tokens import bearer
from opentinker.tools.sandbox import LANGUAGES, RunResult, Sandbox

log = logging.getLogger(__name__)

KEY_ENV = "OPENTINKER_SANDBOX_KEY"
MAX_BODY = 1 << 20
MAX_RUN_S = 60.0
MAX_MEMORY_MB = 4096


class RunCodeRequest(BaseModel):
    """SandboxFusion's request (extra fields are ignored, as its server does)."""

    model_config = ConfigDict(extra="ignore")
    code: str
    language: str = "python"
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1  # noqa: N815 - SandboxFusion's name (verl sends it)
    stdin: Optional[str] = None
    files: dict[str, Optional[str]] = {}
    fetch_files: list[str] = []


def new_key() -> str:
    """A fresh key: URL-safe, so it also works as a path segment."""
    return secrets.token_urlsafe(32)


def command_result(result: RunResult) -> dict[str, Any]:
    """SandboxFusion's CommandRunResult of one run."""
    return {"status": result.status, "execution_time": result.wall_s,
            "cpu_time": None, "return_code": result.return_code, "stdout": result.stdout, "stderr": result.stderr}


def failed(message: str, status: str = "Failed") -> dict[str, Any]:
    return {"status": status, "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def run_code(sandbox: Sandbox, request: RunCodeRequest, max_run_s: float = MAX_RUN_S, max_memory_mb: int = MAX_MEMORY_MB) -> dict[str, Any]:
    """One `/run_code` request through `sandbox`, as SandboxFusion answers it."""
    if request.language not in LANGUAGES:
        return failed(f"language {request.language!r} is not supported by this sandbox: it runs python only")
    try:
        files = {name: base64.b64decode(value, validate=True) for name, value in request.files.items() if value is not None}
    except (binascii.Error, ValueError):
        return failed("files: every value must be base64")
    wall = min(max(request.run_timeout, 0.1), max_run_s)
    memory = min(request.memory_limit_MB, max_memory_mb) if request.memory_limit_MB > 0 else None
    try:
        result = sandbox.run(request.code, stdin=request.stdin or "", files=files, language="python", wall_s=wall,
                             memory_mb=memory, fetch_files=request.fetch_files)
    except ValueError as err:
        return failed(str(err))
    except TimeoutError as err:  # no slot came free
        return failed(str(err), "SandboxError")
    if result.status == "Error":
        return failed(f"sandbox error: {result.message}", "SandboxError")
    ok = result.status == "Finished" and result.return_code == 0
    message = "" if ok else (result.message or f"exit status {result.return_code}")
    return {"status": "Success" if ok else "Failed", "message": message, "compile_result": None,
            "run_result": command_result(result), "executor_pod_name": socket.gethostname(),
            "files": {name: base64.b64encode(data).decode() for name, data in result.files.items()}}


class KeyGuard:
    """401 unless the request carries the key: `Authorization: Bearer KEY`, or the path prefix
    `/k/KEY/` (then stripped, so the app sees `/run_code`)."""

    def __init__(self, app: Any, key: str):
        self.app, self.key = app, key

    def _matches(self, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), self.key.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope.get("path", "")
        if path.startswith("/k/"):
            given, _, rest = path[3:].partition("/")
            if self._matches(given):
                scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}
                return await self.app(scope, receive, send)
        elif self._matches(bearer(dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1"))):
            return await self.app(scope, receive, send)
        body = json.dumps({"detail": "missing or wrong key: send Authorization: Bearer KEY, or use the endpoint "
                                     "http://HOST:PORT/k/KEY"}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def create_app(sandbox: Sandbox, key: str, max_body: int = MAX_BODY, max_run_s: float = MAX_RUN_S) -> Any:
    """The ASGI app: `/run_code` and `/v1/ping` behind the key, bodies capped at `max_body`."""
    from fastapi import FastAPI

    app = FastAPI(title="OpenTinker sandbox (SandboxFusion API)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/run_code")
    def run_code_route(request: RunCodeRequest) -> dict[str, Any]:  # a plain def: FastAPI runs it in its thread pool
        return run_code(sandbox, request, max_run_s)

    @app.get("/v1/ping")
    def ping() -> str:
        return "pong"

    return KeyGuard(ServerErrors(BodyLimit(app, max_body), log), key)


@dataclass
class RunningService:
    """A service started by `serve_in_thread`: its base URL, the endpoint to give sandbox_fusion."""

    url: str
    key: str
    _server: Any
    _thread: threading.Thread

    @property
    def endpoint(self) -> str:
        return f"{self.url}/k/{self.key}"

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)


def serve_in_thread(sandbox: Sandbox, key: str, host: str = "127.0.0.1", port: int = 0, max_body: int = MAX_BODY,
                    timeout: float = 30.0) -> RunningService:
    """Run the service with uvicorn in a daemon thread (port 0: a free one); returns once it listens."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(create_app(sandbox, key, max_body), log_level="warning", access_log=False,
                            timeout_keep_alive=SERVER_KEEP_ALIVE_S, limit_concurrency=1024)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="sandbox-service", daemon=True)
    thread.start()

    def started() -> bool | None:
        if not thread.is_alive():
            raise RuntimeError(f"the sandbox service on {host}:{sock.getsockname()[1]} stopped while starting")
        return True if server.started else None

    wait_for(started, interval=0.02, timeout=timeout, what="the sandbox service")
    bound = sock.getsockname()[1]
    return RunningService(url=f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}", key=key,
                          _server=server, _thread=thread)
