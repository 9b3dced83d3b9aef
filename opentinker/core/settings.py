"""Where the embedded local stack lives and how clients reach it.

Every field can be set from the environment with the `OPENTINKER_` prefix
(`OPENTINKER_STATE_DIR`, `OPENTINKER_PREFECT_PORT`, ...), so the CLI, the flows the worker runs
and the tests all agree on one place and one set of ports without passing arguments around.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration of the one-machine stack (Prefect server + worker, MLflow server)."""

    model_config = SettingsConfigDict(env_prefix="OPENTINKER_", extra="ignore")

    state_dir: Path = Path("~/.opentinker")
    """Everything the stack writes: pid files, logs, the SQLite databases, MLflow artifacts, the
    secret. One place per user whatever the working directory, so every command finds the same
    stack; OPENTINKER_STATE_DIR moves it."""

    host: str = "127.0.0.1"
    """Interface every service binds to and clients dial; loopback keeps the stack private."""

    prefect_port: int = 4200
    """Port of the Prefect API and UI (Prefect's own default)."""

    mlflow_port: int = 5000
    """Port of the MLflow tracking server (MLflow's own default)."""

    ray_address: str | None = None
    """None: each flow starts a local Ray; "auto" or "ray://host:port": join that cluster."""

    work_pool: str = "cpu"
    """Work pool the embedded worker polls: `cpu`, or `gpu` on a GPU machine (see scheduler.py)."""

    gpu_slots: int | None = Field(None, ge=0)
    """Slots of the `gpu` pool (one per GPU); None: count the GPUs with nvidia-smi."""

    cpu_slots: int = Field(2, ge=0)
    """Slots of the `cpu` pool: CPU jobs that may run at once."""

    storage_url: str | None = None
    """fsspec URL under which the gateway places tenants' checkpoints
    (`<storage_url>/tenants/<tenant>/<job_id>`); None: `file://<state_dir>/storage`."""

    artifacts_url: str | None = None
    """Where the stack's MLflow server stores artifacts (`--artifacts-destination`; clients upload
    through the server, so only it needs S3 credentials). None: `<storage_url>/mlflow` when
    storage_url is remote (s3://…), else the local folder `<state_dir>/mlflow/artifacts`."""

    gateway_port: int = 8200
    """Port of the authenticated job gateway (the URL clients use)."""

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
    """Inference servers generate at most this many tokens per completion (also the default
    when a request gives no max_tokens)."""

    tenant_max_queued: int = Field(20, ge=0)
    """Jobs a tenant may have waiting at once; one more is refused (429)."""

    tenant_max_running: int = Field(4, ge=0)
    """Jobs of one tenant that run at once; the others wait in the queue."""

    game_allowlist: str = "envs"
    """Comma-separated module prefixes whose games workers import (`env.game`); anything else is
    refused before it is imported. Tenants' own games run in their process (the client link)."""

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().resolve()

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
        return f"http://{self.host}:{self.gateway_port}"

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


def get_settings(**overrides) -> Settings:
    """A fresh Settings read from the environment now (never cached: tests change it)."""
    return Settings(**overrides)


# --- the settings as environment variables, for services and clients ---------------------------


def prefect_env(settings: Settings) -> dict[str, str]:
    """Variables that point a Prefect client (CLI, flow, worker) at this stack's server."""
    env = {
        "PREFECT_API_URL": settings.prefect_api_url,
        "PREFECT_HOME": str(settings.state_dir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    if settings.prefect_api_url.startswith("http://"):
        env["PREFECT_API_SSL_CERT_FILE"] = str(plain_http_ca_file(settings))
    return env


def plain_http_ca_file(settings: Settings) -> Path:
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
