"""The production backends: the stack's Prefect server and MLflow on a real PostgreSQL (Debian's
server binaries, started here on loopback in a temporary folder, as a non-root user), with MLflow's
artifacts on the local S3 server. A real job runs through that stack; its metrics, its registry
entry and its flow run are read back from the servers, and from the databases once the stack is
down (what a restart would find). SQLite stays the embedded default.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from opentinker.control.stack import Stack, StackError
from opentinker.core.settings import Settings, mlflow_env, prefect_env, settings_env
from tests.conftest import tiny_spec
from tests.stack_fixtures import free_ports, local_settings

PASSWORD = "pg-test-" + uuid.uuid4().hex[:8]


def _bindir() -> Path | None:
    """The folder of initdb and pg_ctl: pg_config's answer, else Debian's versioned folder."""
    try:
        found = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if (Path(found) / "initdb").exists():
            return Path(found)
    except (OSError, subprocess.CalledProcessError):
        pass
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    return Path(folders[-1]) if folders and (Path(folders[-1]) / "initdb").exists() else None


@dataclass(frozen=True)
class Postgres:
    port: int

    def url(self, database: str, driver: str = "postgresql") -> str:
        return f"{driver}://opentinker:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def query(self, database: str, sql: str) -> list[tuple]:
        import psycopg2

        with psycopg2.connect(self.url(database)) as conn, conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchall()


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on a free loopback port with databases `prefect` and `mlflow`, password
    authentication over TCP; as the `postgres` user when the tests run as root (initdb refuses root)."""
    bindir = _bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install -y postgresql")
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="opentinker-pg-"))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to run the server as")
        os.chown(folder, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    (port,) = free_ports(1)
    data, log, pwfile = folder / "data", folder / "server.log", folder / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if as_user:
        os.chown(pwfile, user.pw_uid, user.pw_gid)

    def run(*command: str) -> None:
        subprocess.run([*as_user, *command], check=True, capture_output=True, text=True, timeout=120)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "opentinker", "--pwfile", str(pwfile), "-E", "UTF8",
            "--auth-host=scram-sha-256", "--auth-local=peer")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "start",
            "-o", f"-h 127.0.0.1 -p {port} -k {folder}")
        server = Postgres(port)
        import psycopg2

        conn = psycopg2.connect(server.url("postgres"))
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE prefect")
            cur.execute("CREATE DATABASE mlflow")
        conn.close()
        yield server
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def _settings(tmp_path: Path, postgres: Postgres, storage: str) -> Settings:
    return local_settings(tmp_path / "state", cpu_slots=1, gpu_slots=0, storage_url=storage, game_allowlist="envs",
                          prefect_database_url=postgres.url("prefect", "postgresql+asyncpg"),
                          mlflow_backend_store_uri=postgres.url("mlflow"))


def test_a_database_that_does_not_answer_is_refused_before_anything_starts(tmp_path):
    (port,) = free_ports(1)
    settings = local_settings(tmp_path, prefect_database_url=f"postgresql+asyncpg://u:secret@127.0.0.1:{port}/prefect")
    with pytest.raises(StackError) as err:
        Stack(settings).up(timeout=30)
    assert str(err.value) == (f"OPENTINKER_PREFECT_DATABASE_URL postgresql+asyncpg://u:***@127.0.0.1:{port}/prefect: "
                              "no database answers there ([Errno 111] Connection refused)")
    assert not list((tmp_path / "pids").iterdir())


@pytest.mark.slow  # a whole stack on Postgres (110 s); every other stack test runs the same code on SQLite
def test_a_job_on_a_stack_with_prefect_and_mlflow_on_postgres_and_artifacts_on_s3(postgres, s3_server, s3_url, tmp_path):
    from mlflow.tracking import MlflowClient
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings = _settings(tmp_path, postgres, s3_url)
    stack = Stack(settings)
    saved = dict(os.environ)
    os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
    job_id, steps = f"pg-{uuid.uuid4().hex[:6]}", 2
    spec = tiny_spec(tmp_path, optimization={"steps": steps}, evaluation={"every": 2, "n_samples": 8},
                     checkpoint={"every": 2, "base_url": f"{s3_url}/jobs"})
    try:
        status = stack.up(timeout=240)
        assert all(s.healthy for s in status.values())
        # Not SQLite: no database files in the state folder; the passwords stay with the servers.
        assert not (settings.state_dir / "prefect" / "prefect.db").exists()
        assert not (settings.state_dir / "mlflow" / "mlflow.db").exists()
        import psutil

        assert "OPENTINKER_PREFECT_DATABASE_URL" not in psutil.Process(status["worker"].pid).environ()
        with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
            deploy(settings)
            run_id = submit_job(spec.model_dump(mode="json"), job_id, settings)
            final = follow(run_id, job_id, settings, lambda p: None, interval=1.0)
            assert final.state == "COMPLETED", final.message
            client = MlflowClient(tracking_uri=settings.mlflow_url)
            (run,) = client.search_runs([client.get_experiment_by_name(settings.project).experiment_id],
                                        filter_string=f"tags.`opentinker.job_id` = '{job_id}'")
            assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward_mean")] == [1, 2]
            name = run.data.tags["opentinker.registered_model"]
            version = client.get_model_version_by_alias(name, "champion")
            assert version.tags["job_id"] == job_id and version.tags["checkpoint_url"] == f"{s3_url}/jobs/{job_id}/step-00000002"
            assert "final" in [a.path for a in client.list_artifacts(run.info.run_id)]
            from opentinker.control.follow import latest_flow_run

            assert latest_flow_run(job_id).state.type.value == "COMPLETED"
    finally:
        stack.down()
        os.environ.clear()
        os.environ.update(saved)
    # The rows are in the databases, the adapter MLflow exported is in the bucket.
    assert postgres.query("prefect", f"SELECT count(*) FROM flow_run WHERE id = '{run_id}'") == [(1,)]
    assert postgres.query("mlflow", f"SELECT count(*) FROM model_versions WHERE name = '{name}'") == [(1,)]
    exported = [k for k in s3_server.objects(f"{s3_url}/mlflow") if f"/{run.info.run_id}/artifacts/final/" in k]
    assert exported, "the run's exported adapter is not in the bucket"
