"""Where the embedded local stack lives and how clients reach it.

Every field can be set from the environment with the `OPENTINKER_` prefix
(`OPENTINKER_STATE_DIR`, `OPENTINKER_PREFECT_PORT`, ...), so the CLI, the flows the worker runs
and the tests all agree on one place and one set of ports without passing arguments around.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from opentinker.core.env_hosts import EnvHosts


class Settings(BaseSettings):
    """Configuration of the one-machine stack (Prefect server + worker, MLflow server)."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="ignore")

    state_dir: Path = Path("~/.opentinker")
    """Everything the stack writes (pid files, logs, databases, artifacts, secrets), one place per user
    whatever the working directory, so every command finds the same stack; OPENTINKER_STATE_DIR moves it."""

    host: str = "127.0.0.1"
    """The control machine's address as every client dials it (CLI, workers, jobs): Prefect, MLflow,
    the gateway and the Ray head are reached at host:<port>. Loopback keeps the stack private."""

    bind_host: str | None = None
    """Interface the servers of this machine listen on: the private services (Prefect, MLflow, the
    Ray head) and the servers a job starts (inference). None: `host`. On a machine others join, an
    address of the private network (or 0.0.0.0 behind a firewall), never a public one."""

    advertised_host: str | None = None
    """The address other machines dial for a server this machine starts (an inference job on a GPU
    worker). None: `bind_host` unless that is a wildcard, then this machine's address toward `host`."""

    gateway_bind_host: str | None = None
    """Interface the gateway, the one public door, listens on (e.g. 0.0.0.0). None: the private services' one."""

    gateway_public_url: str | None = None
    """The gateway as tenants reach it (jobs' `server_url`), e.g. behind TLS. None: http://host:gateway_port."""

    prefect_port: int = 4200
    """Port of the Prefect API and UI (Prefect's own default)."""

    mlflow_port: int = 5000
    """Port of the MLflow tracking server (MLflow's own default)."""

    ray_address: str | None = None
    """A Ray cluster every job joins ("host:port", "ray://host:port" or "auto"). None: the stack's
    own head when it runs (`ray_head`), else each flow starts a local Ray of its own."""

    ray_head: bool = True
    """`opentinker up` starts a Ray head with the stack and jobs join it: no Ray start per job."""

    ray_port: int = 6379
    """Port of the head's GCS, the address other nodes join (`opentinker worker --join host:port`)."""

    ray_client_port: int = 10001
    """Port of the head's Ray Client server (`ray://host:port`, for drivers that are not nodes). Like
    every port of the stack, outside Ray's worker ports 10002-19999 and no other's (`up` checks)."""

    ray_num_cpus: int | None = Field(None, ge=0)
    """Logical CPUs the head offers jobs (a reservation, not threads). None: this machine's cores
    times the CPU slots, as much as the per-job Ray of every running job had together."""

    ray_num_gpus: int | None = Field(None, ge=0)
    """GPUs the head declares. None: `gpu_slots`, else what nvidia-smi counts here."""

    ray_object_store_mb: int = Field(1024, gt=0)
    """Shared-memory object store of the head, in MiB (trajectories pass through it)."""

    ray_node_timeout_s: float | None = Field(None, ge=5)
    """Seconds a node may not answer the head's health checks before it and its jobs are given up. None: Ray's (about a minute)."""

    prefect_database_url: str | None = None
    """Database of the Prefect server, e.g. postgresql+asyncpg://user:pass@db:5432/prefect.
    None: SQLite in the state folder. Given only to the server, never to jobs."""

    mlflow_backend_store_uri: str | None = None
    """Backend store of the MLflow server, e.g. postgresql://user:pass@db:5432/mlflow.
    None: SQLite in the state folder. Given only to the server, never to jobs."""

    work_pool: str = "cpu"
    """Work pool the embedded worker polls: `cpu`, or `gpu` on a GPU machine (see scheduler.py)."""

    gpu_slots: int | None = Field(None, ge=0)
    """Slots of the `gpu` pool (one per GPU); None: count the GPUs with nvidia-smi."""

    cpu_slots: int = Field(2, ge=0)
    """Slots of the `cpu` pool: CPU jobs that may run at once."""

    run_heartbeat_s: int = Field(30, ge=30)
    """Every job's flow run tells Prefect it is alive this often (Prefect's flow heartbeats; 30 s is
    its least). See `lost_run_after_s`."""

    lost_run_after_s: float = Field(150.0, gt=0)
    """A run that sent no heartbeat for this long, and did not end, is marked Crashed by a Prefect
    automation (its process died with its worker or machine: `down`, kill -9, a lost host), which frees
    its place in the pool; its job reads FAILED with the line to resume. Keep it a few heartbeats long."""

    storage_url: str | None = None
    """fsspec URL under which the gateway places tenants' checkpoints
    (`<storage_url>/tenants/<tenant>/<job_id>`); None: `file://<state_dir>/storage`."""

    artifacts_url: str | None = None
    """Where the stack's MLflow server stores artifacts (`--artifacts-destination`; clients upload
    through the server, so only it needs S3 credentials). None: `<storage_url>/mlflow` when
    storage_url is remote (s3://…), else the local folder `<state_dir>/mlflow/artifacts`."""

    gateway_port: int = 8200
    """Port of the authenticated job gateway (the URL clients use)."""

    sandbox_port: int = 8310
    """Port of the stack's sandbox service on 127.0.0.1 (SandboxFusion's /run_code; key: <state_dir>/sandbox-key)."""

    project: str = "default"
    """Prefix of MLflow experiment names, so several projects can share one server."""

    secret: str | None = None
    """Signs job tokens (opentinker.core.tokens); None: the file <state_dir>/secret, created
    (owner-only) on first use. Every machine of one stack needs the same one."""

    model_dir: Path | None = None
    """The operator's folder of local models: a tenant's `model.name` that is not a known name must
    be a folder in here. None: <state_dir>/models."""

    max_request_bytes: int = Field(16 * 1024**2, gt=0)
    """Largest request body the gateway, inference and environment servers accept (413 beyond)."""

    max_tokens_cap: int = Field(2048, gt=0)
    """Most tokens an inference server generates a completion (the default when a request gives no max_tokens)."""

    tenant_max_queued: int = Field(20, ge=0)
    """Jobs a tenant may have waiting at once; one more is refused (429)."""

    tenant_max_running: int = Field(4, ge=0)
    """Jobs of one tenant that run at once; the others wait in the queue."""

    tinker_max_sessions: int = Field(4, ge=0)
    """Live Tinker API sessions a tenant may hold at once (each is a job holding a slot); one more is refused."""

    tinker_session_gpus: float = Field(0.0, ge=0)
    """GPUs each Tinker API session holds (0: the CPU pool); its model sits on them in a Ray actor."""

    tinker_shared_bases: bool = True
    """Tinker sessions live on one base-model worker per pool, their LoRA training clients sharing one copy of
    each base (passes in turn between tenants; on a GPU batched across adapters); false: each session its own actor and base."""

    tinker_worker_seats: int = Field(8, ge=1)
    """Sessions one base-model worker hosts at once: each holds a seat (Prefect limit `slots-<pool>-seats`)."""

    tinker_worker_memory_gb: float | None = Field(None, gt=0)
    """What a base-model worker's bases and adapters (weights, gradients, AdamW moments) may fill;
    a training client that would not fit is refused with the numbers. None: the GPU's memory, or
    half of this machine's RAM on the CPU pool."""

    tinker_sampling_engine: Literal["auto", "hf", "vllm"] = "auto"
    """Tinker samplers' engine: `vllm` (a server per base, its multi-LoRA), `hf`, or `auto`: vLLM on
    a GPU where installed, HF on a CPU (vLLM made 0.47-0.65x its tokens/s; docs/tinker.md)."""

    tinker_worker_idle_s: float = Field(300.0, gt=0)
    """A base-model worker with no session for this long exits (the next session starts a new one)."""

    tinker_max_call_tokens: int = Field(1_048_576, ge=1)
    """The most tokens (model inputs, all datums and chunks together) of one Tinker forward or
    forward_backward call; a larger call fails at once with the numbers and nothing of it runs."""

    tinker_heartbeat_timeout_s: float = Field(120.0, gt=0)
    """A Tinker session whose client sent nothing (heartbeats included: the SDK sends one every 10 s)
    for this long ends, and frees its slot."""

    tinker_absent_after_s: float = Field(30.0, gt=0)
    """A session whose client has sent nothing for this long (three of the SDK's 10 s heartbeats
    missed: its process exited without close(), or was killed) gives its seat to a new session of
    its tenant at the limit at once, ending Expired; without such a request it lives until
    `tinker_heartbeat_timeout_s`. A live client, idle or not, heartbeats and keeps its session."""

    game_allowlist: str = "envs"
    """Comma-separated module prefixes whose games workers import (`env.game`); anything else is
    refused before it is imported. Tenants' own games run in their process (the client link)."""

    env_url_allow: str = "127.0.0.0/8,::1"
    """Comma-separated addresses environment servers (`env.url`) may be reached at: IP addresses,
    networks (CIDR, IPv4 or IPv6), host names (exact, any case), `*.domain` (any name under domain)
    or `*` (anywhere). A host not named must resolve only to allowed addresses. The gateway checks
    it before submission and the worker again before its first request, so no spec sends our
    workers into the operator's network (cloud metadata, internal services). Default: loopback only."""

    env_max_response_bytes: int = Field(4 * 1024**2, gt=0)
    """The most bytes a job reads of one answer of an environment: one HTTP response of an environment
    server (`env.url`, also `/generate_task`), one OpenEnv message, one answer of a client link's game as
    the gateway relays it. It is counted as the answer streams in, before anything is decoded, and within
    `env.timeout_s`: past it the connection closes and that episode fails in one line with the numbers (the
    job goes on). Images count as base64 PNG; a game whose observations are larger (several big images) needs more."""

    vllm_python: str | None = None
    """The Python of vLLM's own environment (it pins a fastapi Prefect cannot share); default:
    `.venv-vllm/bin/python` beside this one (`make install`), else /opt/vllm/bin/python (GPU image)."""

    cpu_auto_dtype: Literal["float32", "bfloat16"] | None = None
    """`model.dtype: auto` on a CPU, in every process of the stack (None: bf16 with AMX or AVX-512 BF16; backend/device.py)."""

    vllm_cpu_kv_cache_gib: int = Field(2, ge=1)
    """On a CPU, the memory (GiB) a vLLM server keeps for its key/value cache (VLLM_CPU_KVCACHE_SPACE;
    vLLM's own default asks for nearly all of the machine's memory and refuses)."""

    @field_validator("env_url_allow")
    @classmethod
    def _env_hosts_parse(cls, value: str) -> str:
        EnvHosts.parse(value)  # a malformed entry fails here, when the settings load, not at the first job
        return value

    @cached_property
    def env_hosts(self) -> EnvHosts:
        """`env_url_allow`, parsed, with this stack's own servers, which no env.url reaches (see opentinker.core.env_hosts)."""
        return EnvHosts.of(self)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @property
    def listen_host(self) -> str:
        """What the private services and the servers jobs start bind (see bind_host)."""
        return self.bind_host or self.host

    @property
    def gateway_listen_host(self) -> str:
        return self.gateway_bind_host or self.listen_host

    @property
    def dial_host(self) -> str:
        """What other machines dial for a server bound here (see advertised_host)."""
        if self.advertised_host:
            return self.advertised_host
        if self.listen_host not in WILDCARDS:
            return self.listen_host
        return address_toward(self.host)

    def advertised_url(self, url: str) -> str:
        """`url` of a server bound here, with the host others dial (port and path kept)."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        host = f"[{self.dial_host}]" if ":" in self.dial_host else self.dial_host
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))

    @property
    def ray_head_address(self) -> str:
        """The stack's Ray head as nodes and drivers join it (GCS host:port)."""
        return f"{self.host}:{self.ray_port}"

    def ray_auth_token(self) -> str:
        """The token every Ray process of this stack shows (RAY_AUTH_MODE=token): RAY_AUTH_TOKEN when
        set, else derived from the stack secret, so every machine holding the secret agrees."""
        import hashlib
        import hmac
        import os

        given = os.environ.get("RAY_AUTH_TOKEN")
        if given:
            return given
        return hmac.new(self.stack_secret().encode(), b"ray-auth-token", hashlib.sha256).hexdigest()

    @property
    def storage_is_local(self) -> bool:
        """Job storage on this machine's disk (file://), which another machine cannot see."""
        return self.storage_url.startswith(("file://", "local://")) or "://" not in self.storage_url

    @property
    def prefect_ui_url(self) -> str:
        return f"http://{self.host}:{self.prefect_port}"

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect_ui_url}/api"

    @model_validator(mode="after")
    def _default_storage(self) -> "Settings":
        if self.storage_url is None:
            self.storage_url = f"file://{self.state_dir / 'storage'}"
        return self

    @model_validator(mode="after")
    def _lost_after_heartbeats(self) -> "Settings":
        if self.lost_run_after_s < 3 * self.run_heartbeat_s:
            raise ValueError(f"lost_run_after_s ({self.lost_run_after_s:g}) must be at least three heartbeats "
                             f"(3 x run_heartbeat_s = {3 * self.run_heartbeat_s}): a live run would read as lost")
        return self

    def stack_secret(self) -> str:
        """The secret that signs job tokens (see `secret`)."""
        if self.secret:
            return self.secret
        import os
        import secrets

        path = self.state_dir / "secret"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(48))
            os.replace(tmp, path) if not path.exists() else tmp.unlink()
        return path.read_text().strip()

    @property
    def models_folder(self) -> Path:
        return (self.model_dir or self.state_dir / "models").expanduser().resolve()

    @property
    def allowed_games(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.game_allowlist.split(",") if p.strip())

    @property
    def gateway_url(self) -> str:
        """The gateway on the private side (what jobs dial for the client link)."""
        return f"http://{self.host}:{self.gateway_port}"

    @property
    def public_gateway_url(self) -> str:
        """The gateway as tenants reach it (see gateway_public_url)."""
        return (self.gateway_public_url or self.gateway_url).rstrip("/")

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    @property
    def mlflow_artifacts_destination(self) -> str:
        """`artifacts_url`, else follows a remote `storage_url`, else the local default (see artifacts_url)."""
        if self.artifacts_url:
            return self.artifacts_url.rstrip("/")
        if self.storage_url.split("://", 1)[0] not in ("file", "local", self.storage_url):
            return f"{self.storage_url.rstrip('/')}/mlflow"
        return str(self.state_dir / "mlflow" / "artifacts")


WILDCARDS = ("0.0.0.0", "::", "")


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP socket only picks
    its source address), the way Ray picks a node's address; the hostname if there is no route."""
    import socket

    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((target, 9))
            return sock.getsockname()[0]
    except OSError:
        return socket.getfqdn()


def get_settings(**overrides) -> Settings:
    """A fresh Settings read from the environment now (never cached: tests change it)."""
    return Settings(**overrides)


# --- the settings as environment variables, for services and clients ---------------------------


def prefect_env(settings: Settings) -> dict[str, str]:
    """Variables that point a Prefect client (CLI, flow, worker) at this stack's server."""
    env = {
        "PREFECT_API_URL": settings.prefect_api_url,
        "PREFECT_HOME": str(settings.state_dir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_EXTRA_LOGGERS": "opentinker",  # a flow's own warnings in its log
    }
    if settings.prefect_api_url.startswith("http://"):
        env["PREFECT_API_SSL_CERT_FILE"] = str(plain_http_ca_file(settings))
    return env


def plain_http_ca_file(settings: Settings) -> Path:
    """A one-certificate CA file for clients of a plain-http API: every Prefect client builds a TLS
    context from its CA file even for http:// URLs, ≈60 ms each with certifi's bundle (≈120 of a Ray
    task's ≈185 ms start-up, measured). Only set for http:// APIs: a real TLS connection keeps its CA."""
    import certifi

    path = settings.state_dir / "prefect" / "plain-http-ca.pem"
    if not path.exists():
        bundle = Path(certifi.where()).read_text()
        end = "-----END CERTIFICATE-----"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(bundle[: bundle.index(end) + len(end)] + "\n")
    return path


def mlflow_env(settings: Settings) -> dict[str, str]:
    """Variables that point an MLflow client at this stack's tracking server. Telemetry off: it sends
    data off the machine, and its thread sets and unsets an environment variable that another
    thread's request read mid-change (a job failed with KeyError '_MLFLOW_TELEMETRY_SESSION_ID')."""
    return {"MLFLOW_TRACKING_URI": settings.mlflow_url, "MLFLOW_DISABLE_TELEMETRY": "true"}


SERVER_ONLY = ("prefect_database_url", "mlflow_backend_store_uri")


def settings_env(settings: Settings) -> dict[str, str]:
    """`settings` as OPENTINKER_* variables, so a process started with them reads the same; the
    database URLs (with their passwords) stay with the servers that use them."""
    return {f"OPENTINKER_{name.upper()}": str(value)
            for name, value in settings.model_dump(exclude=set(SERVER_ONLY)).items() if value is not None}


def ray_env(settings: Settings) -> dict[str, str]:
    """Variables of every Ray process of the stack (head, nodes, drivers): token authentication
    with the stack's token, and no usage reports."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": settings.ray_auth_token(), "RAY_USAGE_STATS_ENABLED": "0"}
