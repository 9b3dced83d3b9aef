"""The embedded stack on real processes: up, reuse, clients through it, refusals, down.

The session stack starts once (tests/stack_fixtures.py); the last test stops it and starts it
again from the same state directory, so later test modules still find it running.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import psutil
import pytest

from opentinker.control.services import services_for
from opentinker.control.stack import Stack, StackError
from opentinker.core.settings import mlflow_env, prefect_env
from tests.stack_fixtures import free_ports, local_settings


def test_up_brings_all_services_healthy_on_loopback(stack):
    settings, status = stack
    assert set(status) == set(services_for(settings))  # the sandbox service where bubblewrap runs (test_stack_sandbox.py)
    for service in status.values():
        assert service.running and service.healthy and service.pid, service
        assert service.url.startswith(("http://127.0.0.1:", "ray://127.0.0.1:"))
    pids = settings.state_dir / "pids"
    assert {p.name for p in pids.iterdir()} == {f"{name}.pid" for name in services_for(settings)}
    assert (settings.state_dir / "prefect" / "prefect.db").exists()
    assert (settings.state_dir / "mlflow" / "mlflow.db").exists()
    # Flow runs inherit the worker's environment: it must point at this stack.
    worker_env = psutil.Process(status["worker"].pid).environ()
    assert worker_env["PREFECT_API_URL"] == settings.prefect_api_url
    assert worker_env["MLFLOW_TRACKING_URI"] == settings.mlflow_url
    assert worker_env["OPENTINKER_STATE_DIR"] == str(settings.state_dir)
    # ... and jobs join the stack's Ray head with its token, and nothing else.
    assert worker_env["OPENTINKER_RAY_ADDRESS"] == settings.ray_head_address
    assert worker_env["RAY_AUTH_MODE"] == "token" and worker_env["RAY_AUTH_TOKEN"] == settings.ray_auth_token()
    assert "OPENTINKER_PREFECT_DATABASE_URL" not in worker_env


def test_jobs_join_the_head_with_their_code_as_a_runtime_environment(stack_env):
    """A flow run joins the stack's head (no Ray start of its own) with the token, and ships the
    project's packages, so a node needs no checkout; without a head it starts a local Ray."""
    import ray

    from opentinker.orchestration.job import ray_connection

    settings, _ = stack_env
    address, kwargs = ray_connection()
    assert address == settings.ray_head_address
    modules = {Path(folder).name for folder in kwargs["runtime_env"]["py_modules"]}
    assert modules == {"opentinker", "envs", "flows", "tasks", "tests"}  # tests: the allowlisted test games
    assert kwargs["runtime_env"]["env_vars"]["OPENTINKER_SECRET"] == settings.stack_secret()
    assert "OPENTINKER_STATE_DIR" not in kwargs["runtime_env"]["env_vars"]
    ray.init(address=address, **{k: v for k, v in kwargs.items() if k != "runtime_env"})
    try:
        assert ray.cluster_resources()["CPU"] >= 2 and len(ray.nodes()) == 1
    finally:
        ray.shutdown()
    other = settings.model_copy(update={"state_dir": settings.state_dir / "elsewhere"})
    from opentinker.orchestration.job import cluster_address

    assert cluster_address(other) is None  # no head in that state folder: a local Ray per job


def test_second_up_reuses_running_services(stack):
    settings, status = stack
    started = time.monotonic()
    again = Stack(settings).up(timeout=30)
    assert time.monotonic() - started < 10
    assert {n: s.pid for n, s in again.items()} == {n: s.pid for n, s in status.items()}
    assert all(s.healthy for s in again.values())


def test_mlflow_client_logs_and_reads_back_through_server(stack):
    from mlflow.tracking import MlflowClient

    settings, _ = stack
    assert mlflow_env(settings) == {"MLFLOW_TRACKING_URI": settings.mlflow_url, "MLFLOW_DISABLE_TELEMETRY": "true"}
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    experiment_id = client.create_experiment(f"{settings.project}/stack-test")
    run = client.create_run(experiment_id)
    for step, value in enumerate([0.5, 0.25, 0.125]):
        client.log_metric(run.info.run_id, "loss", value, step=step)
    client.log_text(run.info.run_id, "hello", "notes/hello.txt")
    client.set_terminated(run.info.run_id)

    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 0.25), (2, 0.125)]
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    # Artifacts go through the server's proxy into the state directory, not ./mlruns.
    stored = list((settings.state_dir / "mlflow" / "artifacts").rglob("hello.txt"))
    assert len(stored) == 1 and stored[0].read_text() == "hello"


def test_prefect_client_sees_pool_and_polling_worker(stack):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    settings, _ = stack
    assert prefect_env(settings)["PREFECT_API_URL"] == settings.prefect_api_url
    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        with get_client(sync_client=True) as client:
            assert client.read_work_pool(settings.work_pool).type == "process"
            deadline = time.monotonic() + 30  # up() waited for a heartbeat already
            while True:
                workers = client.read_workers_for_work_pool(settings.work_pool)
                online = [w.name for w in workers if w.status.value == "ONLINE"]
                if online or time.monotonic() > deadline:
                    break
                time.sleep(1)
    assert online == [f"opentinker-{settings.work_pool}"]


@pytest.mark.parametrize("service", ["prefect", "mlflow"])
def test_port_held_by_another_program_is_refused_before_starting(tmp_path, service):
    held, other = free_ports(2)
    ports = {"prefect_port": held, "mlflow_port": other} if service == "prefect" else {
        "prefect_port": other, "mlflow_port": held}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", held))
        listener.listen()
        with pytest.raises(StackError) as error:
            Stack(local_settings(tmp_path, **ports)).up(timeout=30)
    message = str(error.value)
    assert f"{service} port {held} on 127.0.0.1 is in use" in message
    assert f"OPENTINKER_{service.upper()}_PORT" in message and "\n" not in message
    assert not list((tmp_path / "pids").iterdir())  # nothing was started


@pytest.mark.parametrize("ports, line", [
    ({"ray_client_port": 12000}, "OPENTINKER_RAY_CLIENT_PORT=12000 is inside Ray's worker port range 10002-19999: choose a port outside it"),
    ({"prefect_port": 19999}, "OPENTINKER_PREFECT_PORT=19999 is inside Ray's worker port range 10002-19999: choose a port outside it"),
    ({"mlflow_port": 5555, "gateway_port": 5555}, "OPENTINKER_GATEWAY_PORT=5555 is also OPENTINKER_MLFLOW_PORT: each service needs a port of its own"),
])
def test_ports_in_rays_worker_range_or_shared_are_refused_at_once(tmp_path, ports, line):
    """A port of the stack inside Ray's worker port range (a Ray worker may take it first; `ray start`
    refused a client port there only after 42 s, with its traceback) or one that two services share is
    refused in one line naming the setting, before anything starts."""
    started = time.monotonic()
    with pytest.raises(StackError) as error:
        Stack(local_settings(tmp_path, **ports)).up(timeout=30)
    assert str(error.value) == line
    assert time.monotonic() - started < 2
    assert not (tmp_path / "pids").exists() or not list((tmp_path / "pids").iterdir())  # nothing was started


def test_a_ray_heads_helper_ports_are_distinct_even_where_the_os_hands_a_freed_port_out_again(tmp_path, monkeypatch):
    """The OS may give the port a closed socket just freed to the next bind (a stack failed to start:
    its dashboard and dashboard agent were both given 33583): a socket here gets port 40000 unless
    that is held open, then the next free one. Every port of the head's command must differ."""
    import socket as real_socket

    from opentinker.control import services

    held: set[int] = set()

    class LowestFree:
        def bind(self, address):
            self.port = min(set(range(40000, 40100)) - held)
            held.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            held.discard(self.port)

    monkeypatch.setattr(services, "socket", type("socket_module", (), {"socket": LowestFree, "gethostbyname": real_socket.gethostbyname}))
    command = services._ray_head_command(local_settings(tmp_path))
    ports = [command[i + 1] for i, arg in enumerate(command) if arg.endswith("-port") and arg not in ("--port", "--ray-client-server-port")]
    assert len(ports) == 5 and len(set(ports)) == 5, command


def test_our_server_from_another_state_dir_is_not_adopted(stack, tmp_path):
    settings, _ = stack
    other = local_settings(tmp_path, prefect_port=settings.prefect_port)
    with pytest.raises(StackError, match=f"prefect port {settings.prefect_port}"):
        Stack(other).up(timeout=30)


def test_unbindable_host_is_one_clear_line(tmp_path):
    with pytest.raises(StackError, match=r"^cannot bind 192\.0\.2\.1:\d+: .*OPENTINKER_HOST$"):
        Stack(local_settings(tmp_path, host="192.0.2.1")).up(timeout=10)


def test_service_that_dies_at_start_up_is_named_with_its_log(tmp_path):
    (tmp_path / "prefect").mkdir()
    (tmp_path / "prefect" / "prefect.db").write_bytes(b"not a database" * 100)
    services = Stack(local_settings(tmp_path))
    with pytest.raises(StackError) as error:
        services.up(timeout=90)
    message = str(error.value)
    assert message.startswith(f"prefect exited during start-up; last lines of {tmp_path}")
    assert "not a database" in message
    # The MLflow server this call had started is stopped again.
    assert not any(s.running for s in services.status().values())
    assert not list((tmp_path / "pids").iterdir())


def test_down_stops_everything_then_up_restarts_from_same_state(stack):
    settings, status = stack
    services = Stack(settings)
    services.down()
    after = services.status()
    assert not any(s.running or s.healthy for s in after.values())
    assert not list((settings.state_dir / "pids").iterdir())
    for old in status.values():
        assert not psutil.pid_exists(old.pid), old
    services.down()  # idempotent

    # Leave the session stack running for later modules (existing databases this time).
    restarted = services.up(timeout=180)
    assert all(s.healthy for s in restarted.values())
    status.update(restarted)  # the fixture's status now names the new processes
