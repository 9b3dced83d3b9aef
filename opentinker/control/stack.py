"""The embedded local stack: a Prefect server, a Prefect process worker, an MLflow server, a Ray
head that every job joins, the job gateway, and the sandbox service (SandboxFusion's `/run_code` on
127.0.0.1, for the owner only: its key is in `<state_dir>/sandbox-key`; left out, and said in one
line by the CLI, where bubblewrap does not run).

All run on one machine, bound to `settings.listen_host` (loopback by default; the gateway to
`gateway_listen_host`, the one public door), as detached
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

import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from opentinker.control.processes import PortError, alive, group_members, port_free, reap, signal_group, tail
from opentinker.control.services import SANDBOX_HOST, SPECS, ray_temp_dir, remove_stand_in, services_for
from opentinker.core.env_hosts import OWN_SERVER_MARK
from opentinker.core.polling import wait_for
from opentinker.core.settings import Settings, get_settings

_POLL = 0.25  # seconds between health probes while waiting


class StackError(RuntimeError):
    """A stack operation failed for a reason the user can act on; the message says which."""


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    running: bool  # our process (its pid file) is alive
    pid: int | None
    url: str | None
    healthy: bool  # ours, and it answers its health probe
    log: Path
    answering: bool = False  # something answers on its port, ours or not


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
        return pid if pid is not None and alive(pid, SPECS[name].keywords) else None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One up()/down() at a time per state dir (two shells racing would start twins)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "stack.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # inspection
    def service_status(self, name: str) -> ServiceStatus:
        spec, pid = SPECS[name], self.pid(name)
        answering = spec.port(self.settings) is not None and spec.healthy(self.settings, pid or 0)
        healthy = pid is not None and (answering or spec.healthy(self.settings, pid))
        return ServiceStatus(name, pid is not None, pid, spec.url(self.settings), healthy, self.log_file(name), answering)

    def status(self) -> dict[str, ServiceStatus]:
        """Per service: running (our process is alive), pid, url, healthy (answers its probe)."""
        return {name: self.service_status(name) for name in services_for(self.settings)}

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
        names = services_for(s)
        _check_ports(s, names)
        for sub in ("pids", "logs", "prefect", "mlflow/artifacts"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        pids = {name: self.pid(name) for name in names}
        # A dead service may have left children holding its port: clear them and its pid file.
        self._stop([name for name, pid in pids.items() if pid is None], timeout=5.0)
        for name in ("prefect", "mlflow", "ray", "gateway", "sandbox"):
            port = SPECS[name].port(s)
            if name in names and pids[name] is None and not self._port_free(port, name):
                raise StackError(
                    f"{name} port {port} on {self._host(name)} is in use by another program; "
                    f"set OPENTINKER_{name.upper()}_PORT"
                )
        if "ray" in names and pids["ray"] is None and not self._port_free(s.ray_client_port, "ray"):
            raise StackError(f"ray client port {s.ray_client_port} on {s.listen_host} is in use by another program; "
                             "set OPENTINKER_RAY_CLIENT_PORT")
        if pids["mlflow"] is None:
            _check_remote_storage(s)
        _check_databases(s, [name for name in ("prefect", "mlflow") if pids[name] is None])
        started: list[str] = []
        try:
            for name in ("prefect", "mlflow", "ray", "sandbox"):
                if name in names and pids[name] is None:
                    pids[name] = self._spawn(name)
                    started.append(name)
            self._wait("prefect", pids["prefect"], deadline)
            if pids["worker"] is None:
                self._ensure_work_pool(deadline)
                pids["worker"] = self._spawn("worker")
                started.append("worker")
            self._wait("worker", pids["worker"], deadline)
            self._wait("mlflow", pids["mlflow"], deadline)
            if "ray" in names:
                self._wait("ray", pids["ray"], deadline)
            if pids["gateway"] is None:
                pids["gateway"] = self._spawn("gateway")
                started.append("gateway")
            self._wait("gateway", pids["gateway"], deadline)
            if "sandbox" in names:
                self._wait("sandbox", pids["sandbox"], deadline)
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
        spec = SPECS[name]
        # Drop inherited OPENTINKER_* so a field left unset here is unset there too.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
        env = {**inherited, **spec.env(self.settings), **OWN_SERVER_MARK}  # what it and its children listen on is no environment
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

    def _host(self, name: str) -> str:
        if name == "sandbox":
            return SANDBOX_HOST
        return self.settings.gateway_listen_host if name == "gateway" else self.settings.listen_host

    def _port_free(self, port: int, name: str = "prefect") -> bool:
        try:
            return port_free(self._host(name), port)
        except PortError as err:
            raise StackError(str(err)) from None

    def _wait(self, name: str, pid: int, deadline: float) -> None:
        """Until `name` answers its health probe; StackError with its log's end if it exits or
        stays unhealthy past `deadline`."""
        spec = SPECS[name]

        def healthy() -> bool | None:
            # No keyword check here: right after fork the child still shows our command line.
            if not alive(pid, ()):
                raise StackError(f"{name} exited during start-up; last lines of {self.log_file(name)}:\n" + tail(self.log_file(name)))
            return True if spec.healthy(self.settings, pid) else None

        try:
            wait_for(healthy, interval=_POLL, timeout=max(0.0, deadline - time.monotonic()), what=name)
        except TimeoutError:
            raise StackError(f"{name} not healthy before the timeout; last lines of {self.log_file(name)}:\n"
                             + tail(self.log_file(name))) from None

    def _ensure_work_pool(self, deadline: float) -> None:
        """Create or resize the `gpu` and `cpu` pools and their slot limits (scheduler.py)."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from opentinker.control.scheduler import SchedulingError, ensure_pools

        with temporary_settings({PREFECT_API_URL: self.settings.prefect_api_url}):
            try:
                ensure_pools(self.settings)
            except SchedulingError as err:
                raise StackError(f"{err}; set OPENTINKER_WORK_POOL or remove that pool") from None

    # shut-down
    def down(self, timeout: float = 15.0) -> None:
        """Stop every service (the worker's flow runs first): SIGTERM its process group, wait up to
        `timeout`, then SIGKILL. Removes the pid files. Safe to call when nothing runs."""
        with self._locked():
            self._stop_runs(timeout)
            self._stop(["gateway", "sandbox", "worker", "ray", "prefect", "mlflow"], timeout)
            remove_stand_in(ray_temp_dir(self.settings))

    def _stop_runs(self, timeout: float) -> None:
        """SIGTERM the flow runs our worker started and wait for them: a run stopped so records its end
        (Crashed; its MLflow run ended) while Prefect, MLflow and Ray still answer, where the worker's
        own shutdown would kill it with no record (its job or Tinker session then read Running for
        minutes after a restart)."""
        pid = self.pid("worker")
        try:
            runs = [p for p in psutil.Process(pid).children(recursive=True) if "prefect.engine" in p.cmdline()] if pid else []
        except psutil.Error:
            return
        for run in runs:
            run.terminate()
        psutil.wait_procs(runs, timeout=timeout)  # what is left, the worker's shutdown kills

    def _stop(self, names: list[str], timeout: float = 15.0) -> None:
        groups = {}
        for name in names:
            pgid = self._recorded_pid(name)  # = process group id (own session)
            if pgid is not None and group_members(pgid, SPECS[name].keywords[0]):
                groups[name] = pgid
                signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while groups and time.monotonic() < deadline:
            time.sleep(_POLL)
            groups = {n: g for n, g in groups.items() if group_members(g)}
        for pgid in groups.values():
            signal_group(pgid, signal.SIGKILL)
        for name in names:
            pid = self._recorded_pid(name)
            if pid is not None:
                reap(pid)  # an exited child of ours stays a zombie until reaped
            self.pid_file(name).unlink(missing_ok=True)


RAY_WORKER_PORTS = (10002, 19999)  # Ray's default --min-worker-port/--max-worker-port: its workers listen in there


def _check_ports(s: Settings, names: tuple[str, ...]) -> None:
    """Every port the stack listens on is its own and outside Ray's worker ports, before anything
    starts: a Ray worker may take such a port first, and `ray start` refuses a client server port in
    there only after a long start, with a traceback."""
    fields = ["prefect_port", "mlflow_port", "gateway_port", *(["ray_port", "ray_client_port"] if "ray" in names else []),
              *(["sandbox_port"] if "sandbox" in names else [])]
    low, high = RAY_WORKER_PORTS
    seen: dict[int, str] = {}
    for field in fields:
        port, variable = getattr(s, field), f"OPENTINKER_{field.upper()}"
        if low <= port <= high:
            raise StackError(f"{variable}={port} is inside Ray's worker port range {low}-{high}: choose a port outside it")
        if port in seen:
            raise StackError(f"{variable}={port} is also {seen[port]}: each service needs a port of its own")
        seen[port] = variable


def _check_remote_storage(s: Settings) -> None:
    """MLflow would start fine and fail only at the first artifact upload: check a remote
    artifact destination (and a remote storage_url, where the gateway puts jobs) up front."""
    from opentinker.storage.preflight import StorageError, check_storage

    urls = {s.storage_url: "OPENTINKER_STORAGE_URL", s.mlflow_artifacts_destination: "MLflow --artifacts-destination"}
    for url, name in urls.items():
        if "://" in url and not url.startswith("file://"):
            try:
                check_storage(url, name)
            except StorageError as err:
                raise StackError(str(err)) from None


def _check_databases(s: Settings, starting: list[str]) -> None:
    """A server would start and die (or hang) on a database that does not answer: check that each
    database a server about to start names (other than SQLite) accepts connections, in one line
    without its password."""
    import socket
    from urllib.parse import urlsplit

    urls = {"prefect": ("OPENTINKER_PREFECT_DATABASE_URL", s.prefect_database_url),
            "mlflow": ("OPENTINKER_MLFLOW_BACKEND_STORE_URI", s.mlflow_backend_store_uri)}
    for name in starting:
        variable, url = urls[name]
        if not url or url.startswith("sqlite"):
            continue
        parts = urlsplit(url)
        shown = url.replace(f":{parts.password}@", ":***@") if parts.password else url
        try:
            with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5432), timeout=5):
                pass
        except OSError as err:
            raise StackError(f"{variable} {shown}: no database answers there ({err})") from None


def up(settings: Settings | None = None, timeout: float = 120.0) -> dict[str, ServiceStatus]:
    return Stack(settings).up(timeout)


def down(settings: Settings | None = None) -> None:
    Stack(settings).down()


def status(settings: Settings | None = None) -> dict[str, ServiceStatus]:
    return Stack(settings).status()
