"""A session-wide embedded stack (Prefect server + worker, MLflow server, Ray head, gateway) for tests.

Started once per test session (cold start ≈30 s on the 2-core machine, most of it the Prefect
server creating its database), on free loopback ports and in a temporary state directory, so it
never collides with a developer's own stack on the default ports. conftest.py registers this
module as a plugin, so every test module shares the one stack.
"""

from __future__ import annotations


import pytest



def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports (the service's own helper, imported when called: a bare GPU
    Python imports this module without the service's dependencies)."""
    from opentinker.control.services import free_ports as ports

    return ports(count, host)


PORTS = ("prefect_port", "mlflow_port", "gateway_port", "ray_port", "ray_client_port")


def local_settings(state_dir, **overrides) -> "Settings":  # noqa: F821
    """Settings of a stack in `state_dir` whose every port is a free one (unless overridden): a
    test never depends on a default port being free (a developer's `make demo` stack holds them)."""
    from opentinker.core.settings import Settings  # here, not above: `pytest -m gpu` runs without the service's packages

    return Settings(**{"state_dir": state_dir, **dict(zip(PORTS, free_ports(len(PORTS)))), **overrides})


@pytest.fixture(scope="session")
def stack(tmp_path_factory, s3_server):
    """Yields `(settings, status)` of a running, healthy stack; stops it at the end. Started (and
    restarted by any test) with the local S3 server's variables set, as `opentinker up` would be
    with real ones: jobs that the worker runs can use s3:// storage."""
    settings = local_settings(
        tmp_path_factory.mktemp("opentinker-state"),
        host="127.0.0.1",
        work_pool="cpu",
        cpu_slots=2,
        gpu_slots=0,
        ray_address=None,
        game_allowlist="envs,tests.games",  # the operator ships the test games too: faulty ones among them
        tinker_worker_idle_s=5,  # an idle base-model worker exits within a test
    )
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # flows the worker runs import the test games from here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    from opentinker.control.stack import Stack

    services = Stack(settings)
    try:
        status = services.up(timeout=180)
        yield settings, status
    finally:
        services.down()


@pytest.fixture(scope="module")
def stack_env(stack):
    """Point this process (Prefect client, MLflow client, flow settings) at the test stack."""
    import os

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.core.settings import mlflow_env, prefect_env, settings_env

    settings, _ = stack
    env = settings_env(settings) | prefect_env(settings) | mlflow_env(settings)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        yield settings, env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def restart_gateway(settings, down_s: float = 0.0) -> None:
    """SIGKILL the stack's gateway, leave it down `down_s` seconds, start it again (healthy on return)."""
    import os
    import signal
    import time

    from opentinker.control.stack import Stack

    stack = Stack(settings)
    os.kill(stack.pid("gateway"), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while stack.pid("gateway") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(down_s)
    stack.start("gateway")
