"""A session-wide embedded stack (Prefect server + worker, MLflow server, Ray head, gateway, sandbox) for tests.

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


PORTS = ("prefect_port", "mlflow_port", "gateway_port", "ray_port", "ray_client_port", "sandbox_port")


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
        stop_leftover_runs()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def stop_leftover_runs(timeout: float = 120.0) -> None:
    """Cancel every flow run a module left unfinished (a failed test's job or inference server)
    and wait for the pools' slots to be free, so that one module's failure does not fill the
    slots of the next one's (CI once lost three more tests to one inference server left serving)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Cancelling

    from opentinker.control.scheduler import POOLS, slot_limit
    from opentinker.core.polling import wait_for

    pool_slots = {slot_limit(pool) for pool in POOLS}  # not the Tinker seats: sessions hold those, not runs
    open_states = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=open_states))))
        for run in runs:
            running = run.state is not None and run.state.type == StateType.RUNNING
            client.set_flow_run_state(run.id, Cancelling() if running else Cancelled(message="left over by a test module"), force=True)

        def slots_free() -> bool | None:
            held = [limit.name for limit in client.read_global_concurrency_limits(limit=200)
                    if limit.name in pool_slots and limit.active_slots > 0]
            return (not held) or None

        if runs:
            print(f"\nstack: cancelled {len(runs)} run(s) a test module left unfinished: {[r.name for r in runs]}")
        try:
            wait_for(slots_free, interval=1, timeout=timeout, what="the pools' slots free after the module")
        except TimeoutError as err:
            print(f"stack: {err}")


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


def deployed_tenants(settings, *names: str) -> list[str]:
    """The stack's deployments registered, and a key for each tenant named (made anew: rotated)."""
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    deploy(settings)
    store = TenantStore(settings.state_dir / "tenants.json")
    return [store.create(name, rotate=True) for name in names]
