"""The embedded local stack: a Prefect server, a Prefect process worker, an MLflow server and
the job gateway.

All four run on one machine, bound to `settings.host` (loopback by default), as detached
processes in their own sessions, so they outlive the command that started them and `down()`
can stop each one with its children by signalling its process group. Each writes its output to
`<state_dir>/logs/<name>.log` and its pid to `<state_dir>/pids/<name>.pid`; the pid files are
the only record of what this stack owns: `up()` reuses a live, healthy service found there and
refuses (before starting anything) a port that some other program holds.

Services inherit the environment `up()` runs in (minus OPENTINKER_*, which come from the settings),
so storage credentials and endpoints (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
AWS_ENDPOINT_URL_S3, MLFLOW_S3_ENDPOINT_URL) reach the MLflow server and every job the worker runs
without ever being written into settings or specs. With remote artifacts (settings.artifacts_url, or
an s3:// storage_url) `up()` first checks that the bucket answers, and refuses to start otherwise.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from opentinker.settings import Settings, get_settings

SERVICES = ("prefect", "mlflow", "worker", "gateway")
_POLL = 0.25  # seconds between health probes while waiting


class StackError(RuntimeError):
    """A stack operation failed for a reason the user can act on; the message says which."""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    running: bool
    pid: int | None
    url: str | None
    healthy: bool
    log: Path


# --- environments handed to services and to client code -------------------------------------


def prefect_env(settings: Settings) -> dict[str, str]:
    """Variables that point a Prefect client (CLI, flow, worker) at this stack's server."""
    env = {
        "PREFECT_API_URL": settings.prefect_api_url,
        "PREFECT_HOME": str(settings.state_dir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    if settings.prefect_api_url.startswith("http://"):
        env["PREFECT_API_SSL_CERT_FILE"] = str(_plain_http_ca_file(settings))
    return env


def _plain_http_ca_file(settings: Settings) -> Path:
    """A one-certificate CA file for clients of a plain-http API.

    Every Prefect client builds a TLS context from its CA file even for http:// URLs, where TLS is
    never used; with the full certifi bundle that costs ≈60 ms per client, and each task run on a
    Ray worker builds two (measured: ≈120 of its ≈185 ms start-up). A single certificate makes
    that free. Only set for http:// APIs, so it never weakens a real TLS connection."""
    import certifi

    path = settings.state_dir / "prefect" / "plain-http-ca.pem"
    if not path.exists():
        bundle = Path(certifi.where()).read_text()
        end = "-----END CERTIFICATE-----"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(bundle[: bundle.index(end) + len(end)] + "\n")
    return path


def mlflow_env(settings: Settings) -> dict[str, str]:
    """Variables that point an MLflow client at this stack's tracking server."""
    return {"MLFLOW_TRACKING_URI": settings.mlflow_url}


def settings_env(settings: Settings) -> dict[str, str]:
    """`settings` as OPENTINKER_* variables, so a process started with them reads the same."""
    return {f"OPENTINKER_{name.upper()}": str(value)
            for name, value in settings.model_dump().items() if value is not None}


def _worker_env(s: Settings) -> dict[str, str]:
    """Flow runs inherit the worker's environment: they find Prefect, MLflow and the settings.
    The worker polls every 2 s instead of Prefect's 10: a freed slot is refilled sooner."""
    return {**settings_env(s), **prefect_env(s), **mlflow_env(s), "PREFECT_WORKER_QUERY_SECONDS": "2"}


# --- the services ----------------------------------------------------------------------------


def _http_ok(url: str, method: str = "GET", **kwargs) -> httpx.Response | None:
    """The response if the request succeeded with 2xx; None otherwise (never raises).
    trust_env=False: a proxy set in the environment must not intercept loopback probes."""
    try:
        response = httpx.request(method, url, timeout=2.0, trust_env=False, **kwargs)
    except httpx.HTTPError:
        return None
    return response if response.is_success else None


def _worker_name(s: Settings) -> str:
    return f"opentinker-{s.work_pool}"


def _worker_registered(s: Settings, pid: int) -> bool:
    """True once the worker started as `pid` has sent the server a heartbeat (not a stale one
    left by an earlier worker of the same name)."""
    response = _http_ok(
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
        if worker.get("name") == _worker_name(s) and worker.get("status") == "ONLINE" and beat:
            if datetime.fromisoformat(beat).timestamp() >= started - 1.0:
                return True
    return False


@dataclass(frozen=True)
class _Service:
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
        "PREFECT_SERVER_UI_ENABLED": "true",
    }


_SPECS = {
    "prefect": _Service(
        name="prefect",
        keywords=("prefect", "server"),
        port=lambda s: s.prefect_port,
        url=lambda s: s.prefect_ui_url,
        command=lambda s: [sys.executable, "-m", "prefect", "server", "start",
                           "--host", s.host, "--port", str(s.prefect_port)],
        env=_prefect_server_env,
        healthy=lambda s, pid: _http_ok(f"{s.prefect_api_url}/health") is not None,
    ),
    "mlflow": _Service(
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
        healthy=lambda s, pid: _http_ok(f"{s.mlflow_url}/health") is not None,
    ),
    "worker": _Service(
        name="worker",
        keywords=("prefect", "worker"),
        port=lambda s: None,
        url=lambda s: f"{s.prefect_ui_url}/work-pools/work-pool/{s.work_pool}",
        command=lambda s: [sys.executable, "-m", "prefect", "worker", "start",
                           "--pool", s.work_pool, "--type", "process",
                           "--name", _worker_name(s), "--install-policy", "never"],
        env=_worker_env,
        healthy=_worker_registered,
        cwd=lambda s: Path.cwd(),
    ),
    "gateway": _Service(
        name="gateway",
        keywords=("uvicorn", "opentinker.gateway"),
        port=lambda s: s.gateway_port,
        url=lambda s: s.gateway_url,
        command=lambda s: [sys.executable, "-m", "uvicorn", "--factory", "opentinker.gateway.app:create_app",
                           "--host", s.host, "--port", str(s.gateway_port), "--log-level", "warning"],
        env=_worker_env,
        healthy=lambda s, pid: _http_ok(f"{s.gateway_url}/v1/health") is not None,
    ),
}


# --- processes --------------------------------------------------------------------------------


def _alive(pid: int, keywords: tuple[str, ...]) -> bool:
    """Is `pid` a live (not zombie) process whose command line has all `keywords`?"""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            try:
                os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
            except ChildProcessError:
                pass
            return False
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return all(word in cmdline for word in keywords)


def _port_free(host: str, port: int) -> bool:
    """Can a server bind host:port? (SO_REUSEADDR, like uvicorn: TIME_WAIT leftovers are fine.)"""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise StackError(f"cannot resolve host {host!r}: {exc}; set OPENTINKER_HOST") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise StackError(
                f"cannot bind {host}:{port}: {exc.strerror}; set OPENTINKER_HOST") from None
    return True


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    kept = [line for line in text if line.strip()][-lines:]
    return "\n".join(f"    {line}" for line in kept) or "    (log is empty)"


class Stack:
    """Start, stop and inspect the embedded stack described by `settings`."""

    def __init__(self, settings: Settings | None = None):
        self.settings = settings or get_settings()
        self.state_dir = self.settings.state_dir

    # paths
    def pid_file(self, name: str) -> Path:
        return self.state_dir / "pids" / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def _recorded_pid(self, name: str) -> int | None:
        try:
            return int(self.pid_file(name).read_text().strip())
        except (OSError, ValueError):
            return None

    def pid(self, name: str) -> int | None:
        """The pid of our live service `name`, or None."""
        pid = self._recorded_pid(name)
        return pid if pid is not None and _alive(pid, _SPECS[name].keywords) else None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One up()/down() at a time per state dir (two shells racing would start twins)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "stack.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # inspection
    def service_status(self, name: str) -> ServiceStatus:
        spec, pid = _SPECS[name], self.pid(name)
        healthy = pid is not None and spec.healthy(self.settings, pid)
        return ServiceStatus(name, pid is not None, pid, spec.url(self.settings), healthy,
                             self.log_file(name))

    def status(self) -> dict[str, ServiceStatus]:
        """Per service: running (our process is alive), pid, url, healthy (answers its probe)."""
        return {name: self.service_status(name) for name in SERVICES}

    # start-up
    def up(self, timeout: float = 120.0) -> dict[str, ServiceStatus]:
        """Start what is not running, reuse what is, and wait until all are healthy.

        Raises StackError, before starting anything, if a port we need is held by another
        program; and if a service exits or stays unhealthy past `timeout` (services started by
        this call are then stopped again, so a failed `up()` leaves nothing behind).
        """
        with self._locked():
            return self._up(time.monotonic() + timeout)

    def _up(self, deadline: float) -> dict[str, ServiceStatus]:
        s = self.settings
        for sub in ("pids", "logs", "prefect", "mlflow/artifacts"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        pids = {name: self.pid(name) for name in SERVICES}
        # A dead service may have left children holding its port: clear them and its pid file.
        self._stop([name for name, pid in pids.items() if pid is None], timeout=5.0)
        for name in ("prefect", "mlflow", "gateway"):
            port = _SPECS[name].port(s)
            if pids[name] is None and not _port_free(s.host, port):
                raise StackError(
                    f"{name} port {port} on {s.host} is in use by another program; "
                    f"set OPENTINKER_{name.upper()}_PORT"
                )
        if pids["mlflow"] is None:
            _check_remote_storage(s)
        started: list[str] = []
        try:
            for name in ("prefect", "mlflow"):
                if pids[name] is None:
                    pids[name] = self._spawn(name)
                    started.append(name)
            self._wait("prefect", pids["prefect"], deadline)
            if pids["worker"] is None:
                self._ensure_work_pool(deadline)
                pids["worker"] = self._spawn("worker")
                started.append("worker")
            self._wait("worker", pids["worker"], deadline)
            self._wait("mlflow", pids["mlflow"], deadline)
            if pids["gateway"] is None:
                pids["gateway"] = self._spawn("gateway")
                started.append("gateway")
            self._wait("gateway", pids["gateway"], deadline)
        except BaseException:
            for name in started:
                self._stop([name])
            raise
        return self.status()

    def start(self, name: str, timeout: float = 120.0) -> ServiceStatus:
        """Start (or reuse) one service on its own and wait until it is healthy, e.g. only MLflow
        for a tool or test that needs no scheduler. `down()` stops it like the others."""
        with self._locked():
            for sub in ("pids", "logs", "mlflow/artifacts"):
                (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            pid = self.pid(name)
            if pid is None:
                if name == "mlflow":
                    _check_remote_storage(self.settings)
                pid = self._spawn(name)
            try:
                self._wait(name, pid, time.monotonic() + timeout)
            except BaseException:
                self._stop([name])
                raise
        return self.service_status(name)

    def _spawn(self, name: str) -> int:
        spec = _SPECS[name]
        # Drop inherited OPENTINKER_* so a field left unset here is unset there too.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
        env = {**inherited, **spec.env(self.settings)}
        with open(self.log_file(name), "ab") as log:
            log.write(f"\n=== opentinker: starting {name} at {time.ctime()} ===\n".encode())
            log.flush()
            proc = subprocess.Popen(
                spec.command(self.settings), env=env, cwd=spec.cwd(self.settings),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid_file(name).write_text(f"{proc.pid}\n")
        return proc.pid

    def _wait(self, name: str, pid: int, deadline: float) -> None:
        spec = _SPECS[name]
        while True:
            # No keyword check here: right after fork the child still shows our command line.
            if not _alive(pid, ()):
                raise StackError(
                    f"{name} exited during start-up; last lines of {self.log_file(name)}:\n"
                    + _tail(self.log_file(name))
                )
            if spec.healthy(self.settings, pid):
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"{name} not healthy before the timeout; last lines of "
                    f"{self.log_file(name)}:\n" + _tail(self.log_file(name))
                )
            time.sleep(_POLL)

    def _ensure_work_pool(self, deadline: float) -> None:
        """Create or resize the `gpu` and `cpu` pools and their slot limits (scheduler.py)."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from opentinker.scheduler import SchedulingError, ensure_pools

        with temporary_settings({PREFECT_API_URL: self.settings.prefect_api_url}):
            try:
                ensure_pools(self.settings)
            except SchedulingError as err:
                raise StackError(f"{err}; set OPENTINKER_WORK_POOL or remove that pool") from None

    # shut-down
    def down(self, timeout: float = 15.0) -> None:
        """Stop every service (worker first): SIGTERM its process group, wait up to
        `timeout`, then SIGKILL. Removes the pid files. Safe to call when nothing runs."""
        with self._locked():
            self._stop(["gateway", "worker", "prefect", "mlflow"], timeout)

    def _stop(self, names: list[str], timeout: float = 15.0) -> None:
        groups = {}
        for name in names:
            pgid = self._recorded_pid(name)  # = process group id (own session)
            if pgid is not None and _group_members(pgid, _SPECS[name].keywords[0]):
                groups[name] = pgid
                _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while groups and time.monotonic() < deadline:
            time.sleep(_POLL)
            groups = {n: g for n, g in groups.items() if _group_members(g)}
        for pgid in groups.values():
            _signal_group(pgid, signal.SIGKILL)
        for name in names:
            pid = self._recorded_pid(name)
            if pid is not None:
                _reap(pid)  # an exited child of ours stays a zombie until reaped
            self.pid_file(name).unlink(missing_ok=True)


def _check_remote_storage(s: Settings) -> None:
    """MLflow would start fine and fail only at the first artifact upload: check a remote
    artifact destination (and a remote storage_url, where the gateway puts jobs) up front."""
    from opentinker.storage import StorageError, check_storage

    urls = {s.storage_url: "OPENTINKER_STORAGE_URL", s.mlflow_artifacts_destination: "MLflow --artifacts-destination"}
    for url, name in urls.items():
        if "://" in url and not url.startswith("file://"):
            try:
                check_storage(url, name)
            except StorageError as err:
                raise StackError(str(err)) from None


def _reap(pid: int, timeout: float = 2.0) -> None:
    """Collect our exited child `pid` (no-op for a process that is not our child)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int, keyword: str = "") -> list[psutil.Process]:
    """Live (non-zombie) processes of group `pgid` whose command line has `keyword`.
    Reaps the group leader first if it is our own exited child."""
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    members = []
    for proc in psutil.process_iter(["status", "cmdline"]):
        try:
            if (os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE
                    and keyword in " ".join(proc.info["cmdline"] or ())):
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def up(settings: Settings | None = None, timeout: float = 120.0) -> dict[str, ServiceStatus]:
    return Stack(settings).up(timeout)


def down(settings: Settings | None = None) -> None:
    Stack(settings).down()


def status(settings: Settings | None = None) -> dict[str, ServiceStatus]:
    return Stack(settings).status()
