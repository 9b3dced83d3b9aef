"""Failures that tell the truth: failed episodes are a signal (a job that fails them all fails,
with the reason, and registers nothing), followers outlive the control plane's blips, storage
failures read as one line with the cause and the path, oversized or absurd specs are refused at
once, a broken model folder is named at `validate`, and every command finds the same stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, env=None, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opentinker.cli", *args], cwd=cwd, env=os.environ | (env or {}),
                          capture_output=True, text=True, timeout=timeout)


# --- job health ---------------------------------------------------------------------------------

@pytest.fixture
def test_games(monkeypatch):
    monkeypatch.setenv("OPENTINKER_GAME_ALLOWLIST", "envs,tests.games")


@pytest.mark.parametrize("game,reason", [("BrokenResetGame", "reset: RuntimeError: the level file is missing"),
                                         ("NanRewardGame", "reward nan is not finite"),
                                         ("NoneRewardGame", "reward None is not a number")])
def test_a_job_whose_episodes_all_fail_stops_with_the_reason(tmp_path, test_games, game, reason):
    from opentinker.rl import RLJob
    from opentinker.rl.health import JobUnhealthy

    spec = tiny_spec(tmp_path, env={"game": f"tests.games:{game}", "config": {"dataset": [{"id": i} for i in range(8)]}},
                     optimization={"steps": 10}, rollout={"max_turns": 2})
    seen = []
    with pytest.raises(JobUnhealthy, match=rf"episodes keep failing: 100% of step 3's episodes failed, 3 steps in a row .*{reason}"):
        RLJob(spec, job_id="broken").run(on_step=seen.append)
    assert [r.step for r in seen] == [1, 2, 3]  # said at every step, then stopped: no 10 steps of nothing
    assert all(r.metrics["update/skipped"] == 1.0 and reason in r.metrics["rollout/first_failure"] for r in seen)


def test_a_job_that_ends_unhealthy_is_not_registrable(tmp_path, test_games):
    from opentinker.rl import RLJob

    spec = tiny_spec(tmp_path, env={"game": "tests.games:BrokenResetGame", "config": {"dataset": [{"id": i} for i in range(8)]}},
                     optimization={"steps": 1})
    result = RLJob(spec, job_id="broken-short").run()
    assert result.not_registrable.startswith("not registered: 100% of the last step's episodes failed; reset: RuntimeError")


@pytest.mark.slow  # a job through the stack (40 s); the default run keeps its in-process halves just above
def test_the_stack_fails_such_a_job_with_its_reason_and_registers_nothing(stack_env, tmp_path):
    from mlflow.tracking import MlflowClient

    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings, _ = stack_env
    deploy(settings)
    spec = tiny_spec(tmp_path, env={"game": "tests.games:BrokenResetGame", "config": {"dataset": [{"id": i} for i in range(8)]}},
                     optimization={"steps": 6}, registry={"model_name": "broken-model"})
    final = follow(submit_job(spec.model_dump(mode="json"), "broken-on-stack", settings), "broken-on-stack", settings,
                   lambda p: None, interval=1.0)
    assert final.state == "FAILED"
    assert final.message.startswith("job broken-on-stack: JobUnhealthy: episodes keep failing: 100% of step 3's episodes failed")
    assert "reset: RuntimeError: the level file is missing (16 of 16 episodes)" in final.message
    assert final.failed == 16 and "the level file is missing" in final.failure  # what the progress line shows
    assert not MlflowClient(tracking_uri=settings.mlflow_url).search_registered_models(filter_string="name = 'broken-model'")


def test_an_unhealthy_evaluation_never_promotes():
    from opentinker.eval.promotion import _unhealthy

    assert _unhealthy({"rewards": [1.0] * 10, "failed": 6}, "challenger") == "the challenger's evaluation is unhealthy: 6 of 10 episodes failed"
    assert _unhealthy({"rewards": [1.0] * 10, "failed": 5}, "challenger") is None


# --- followers outlive blips --------------------------------------------------------------------------

@pytest.mark.slow  # a Prefect restart under a job (60 s); the slot lease across a restart stays in the default run
def test_train_reports_the_real_end_state_across_a_prefect_restart(stack, stack_env, tmp_path):
    """`opentinker train` follows a job; the Prefect server is killed mid-job, kept down until the
    follower says it is reconnecting, and started again: the follower reports the job's real end
    (COMPLETED, exit 0)."""
    import threading

    from opentinker.control.stack import Stack

    settings, env = stack_env
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(yaml.safe_dump(tiny_spec(tmp_path, optimization={"steps": 6}, checkpoint={"every": 1}).model_dump(mode="json")))
    train = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "train", str(spec_path), "--job-id", "blip"], cwd=ROOT,
                             env=os.environ | env | {"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(train.stdout), daemon=True)  # its output as it comes
    reader.start()
    services, stack_status = Stack(settings), stack[1]
    deadline = time.monotonic() + 300
    while "RUNNING" not in _job_state("blip", settings) and time.monotonic() < deadline:
        assert train.poll() is None
        time.sleep(0.5)
    os.kill(services.pid("prefect"), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not any("reconnecting" in line for line in lines):  # the follower found it down (it looks every 2 s)
        assert train.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.2)
    stack_status.update(services.up(timeout=180))  # the session's stack goes on with the new server
    train.wait(timeout=600)
    reader.join(timeout=30)
    out = "".join(lines)
    assert train.returncode == 0, out[-3000:]
    assert "reconnecting" in out and "job blip: COMPLETED" in out
    assert "Traceback" not in out


def test_a_jobs_slot_lease_outlives_a_prefect_restart_and_a_second_holder_waits(stack, stack_env):
    """The lease a job holds its slots by is renewed through a Prefect server restart (Prefect's
    own `concurrency()` gave up within seconds, with a fresh client that does not retry a refused
    connection, and failed the job); a second holder of a full limit waits until it is released."""
    import contextvars
    import threading
    import uuid

    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from opentinker.control.scheduler import prefect_client
    from opentinker.control.stack import Stack
    from opentinker.core.polling import wait_for
    from opentinker.orchestration.slot_lease import leased_slots

    settings, _ = stack_env
    name = f"lease-test-{uuid.uuid4().hex[:8]}"
    with prefect_client() as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))

    def held() -> int:
        with prefect_client() as client:
            return client.read_global_concurrency_limit_by_name(name).active_slots

    second: dict = {}

    def second_holder() -> None:
        with leased_slots(name, 1, lease_s=60, blip_s=120):
            second["at"] = time.monotonic()

    with leased_slots(name, 1, lease_s=60, blip_s=120, renew_every_s=1) as lease:
        assert held() == 1
        waiter = threading.Thread(target=contextvars.copy_context().run, args=(second_holder,), daemon=True)
        waiter.start()
        services, stack_status = Stack(settings), stack[1]
        os.kill(services.pid("prefect"), signal.SIGKILL)
        time.sleep(4)  # renewals fall due while nothing answers
        stack_status.update(services.up(timeout=180))
        before = lease.renewals
        wait_for(lambda: lease.renewals > before or None, interval=0.5, timeout=60, what="a renewal after the restart")
        assert lease.lost is None and held() == 1 and "at" not in second
        released = time.monotonic()
    waiter.join(timeout=60)
    assert second["at"] >= released  # it got the slot only once the first holder let go
    assert held() == 0
    with pytest.raises(LookupError, match=r"^the concurrency limit 'no-such-limit' does not exist"):
        with leased_slots("no-such-limit", 1, lease_s=60, blip_s=5):
            pass


def test_a_run_whose_process_died_with_its_worker_is_marked_crashed_and_its_job_reads_failed(stack_env):
    """A run whose process died together with its worker (`opentinker down` mid-job, a kill -9, a lost
    host) has nobody left to report its end: it stayed Running for ever, holding its place in the pool
    (a full-suite run hung behind such runs). The stack installs Prefect's zombie-run automation; this
    test makes its own copy, limited to its tag and a 10 s window (Prefect's least), and really leaves a run behind:
    after one heartbeat and silence it is Crashed and its job reads FAILED with the line to resume,
    while a run that keeps beating stays Running."""
    import uuid
    from datetime import datetime, timezone

    import httpx
    from prefect import flow
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelled, Running

    from opentinker.control.scheduler import LOST_RUNS, ensure_automation, job_state, lost_run_automation, prefect_client
    from opentinker.core.polling import wait_for

    settings, _ = stack_env
    with prefect_client() as client:
        (installed,) = client.read_automations_by_name(LOST_RUNS)
    assert installed.trigger.within.total_seconds() == settings.lost_run_after_s and installed.enabled
    assert installed.actions[0].state == StateType.CRASHED

    tag = f"lost-test-{uuid.uuid4().hex[:8]}"
    ensure_automation(lost_run_automation(10.0, name=tag, tag=tag))

    def beat(run_id) -> None:
        event = {"id": str(uuid.uuid4()), "occurred": datetime.now(timezone.utc).isoformat(), "event": "prefect.flow-run.heartbeat",
                 "resource": {"prefect.resource.id": f"prefect.flow-run.{run_id}"},
                 "related": [{"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"}]}
        httpx.post(f"{settings.prefect_api_url}/events", json=[event], trust_env=False, timeout=10).raise_for_status()

    @flow(name=tag)
    def left_behind() -> None:
        """Never runs: its runs are created Running, as a job's run whose process died reads."""

    with prefect_client() as client:
        lost, alive = (client.create_flow_run(left_behind, state=Running(), tags=[tag, f"job:{tag}-{i}"]) for i in range(2))
    try:
        for run in (lost, alive):
            beat(run.id)
        started = time.monotonic()

        def crashed():
            beat(alive.id)
            with prefect_client() as client:
                return client.read_flow_run(lost.id).state.type == StateType.CRASHED or None

        wait_for(crashed, interval=1, timeout=90, what="the silent run marked Crashed")
        assert time.monotonic() - started >= 10.0 - 1.0  # not before the window
        with prefect_client() as client:
            run, other = client.read_flow_run(lost.id), client.read_flow_run(alive.id)
        assert other.state.type == StateType.RUNNING  # it kept beating
        state, line = job_state(run)
        assert state == "FAILED" and "it stopped sending heartbeats: its worker or machine went away" in line, line
        assert line.endswith(f"resubmit job {tag}-0 to resume from its last complete checkpoint"), line
    finally:
        with prefect_client() as client:
            client.set_flow_run_state(alive.id, Cancelled(), force=True)
            for run in (lost, alive):
                client.delete_flow_run(run.id)
            for automation in client.read_automations_by_name(tag):
                client.delete_automation(automation.id)


def test_a_lost_run_window_shorter_than_three_heartbeats_is_refused(tmp_path):
    from pydantic import ValidationError

    from opentinker.core.settings import Settings

    with pytest.raises(ValidationError, match=r"lost_run_after_s \(60\) must be at least three heartbeats \(3 x run_heartbeat_s = 90\)"):
        Settings(state_dir=tmp_path, lost_run_after_s=60)
    assert Settings(state_dir=tmp_path, run_heartbeat_s=60, lost_run_after_s=180).lost_run_after_s == 180


def _job_state(job_id, settings) -> str:
    from opentinker.control.follow import latest_flow_run
    from opentinker.control.scheduler import job_state

    try:
        return job_state(latest_flow_run(job_id))[0]
    except Exception:  # noqa: BLE001 - not there yet
        return ""


def test_follow_gives_up_in_one_line_saying_how_to_reattach(tmp_path):
    from opentinker.control.follow import FollowLost, follow
    from opentinker.core.settings import Settings
    from tests.stack_fixtures import free_ports

    from prefect.settings import PREFECT_API_URL, temporary_settings

    dead = Settings(state_dir=tmp_path, prefect_port=free_ports(1)[0], mlflow_port=free_ports(1)[0])
    retries = []
    with temporary_settings({PREFECT_API_URL: dead.prefect_api_url}):
        with pytest.raises(FollowLost, match=r"^no answer from the control plane for 3s .*re-attach with `opentinker follow j`$"):
            follow("00000000-0000-0000-0000-000000000000", "j", dead, lambda p: None, on_retry=lambda n, e: retries.append(n),
                   give_up_after_s=3)
    assert retries


# --- storage failures read as one line ----------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root or a user namespace)")
    yield mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_under_a_jobs_checkpoints_raises_enospc_with_the_path_and_leaves_no_half_step(tmp_path, full_disk):
    """In this process (the stack's one-line message of the same failure: the slow test below)."""
    from opentinker.rl import RLJob

    spec = tiny_spec(tmp_path, optimization={"steps": 2}, checkpoint={"every": 1, "base_url": f"file://{full_disk}"})
    with pytest.raises(OSError) as caught:
        RLJob(spec, job_id="disk-full").run()
    assert f"cannot write checkpoint file://{full_disk}/disk-full/step-" in str(caught.value)
    assert "[Errno 28] No space left on device" in str(caught.value)
    assert not list((full_disk / "disk-full").glob("step-*"))


@pytest.mark.slow  # a job through the stack (40 s); the in-process failure above stays in the default run
def test_a_full_disk_under_the_checkpoints_fails_in_one_line_with_enospc_and_the_path(stack_env, tmp_path, full_disk):
    from opentinker.control.follow import follow
    from opentinker.control.submit import deploy, submit_job

    settings, _ = stack_env
    deploy(settings)
    spec = tiny_spec(tmp_path, optimization={"steps": 2}, checkpoint={"every": 1, "base_url": f"file://{full_disk}"})
    final = follow(submit_job(spec.model_dump(mode="json"), "disk-full", settings), "disk-full", settings, lambda p: None, interval=1.0)
    assert final.state == "FAILED"
    assert "\n" not in final.message and "\x1b" not in final.message and "pid=" not in final.message
    assert f"cannot write checkpoint file://{full_disk}/disk-full/step-" in final.message
    assert "[Errno 28] No space left on device" in final.message
    assert not list((full_disk / "disk-full").glob("step-*"))  # no half-written step folder is left


# --- sizes, budgets, model folders ----------------------------------------------------------------------

def test_a_50mb_spec_is_refused_at_once_in_a_short_message(tmp_path):
    from opentinker.client import InvalidJob, SchedulerClient

    data = tiny_spec(tmp_path).model_dump(mode="json")
    path = tmp_path / "huge.yaml"
    path.write_bytes(yaml.safe_dump(data).encode() + b"# " + b"x" * 50_000_000 + b"\n")  # a valid spec, 50 MB with its comment
    t0 = time.monotonic()
    out = _cli("validate", str(path))
    assert out.returncode == 2 and time.monotonic() - t0 < 60 and len(out.stdout + out.stderr) < 500
    assert f"{path}: 47.7 MB, more than the 256 KB a spec may hold" in out.stdout  # by its size on disk, unread
    data["env"]["config"]["note"] = "x" * 1_000_000
    with pytest.raises(InvalidJob, match="^env.config.note: 977 KB, more than the 256 KB a spec may hold"):  # refused before anything is sent
        SchedulerClient(url="http://127.0.0.1:9", api_key="otk_x").submit_job(config=data)


def test_absurd_budgets_are_refused_with_the_field(tmp_path):
    from opentinker.core.spec import SpecError, parse_spec

    for section, key, value in (("optimization", "steps", 10**12), ("rollout", "max_new_tokens", 10**9), ("rollout", "group_size", 10**6)):
        data = tiny_spec(tmp_path).model_dump(mode="json")
        data[section][key] = value
        with pytest.raises(SpecError, match=rf"^{section}\.{key}: Input should be less than or equal to"):
            parse_spec(data)


def test_validate_names_a_truncated_safetensors_and_an_empty_folder(tmp_path, tiny_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_path, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, expected in ((broken, f"model.name: {weights}: truncated: the header says"), (empty, f"model.name: {empty} is an empty folder")):
        data = tiny_spec(tmp_path).model_dump(mode="json")
        data["model"]["name"] = str(folder)
        (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
        out = _cli("validate", str(tmp_path / "spec.yaml"))
        assert out.returncode == 2 and expected in out.stdout, out.stdout


def test_gpus_asked_for_where_none_exist_are_refused_in_process(tmp_path):
    out_path = tmp_path / "gpu.yaml"
    out_path.write_text(yaml.safe_dump(tiny_spec(tmp_path, resources={"num_gpus": 1}).model_dump(mode="json")))
    out = _cli("run", str(out_path), "--steps", "1")
    assert out.returncode == 1
    assert "resources.num_gpus: the job asks for 1 GPU(s); this process sees 0" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


# --- one state folder ------------------------------------------------------------------------------------

def test_every_directory_finds_the_same_stack(stack_env, tmp_path, monkeypatch):
    """The default state folder does not depend on the working directory, and `status` run from
    elsewhere agrees with what answers on the ports."""
    from opentinker.core.settings import Settings

    monkeypatch.delenv("OPENTINKER_STATE_DIR", raising=False)
    here = Settings().state_dir
    monkeypatch.chdir(tmp_path)
    assert Settings().state_dir == here == Path("~/.opentinker").expanduser()
    settings, env = stack_env
    out = _cli("status", env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.count("│ yes     │ yes") >= 4, out.stdout
    assert not (tmp_path / ".opentinker").exists()
