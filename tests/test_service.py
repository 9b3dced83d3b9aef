"""The service end to end on a real stack: gateway, tenants, client SDK, pools and slots.

Jobs run as deployment runs on the stack's process worker (a subprocess per job, tiny model),
so these tests exercise the scheduler exactly as users meet it.
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import tiny_spec


@pytest.fixture(scope="module")
def service(stack_env):
    """The stack with deployments registered and two tenants; yields (settings, key_a, key_b)."""
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, _ = stack_env
    deploy(settings)
    store = TenantStore(settings.state_dir / "tenants.json")
    yield settings, store.create("acme", rotate=True), store.create("globex", rotate=True)


def _args(tmp_path, steps=2, with_env=False, **overrides):
    data = tiny_spec(tmp_path, optimization={"steps": steps}, evaluation={"every": 0, "n_samples": 8},
                     checkpoint={"every": 1}, **overrides).model_dump(mode="json")
    if not with_env:
        data.pop("env")
    return data


def _slots(settings) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name("slots-cpu").active_slots


def test_reference_client_code_trains_a_job(service, tmp_path):
    """The project page's training workflow, essentially as written."""
    from envs.toy import UppercaseGame
    from opentinker.client import SchedulerClient, ServiceClient
    from opentinker.environment.base_game import AbstractGame  # noqa: F401 - the reference import path
    from opentinker.env import GameEnvironment

    settings, key, _ = service
    args = _args(tmp_path, steps=2)
    server_url = settings.gateway_url

    scheduler = SchedulerClient(url=server_url, api_key=key)
    job_result = scheduler.submit_job(config=args, num_gpus=0)
    job_id, server_url = job_result["job_id"], job_result["server_url"]
    assert job_id.startswith("acme-") and job_result["state"] == "QUEUED"

    env = GameEnvironment(game_class=UppercaseGame, config={"val_size": 16}, job_id=job_id)
    client = ServiceClient(server_url=server_url, api_key=key)
    client.set_config(args, env)
    final = client.fit(env=env, num_steps=2, poll=1.0, progress=False)

    assert final["state"] == "COMPLETED" and final["step"] == 2
    assert "rollout/reward_mean" in final["metrics"] and "eval/accuracy" in final["metrics"]
    assert final["checkpoint"].startswith(f"{settings.storage_url}/tenants/acme/{job_id}/")
    history = scheduler.metrics(job_id)["rollout/reward_mean"]
    assert [step for step, _ in history] == [1, 2]
    assert _slots(settings) == 0  # released at completion


def test_tenants_cannot_touch_each_others_jobs(service, tmp_path):
    from opentinker.client import AuthenticationError, JobNotFound, SchedulerClient

    settings, key_a, key_b = service
    a = SchedulerClient(url=settings.gateway_url, api_key=key_a)
    b = SchedulerClient(url=settings.gateway_url, api_key=key_b)
    job = a.submit_job(config=_args(tmp_path, steps=1))  # waits for its environment: cheap
    job_id = job["job_id"]
    assert job_id in [j["job_id"] for j in a.list_jobs()]
    assert job_id not in [j["job_id"] for j in b.list_jobs()]
    with pytest.raises(JobNotFound):
        b.job_status(job_id)
    with pytest.raises(JobNotFound):
        b.cancel_job(job_id)
    with pytest.raises(JobNotFound):
        b.metrics(job_id)
    headers_b = {"Authorization": f"Bearer {key_b}"}
    for method, path in [("GET", f"/v1/jobs/{job_id}/artifacts"), ("GET", f"/v1/jobs/{job_id}/artifacts/spec.yaml"),
                         ("POST", f"/v1/jobs/{job_id}/start")]:
        response = httpx.request(method, settings.gateway_url + path, headers=headers_b, json={"env": {"game": "envs.toy:UppercaseGame"}})
        assert response.status_code == 404, (path, response.text)
    with pytest.raises(AuthenticationError):
        SchedulerClient(url=settings.gateway_url, api_key="otk_wrong").list_jobs()
    assert httpx.get(settings.gateway_url + "/v1/jobs").status_code == 401
    assert a.cancel_job(job_id)["state"] == "CANCELLED"


def test_bad_submissions_fail_with_the_field_and_numbers(service, tmp_path):
    from opentinker.client import InvalidJob, SchedulerClient

    settings, key, _ = service
    client = SchedulerClient(url=settings.gateway_url, api_key=key)
    with pytest.raises(InvalidJob, match=r"resources.num_gpus: the job asks for 2 GPUs; pool 'gpu' has 0 slot"):
        client.submit_job(config=_args(tmp_path), num_gpus=2)
    bad = _args(tmp_path)
    bad["optimization"]["lr"] = -1
    with pytest.raises(InvalidJob, match=r"optimization.lr"):
        client.submit_job(config=bad)
    from opentinker.client import InferenceSchedulerClient

    with pytest.raises(InvalidJob, match="model_path: x: FileNotFoundError"):  # more in tests/test_inference_job.py
        InferenceSchedulerClient(url=settings.gateway_url, api_key=key).submit_inference_job(model_path="x", num_gpus=0)


def test_two_slots_bound_running_jobs_and_cancel_frees_them(service, tmp_path):
    from opentinker.storage import checkpoint as ckpt
    from opentinker.client import SchedulerClient

    settings, key, _ = service
    client = SchedulerClient(url=settings.gateway_url, api_key=key)
    jobs = [client.submit_job(config=_args(tmp_path / str(i), steps=40, with_env=True))["job_id"] for i in range(3)]
    most, cancelled_queued, running = 0, None, []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        statuses = {j: client.job_status(j) for j in jobs}
        running = [j for j, s in statuses.items() if s["state"] == "RUNNING"]
        queued = [j for j, s in statuses.items() if s["state"] == "QUEUED"]
        most = max(most, len(running), _slots(settings))
        if cancelled_queued is None and len(running) == 2 and queued:
            # queued: parked in Prefect, or its process warming up and waiting for a slot
            cancelled_queued = queued[0]
            client.cancel_job(cancelled_queued)
            assert client.wait(cancelled_queued, timeout=60, poll=1)["state"] == "CANCELLED"
        if cancelled_queued and running and all(statuses[j]["step"] >= 2 for j in running):
            break
        time.sleep(1)
    assert cancelled_queued and len(running) == 2 and most == 2
    for job_id in running:
        client.cancel_job(job_id)
    for job_id in running:
        assert client.wait(job_id, timeout=120, poll=1)["state"] == "CANCELLED"
    deadline = time.monotonic() + 90  # the cancelled runs' leases are released (or expire)
    while _slots(settings) and time.monotonic() < deadline:
        time.sleep(2)
    assert _slots(settings) == 0
    # cancelled jobs keep their complete checkpoints
    base = f"{settings.storage_url}/tenants/acme"
    for job_id in running:
        latest = ckpt.latest_checkpoint(base, job_id)
        assert latest is not None and latest.step >= 2


def test_no_api_key_is_written_anywhere(service):
    settings, key_a, key_b = service
    found = subprocess.run(["grep", "-rlF", "-e", key_a, "-e", key_b, str(settings.state_dir)], capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def test_tenant_cli_prints_a_key_once_and_stores_its_hash(tmp_path):
    out = subprocess.run([sys.executable, "-m", "opentinker.cli", "tenant", "add", "initech"], capture_output=True, text=True,
                         env={"OPENTINKER_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip().splitlines()[-1]
    assert key.startswith("tml-") and key not in (tmp_path / "tenants.json").read_text()
    from opentinker.control.gateway.tenants import TenantStore

    assert TenantStore(tmp_path / "tenants.json").authenticate(key) == "initech"


def test_job_state_reads_a_cancelled_run_as_cancelled_even_if_its_process_crashed():
    """A SIGTERM that lands before Prefect's engine handles it records the run as Crashed; the
    user asked to cancel, so the job reads CANCELLED. Without the request a crash is FAILED."""
    from types import SimpleNamespace

    from prefect.states import Cancelled, Crashed, Running

    from opentinker.control.scheduler import CANCEL_REQUESTED_TAG, SLOTS_HELD_TAG, job_state

    def run(state, *tags):
        return SimpleNamespace(state=state, tags=list(tags))

    assert job_state(run(Crashed(message="process exited with -15")))[0] == "FAILED"
    state, reason = job_state(run(Crashed(message="process exited with -15"), CANCEL_REQUESTED_TAG))
    assert state == "CANCELLED" and "Crashed" in reason
    assert job_state(run(Cancelled(), CANCEL_REQUESTED_TAG))[0] == "CANCELLED"
    assert job_state(run(Running(), SLOTS_HELD_TAG, CANCEL_REQUESTED_TAG))[0] == "RUNNING"
    assert job_state(run(Running()))[0] == "QUEUED"
