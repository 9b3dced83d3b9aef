"""A session-wide embedded stack (Prefect server + worker, MLflow server) for tests.

Started once per test session (cold start ≈30 s on the 2-core machine, most of it the Prefect
server creating its database), on free loopback ports and in a temporary state directory, so it
never collides with a developer's own stack on the default ports. Use it from a test module with
`from tests.stack_fixtures import stack  # noqa: F401`, or import it in conftest.py.
"""

from __future__ import annotations

import socket

import pytest

from opentinker.settings import Settings
from opentinker.stack import Stack


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


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """Yields `(settings, status)` of a running, healthy stack; stops it at the end."""
    prefect_port, mlflow_port = free_ports(2)
    settings = Settings(
        state_dir=tmp_path_factory.mktemp("opentinker-state"),
        host="127.0.0.1",
        prefect_port=prefect_port,
        mlflow_port=mlflow_port,
        work_pool="local",
        ray_address=None,
    )
    services = Stack(settings)
    try:
        status = services.up(timeout=180)
        yield settings, status
    finally:
        services.down()
