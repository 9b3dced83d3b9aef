"""The services of the embedded stack, declared: how each starts (command, environment, working
folder), where it answers (port, URL) and how to tell it is healthy. `Stack` starts them."""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import os
import shlex
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from opentinker.core.hardware import detect_gpus
from opentinker.core.settings import Settings, mlflow_env, prefect_env, ray_env, settings_env

SERVICES = ("prefect", "mlflow", "ray", "worker", "gateway", "sandbox")


def services_for(s: Settings) -> tuple[str, ...]:
    """The services this stack runs: the Ray head only when jobs join it (ray_head, no other cluster),
    the sandbox service only where bubblewrap runs (`sandbox_unavailable`)."""
    left_out = {"ray"} if not (s.ray_head and not s.ray_address) else set()
    if sandbox_unavailable():
        left_out.add("sandbox")
    return tuple(n for n in SERVICES if n not in left_out)


@functools.cache
def sandbox_unavailable() -> str | None:
    """Why the sandbox service cannot run on this machine, in one line naming the Debian package
    (bubblewrap missing, or refused its namespaces); None: it can. One empty sandboxed run, once."""
    from opentinker.tools.sandbox import MISSING, Sandbox

    try:
        Sandbox()
    except RuntimeError as err:
        return str(err).replace(MISSING, "it needs bubblewrap (Debian package: bubblewrap)")
    return None


# A worker polls every 2 s instead of Prefect's 10 (a freed slot is refilled sooner), and it and its
# flow runs retry a busy Prefect server (503 while its database is locked) for about four minutes
# instead of one: under a burst on 2 cores the embedded SQLite server stalled past Prefect's
# 5 retries, and the worker failed a job it could not label (bench/scheduler_load.py). No API
# version handshake per process: a flow's tasks start Ray worker processes whose first call to
# Prefect would be that handshake, and during a Prefect restart it fails the task at once (a fresh
# client does not retry a refused connection); the worker and the server are one install.
WORKER_PREFECT_ENV = {"PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_CLIENT_MAX_RETRIES": "7",
                      "PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED": "false"}


def worker_prefect_env(s: Settings) -> dict[str, str]:
    """A Prefect worker's own variables; its flow runs send heartbeats every `run_heartbeat_s`, which
    the scheduler's lost-run automation watches (scheduler.py)."""
    return {**WORKER_PREFECT_ENV, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(s.run_heartbeat_s)}


def worker_env(s: Settings) -> dict[str, str]:
    """Flow runs inherit the worker's environment: they find Prefect, MLflow, the settings and the
    stack's Ray head (with its token)."""
    env = {**settings_env(s), **prefect_env(s), **mlflow_env(s), **ray_env(s), **worker_prefect_env(s)}
    if "ray" in services_for(s):
        env["OPENTINKER_RAY_ADDRESS"] = s.ray_head_address
    return env


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
        "PREFECT_API_DATABASE_CONNECTION_URL": s.prefect_database_url or f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        # Slot leases on disk, not in the server's memory: a restarted server still knows the
        # leases of running jobs (releases them, expires them), so no slot leaks across a restart.
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
        # A job waiting for a slot retries after at most this long. Prefect's default (30 s, scaled
        # by how long slots are held) left a freed slot idle for up to half a minute.
        "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
        "PREFECT_SERVER_UI_ENABLED": "true",
    }


def _mlflow_command(s: Settings) -> list[str]:
    """Loopback is in MLflow's default --allowed-hosts; a server others dial must allow the name they
    use. The backend store comes from the environment (`_mlflow_env`): a command line is public."""
    command = [sys.executable, "-m", "mlflow", "server", "--host", s.listen_host, "--port", str(s.mlflow_port),
               "--workers", "1", "--artifacts-destination", s.mlflow_artifacts_destination]
    if s.host not in ("127.0.0.1", "localhost"):
        command += ["--allowed-hosts", f"{s.host}:{s.mlflow_port},localhost:*,127.0.0.1:*"]
    return command


def ray_dir(state_dir: Path, name: str) -> Path:
    """A Ray node's own folder (its --temp-dir: sessions, logs, sockets), `<home>/<name>`. The home is
    `<state_dir>/ray` when the path is short enough for Ray's socket names (AF_UNIX paths stop at 107
    bytes), else a short stand-in in the system's temporary folder named after the state dir
    (`is_stand_in` tells; whoever started the node removes its folder when it stops). Ray makes every
    folder it creates 0777 (`ray._common.utils.try_make_directory_shared`, session and sockets
    folders included), so the world is kept out one level up: `private_ray_dir` makes the home 0700."""
    inside = state_dir / "ray" / name
    if len(str(inside)) <= 40:
        return inside
    return Path(tempfile.gettempdir()) / f"opentinker-ray-{hashlib.sha256(str(state_dir).encode()).hexdigest()[:10]}" / name


def private_ray_dir(state_dir: Path, name: str) -> Path:
    """`ray_dir`, its home made a 0700 folder of ours first: created so, tightened if it is ours
    (an older stack left `<state>/ray` 0777), refused in one line if it is a link or another user's
    (in a shared /tmp someone may have made it first, to read our sockets or plant their own)."""
    folder = ray_dir(state_dir, name)
    home = folder.parent
    home.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(home, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(home)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"Ray's folder {home} is not a folder of uid {os.getuid()} (a link, or another user's): remove it")
    os.chmod(home, 0o700)
    return folder


def is_stand_in(folder: Path) -> bool:
    return folder.parent.parent == Path(tempfile.gettempdir()) and folder.parent.name.startswith("opentinker-ray-")


def remove_stand_in(folder: Path) -> None:
    """Remove a stopped node's stand-in folder, and its home once no other node's folder is left in it."""
    if is_stand_in(folder):
        shutil.rmtree(folder, ignore_errors=True)
        try:
            folder.parent.rmdir()
        except OSError:
            pass  # another node of this state dir still runs there


def ray_temp_dir(s: Settings) -> Path:
    return ray_dir(s.state_dir, "head")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that nothing listens on now (all held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ray_node_ports(head: bool = False) -> list[str]:
    """Ports of a node's helper servers (a head's dashboard too), chosen free now and distinct, in
    one `free_ports`: Ray's fixed defaults (8265, 52365, ...) would collide with a second node or
    stack on the same machine, and ports chosen one at a time can repeat (a stack once failed to
    start: "dashboard_agent_http is trying to use a port number 33583 that is used by other components")."""
    flags = (("--dashboard-port",) if head else ()) + (
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port")
    return [arg for flag, port in zip(flags, free_ports(len(flags))) for arg in (flag, str(port))]


# A node stopped by SIGTERM shuts down at once instead of draining for 30 s (it runs no Serve
# replicas to quiesce), and no inherited RAY_ADDRESS points it elsewhere.
RAY_NODE_ENV = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_ADDRESS": ""}


def _ray_head_command(s: Settings) -> list[str]:
    """`ray start --head --block`: the stack's long-lived cluster, sized for the jobs of all slots.
    Forgets the address a dead head recorded: `ray start` refuses to start where it finds a raylet
    (another node on this machine, still waiting for the dead head) that names it."""
    (private_ray_dir(s.state_dir, "head") / "ray_current_cluster").unlink(missing_ok=True)
    cpus = s.ray_num_cpus if s.ray_num_cpus is not None else (os.cpu_count() or 1) * max(1, s.cpu_slots)
    gpus = s.ray_num_gpus if s.ray_num_gpus is not None else (s.gpu_slots if s.gpu_slots is not None else detect_gpus())
    command = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--port", str(s.ray_port),
               "--ray-client-server-port", str(s.ray_client_port), "--num-cpus", str(cpus), "--num-gpus", str(gpus),
               "--object-store-memory", str(s.ray_object_store_mb * 1024**2), "--temp-dir", str(ray_temp_dir(s)),
               "--include-dashboard", "false", "--dashboard-host", "127.0.0.1", *ray_node_ports(head=True), "--disable-usage-stats"]
    if s.host not in ("127.0.0.1", "localhost"):
        command += ["--node-ip-address", socket.gethostbyname(s.host)]  # the address other nodes reach
    return command


def _ray_health_env(s: Settings) -> dict[str, str]:
    """The head's GCS checks each node every second, waiting up to 2 s for its answer, and gives it
    up after `ray_node_timeout_s` of failed checks (Ray's variables; unset: Ray's defaults)."""
    if s.ray_node_timeout_s is None:
        return {}
    return {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
            "RAY_health_check_failure_threshold": str(max(1, math.ceil(s.ray_node_timeout_s / 3)))}


def _ray_head_ready(s: Settings, pid: int) -> bool:
    """The GCS answers on its port and the head's node has started (its log says so)."""
    try:
        with socket.create_connection((s.host, s.ray_port), timeout=1.0):
            pass
    except OSError:
        return False
    log = (s.state_dir / "logs" / "ray.log").read_text(errors="replace") if pid else ""
    return not pid or "Ray runtime started" in log.rpartition("=== opentinker: starting ray")[2]


SANDBOX_HOST = "127.0.0.1"  # the sandbox service answers this machine only (and only its owner: the key)


def sandbox_key_file(s: Settings) -> Path:
    """The file holding the sandbox service's key, which its owner reads to call it (owner-only)."""
    return s.state_dir / "sandbox-key"


def sandbox_key(s: Settings) -> str:
    """The sandbox service's key: its file's, created once (mode 0600) as an HMAC of the stack secret,
    like the Ray token. Only the file is ever named (its command line, `opentinker status`), never the key."""
    path = sandbox_key_file(s)
    if not path.exists():
        key = hmac.new(s.stack_secret().encode(), b"sandbox-service-key", hashlib.sha256).hexdigest()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)  # the same key whoever writes it
    return path.read_text().strip()


def sandbox_url(s: Settings) -> str:
    return f"http://{SANDBOX_HOST}:{s.sandbox_port}"


def sandbox_endpoint(s: Settings) -> str:
    """The endpoint to give the sandbox_fusion client (`set_sandbox_endpoint`, SANDBOX_FUSION_ENDPOINT) as
    a shell word that reads the key from its file: printed, it shows no key."""
    return f"{sandbox_url(s)}/k/$(cat {shlex.quote(str(sandbox_key_file(s)))})"


def _sandbox_answers(s: Settings, pid: int) -> bool:
    """Ours answers /v1/ping with its key; with pid 0 (is anything there?) any HTTP answer counts."""
    if not pid:
        try:
            httpx.get(f"{sandbox_url(s)}/v1/ping", timeout=2.0, trust_env=False)
            return True
        except httpx.HTTPError:
            return False
    key = sandbox_key_file(s).read_text().strip() if sandbox_key_file(s).exists() else ""
    return http_ok(f"{sandbox_url(s)}/v1/ping", headers={"Authorization": f"Bearer {key}"}) is not None


def _sandbox_command(s: Settings) -> list[str]:
    """`opentinker sandbox` with the key's file (created here): a command line is public, so never the key."""
    sandbox_key(s)
    return [sys.executable, "-m", "opentinker.cli", "sandbox", "--host", SANDBOX_HOST, "--port", str(s.sandbox_port),
            "--key-file", str(sandbox_key_file(s))]


SPECS: dict[str, Service] = {
    "prefect": Service(
        name="prefect",
        keywords=("prefect", "server"),
        port=lambda s: s.prefect_port,
        url=lambda s: s.prefect_ui_url,
        command=lambda s: [sys.executable, "-m", "prefect", "server", "start",
                           "--host", s.listen_host, "--port", str(s.prefect_port)],
        env=_prefect_server_env,
        healthy=lambda s, pid: http_ok(f"{s.prefect_api_url}/health") is not None,
    ),
    "mlflow": Service(
        name="mlflow",
        keywords=("mlflow", "server"),
        port=lambda s: s.mlflow_port,
        url=lambda s: s.mlflow_url,
        command=_mlflow_command,
        env=lambda s: {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
                       "MLFLOW_BACKEND_STORE_URI": s.mlflow_backend_store_uri or f"sqlite:///{s.state_dir}/mlflow/mlflow.db"},
        healthy=lambda s, pid: http_ok(f"{s.mlflow_url}/health") is not None,
    ),
    "ray": Service(
        name="ray",
        keywords=("ray", "start", "--head"),
        port=lambda s: s.ray_port,
        url=lambda s: f"ray://{s.host}:{s.ray_client_port}",
        command=_ray_head_command,
        env=lambda s: {**worker_env(s), **RAY_NODE_ENV, **_ray_health_env(s)},  # its workers run jobs' actors: the same variables
        healthy=_ray_head_ready,
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
                           "--host", s.gateway_listen_host, "--port", str(s.gateway_port), "--log-level", "warning",
                           "--timeout-keep-alive", "75"],  # longer than clients keep idle connections
        # No Ray token: the public door never drives the cluster.
        env=lambda s: {**settings_env(s), **prefect_env(s), **mlflow_env(s)},
        healthy=lambda s, pid: http_ok(f"{s.gateway_url}/v1/health") is not None,
    ),
    "sandbox": Service(
        name="sandbox",
        keywords=("opentinker.cli", "sandbox", "--key-file"),
        port=lambda s: s.sandbox_port,
        url=sandbox_endpoint,
        command=_sandbox_command,
        env=lambda s: {},
        healthy=_sandbox_answers,
    ),
}
