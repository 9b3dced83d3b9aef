"""The services of the embedded stack, declared: how each starts (command, environment, working
folder), where it answers (port, URL) and how to tell it is healthy. `Stack` starts them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from opentinker.core.settings import Settings, mlflow_env, prefect_env, settings_env

SERVICES = ("prefect", "mlflow", "worker", "gateway")


def worker_env(s: Settings) -> dict[str, str]:
    """Flow runs inherit the worker's environment: they find Prefect, MLflow and the settings.
    The worker polls every 2 s instead of Prefect's 10: a freed slot is refilled sooner."""
    return {**settings_env(s), **prefect_env(s), **mlflow_env(s), "PREFECT_WORKER_QUERY_SECONDS": "2"}


def http_ok(url: str, method: str = "GET", **kwargs) -> httpx.Response | None:
    """The response if the request succeeded with 2xx; None otherwise (never raises).
    trust_env=False: a proxy set in the environment must not intercept loopback probes."""
    try:
        response = httpx.request(method, url, timeout=2.0, trust_env=False, **kwargs)
    except httpx.HTTPError:
        return None
    return response if response.is_success else None


def worker_name(s: Settings) -> str:
    return f"opentinker-{s.work_pool}"


def _worker_registered(s: Settings, pid: int) -> bool:
    """True once the worker started as `pid` has sent the server a heartbeat (not a stale one
    left by an earlier worker of the same name)."""
    response = http_ok(
        f"{s.prefect_api_url}/work_pools/{s.work_pool}/workers/filter", method="POST", json={}
    )
    if response is None:
        return False
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        return False
    for worker in response.json():
        beat = worker.get("last_heartbeat_time")
        if worker.get("name") == worker_name(s) and worker.get("status") == "ONLINE" and beat:
            if datetime.fromisoformat(beat).timestamp() >= started - 1.0:
                return True
    return False


@dataclass(frozen=True)
class Service:
    name: str
    keywords: tuple[str, ...]  # words of its command line, to tell our pid from a reused one
    port: Callable[[Settings], int | None]
    url: Callable[[Settings], str | None]
    command: Callable[[Settings], list[str]]
    env: Callable[[Settings], dict[str, str]]
    healthy: Callable[[Settings, int], bool]
    # Servers run in the state dir (stray files land there); the worker, like `prefect worker
    # start` in a shell, where `up()` was called, the directory its flow runs start in.
    cwd: Callable[[Settings], Path] = lambda s: s.state_dir


def _prefect_server_env(s: Settings) -> dict[str, str]:
    home = s.state_dir / "prefect"
    return {
        **prefect_env(s),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        # Slot leases on disk, not in the server's memory: a restarted server still knows the
        # leases of running jobs (releases them, expires them), so no slot leaks across a restart.
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
        "PREFECT_SERVER_UI_ENABLED": "true",
    }


SPECS: dict[str, Service] = {
    "prefect": Service(
        name="prefect",
        keywords=("prefect", "server"),
        port=lambda s: s.prefect_port,
        url=lambda s: s.prefect_ui_url,
        command=lambda s: [sys.executable, "-m", "prefect", "server", "start",
                           "--host", s.host, "--port", str(s.prefect_port)],
        env=_prefect_server_env,
        healthy=lambda s, pid: http_ok(f"{s.prefect_api_url}/health") is not None,
    ),
    "mlflow": Service(
        name="mlflow",
        keywords=("mlflow", "server"),
        port=lambda s: s.mlflow_port,
        url=lambda s: s.mlflow_url,
        # Loopback is in MLflow's default --allowed-hosts / CORS origins: no security flags needed.
        command=lambda s: [sys.executable, "-m", "mlflow", "server",
                           "--host", s.host, "--port", str(s.mlflow_port), "--workers", "1",
                           "--backend-store-uri", f"sqlite:///{s.state_dir}/mlflow/mlflow.db",
                           "--artifacts-destination", s.mlflow_artifacts_destination],
        env=lambda s: {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        healthy=lambda s, pid: http_ok(f"{s.mlflow_url}/health") is not None,
    ),
    "worker": Service(
        name="worker",
        keywords=("prefect", "worker"),
        port=lambda s: None,
        url=lambda s: f"{s.prefect_ui_url}/work-pools/work-pool/{s.work_pool}",
        command=lambda s: [sys.executable, "-m", "prefect", "worker", "start",
                           "--pool", s.work_pool, "--type", "process",
                           "--name", worker_name(s), "--install-policy", "never"],
        env=worker_env,
        healthy=_worker_registered,
        cwd=lambda s: Path.cwd(),
    ),
    "gateway": Service(
        name="gateway",
        keywords=("uvicorn", "opentinker.control.gateway"),
        port=lambda s: s.gateway_port,
        url=lambda s: s.gateway_url,
        command=lambda s: [sys.executable, "-m", "uvicorn", "--factory", "opentinker.control.gateway.app:create_app",
                           "--host", s.host, "--port", str(s.gateway_port), "--log-level", "warning",
                           "--timeout-keep-alive", "75"],  # longer than clients keep idle connections
        env=worker_env,
        healthy=lambda s, pid: http_ok(f"{s.gateway_url}/v1/health") is not None,
    ),
}
