"""A user's own game trains through the service while it stays in the user's process.

The client is a separate script whose game class lives in its `__main__` (no worker could import
it, and it is not on the allowlist anyway): the reference client code, as written, submits the
job and `fit()`s it; the job reaches the game through the gateway over the link the client
opened. The client listens on no port. Killing it mid-job costs the episodes in flight; `fit()`
again from a new process continues the job to the end. A gateway killed and restarted mid-`fit()`
costs the same: the link reopens, the job ends COMPLETED, nothing resubmitted. One client serves a
job: a second `fit()` is refused in one line, a takeover tells the first; racing links and racing
`/start`s: exactly one wins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from tests.conftest import tiny_spec

CLIENT = textwrap.dedent('''
    import json, os, sys, time
    from opentinker.client import LinkLost, LinkRefused, SchedulerClient, ServiceClient
    from opentinker.env import GameEnvironment
    from opentinker.environment.base_game import AbstractGame, StepResult

    class CountingGame(AbstractGame):
        """Data-free and multi-turn: reset draws its own start; the reward asks for a capital."""

        def get_system_prompt(self) -> str:
            return "Answer briefly."

        def get_initial_user_message(self) -> str:
            return "A short game."

        def reset(self, **kwargs) -> str:
            import random
            self.n, self.turn = random.randint(1, 99), 0
            return f"Say something about {self.n}."

        steps = 0

        def step(self, action: str) -> StepResult:
            time.sleep(float(os.environ.get("GAME_STEP_SECONDS", "0")))
            CountingGame.steps += 1
            if CountingGame.steps == int(os.environ.get("DIE_AT_STEP_CALL", "0")):
                os.kill(os.getpid(), 9)  # the user's machine dies in the middle of an episode
            self.turn += 1
            done = self.turn >= 2
            letters = [c for c in action if c.isalpha()]
            reward = float(bool(letters) and letters[0].isupper()) if done else 0.0
            return StepResult(observation="Once more." if not done else "", reward=reward, done=done)

    args = json.loads(sys.argv[2])
    try:
        if sys.argv[1] == "train":  # the reference design's training workflow
            scheduler = SchedulerClient(url=os.environ["GATEWAY"])
            job_result = scheduler.submit_job(config=args, num_gpus=0)
            job_id, server_url = job_result["job_id"], job_result["server_url"]
            print(json.dumps({"job_id": job_id}), flush=True)
            env = GameEnvironment(game_class=CountingGame, config=args, job_id=job_id)
            client = ServiceClient(server_url=server_url)
            client.set_config(args, env)
            final = client.fit(env=env, num_epochs=2, poll=0.5, progress=False)
        else:  # reconnect to a running job (or take its link over)
            job_id = sys.argv[3]
            env = GameEnvironment(game_class=CountingGame, config=args, job_id=job_id)
            client = ServiceClient(server_url=f"{os.environ['GATEWAY']}/v1/jobs/{job_id}")
            final = client.fit(env=env, poll=0.5, progress=False, takeover=sys.argv[1] == "takeover")
    except (LinkRefused, LinkLost) as err:  # what the user is told
        print(json.dumps({"error": f"{type(err).__name__}: {err}", "reopened": client.link and client.link.reopened}), flush=True)
        sys.exit(3)
    link = client.link
    print(json.dumps({"final": {k: final[k] for k in ("state", "step", "metrics")},
                      "calls": link.calls, "frames": link.frames, "reopened": link.reopened}), flush=True)
''')


@pytest.fixture(scope="module")
def service(stack_env):
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, env = stack_env
    deploy(settings)
    yield settings, env, TenantStore(settings.state_dir / "tenants.json").create("linkco", rotate=True)


def _args(tmp_path, epoch_size: int = 8) -> dict:
    """The job's args as a user's script holds them: every section but where the game is (fit() says that)."""
    data = tiny_spec(tmp_path, rollout={"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4, "max_turns": 2},
                     evaluation={"every": 0, "n_samples": 4}, checkpoint={"every": 1}).model_dump(mode="json")
    data.pop("job_id", None)
    data["env"] = {"config": {"val_size": epoch_size}, "link_timeout_s": 120, "timeout_s": 10}
    return data


def _client(tmp_path, settings, key, *argv, die_at_step_call: int = 0, step_s: float = 0.05, stderr=subprocess.PIPE) -> subprocess.Popen:
    script = tmp_path / "my_training_script.py"
    script.write_text(CLIENT)
    env = os.environ | {"GATEWAY": settings.gateway_url, "OPENTINKER_API_KEY": key, "GAME_STEP_SECONDS": str(step_s),
                        "DIE_AT_STEP_CALL": str(die_at_step_call)}
    return subprocess.Popen([sys.executable, str(script), *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True)


def _until_logged(proc: subprocess.Popen, log_path, text: str, timeout: float = 180) -> None:
    """Wait for `text` in a client's stderr (a file, so nothing blocks); say all it printed if it never comes."""
    deadline = time.monotonic() + timeout
    while text not in log_path.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    logged = log_path.read_text()
    if text not in logged:
        out = proc.stdout.read() if proc.poll() is not None else "(still running)"
        raise AssertionError(f"{text!r} not logged; exit {proc.poll()}; stdout: {out[-2000:]}; stderr: {logged[-4000:]}")


def _listening(pid: int) -> list:
    return [c for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_a_game_in_the_client_script_trains_through_the_gateway(service, tmp_path):
    settings, _, key = service
    proc = _client(tmp_path, settings, key, "train", json.dumps(_args(tmp_path)))
    job_id = json.loads(proc.stdout.readline())["job_id"]
    from opentinker.client import SchedulerClient

    scheduler = SchedulerClient(url=settings.gateway_url, api_key=key)
    while scheduler.job_status(job_id)["state"] != "RUNNING" and proc.poll() is None:
        time.sleep(0.5)
    assert _listening(proc.pid) == []  # the client opened a link; it listens on nothing
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:  # the job holds a slot of its tenant's running-jobs limit
        limit = prefect.read_global_concurrency_limit_by_name("tenant-linkco")
    assert limit.limit == settings.tenant_max_running and limit.active_slots == 1
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["final"]["state"] == "COMPLETED" and report["final"]["step"] == 4  # num_epochs=2 of 8 data-free episodes, 4 a step
    assert report["final"]["metrics"]["rollout/failed_episodes"] == 0
    assert report["calls"] > 2 * report["frames"]  # many episodes' calls travel together
    status = scheduler.job_status(job_id)
    assert status["checkpoint"].startswith(f"{settings.storage_url}/tenants/linkco/{job_id}/")


@pytest.mark.slow  # a client killed mid-fit (76 s); test_a_game_in_the_client_script_trains_through_the_gateway keeps the link in the default run
def test_killing_the_client_costs_its_episodes_and_fit_again_continues(service, tmp_path):
    from mlflow.tracking import MlflowClient

    from opentinker.client import SchedulerClient

    settings, _, key = service
    args = _args(tmp_path, epoch_size=12)  # num_epochs=2: 6 steps of 4 prompts
    # 8 step calls evaluate at step 0, 16 play each training step: the 30th is in step 2's rollout
    first = _client(tmp_path, settings, key, "train", json.dumps(args), die_at_step_call=30)
    job_id = json.loads(first.stdout.readline())["job_id"]
    scheduler = SchedulerClient(url=settings.gateway_url, api_key=key)
    assert first.wait(timeout=300) == -signal.SIGKILL
    time.sleep(2)
    assert scheduler.job_status(job_id)["state"] == "RUNNING"  # the job waits for its client
    second = _client(tmp_path, settings, key, "resume", json.dumps(args), job_id)
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["final"]["state"] == "COMPLETED" and report["final"]["step"] == 6
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    (run,) = ml.search_runs([ml.get_experiment_by_name("linkco").experiment_id], filter_string=f"tags.`opentinker.job_id` = '{job_id}'")
    failed = {m.step: m.value for m in ml.get_metric_history(run.info.run_id, "rollout/failed_episodes")}
    assert sorted(failed) == list(range(1, 7))  # every step ran, none twice
    assert 0 < failed[2] <= 8 and sum(failed.values()) == failed[2]  # the episodes in flight, nothing more


def _report(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, dict]:
    """(exit code, the last line the client script printed)."""
    out, err = proc.communicate(timeout=timeout)
    last = (out.strip().splitlines() or [""])[-1]
    assert last.startswith("{"), (out[-2000:], (err or "")[-3000:])
    return proc.returncode, json.loads(last)


def _until_step(scheduler, job_id: str, proc: subprocess.Popen, step: int) -> None:
    while (scheduler.job_status(job_id).get("step") or 0) < step:
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else "(its stderr went to a file)"
        time.sleep(0.5)


def _runs_once(job_id: str) -> bool:
    """Nothing resubmitted or retried: the job is one flow run, run once."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as prefect:
        runs = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{job_id}"])))
    return len(runs) == 1 and runs[0].run_count == 1


def test_a_job_waits_for_a_gateway_that_does_not_answer_as_for_a_client_that_went_away():
    import numpy as np

    from opentinker.env.linked import LinkDown, LinkedGameClass
    from tests.stack_fixtures import free_ports

    (port,) = free_ports(1)  # nothing listens there: a gateway that is down
    game = LinkedGameClass(f"http://127.0.0.1:{port}", "acme-job", "otj_token", link_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(LinkDown, match=r"^job acme-job: no link to the client's environment for 2s \(env.link_timeout_s\): "
                                       r"the gateway did not answer \(ConnectError"):
        game.generate_task(np.random.default_rng(0))
    assert 2 <= time.monotonic() - started < 3  # it waited, as for a client, and no longer


def test_a_gateway_that_drops_the_handshake_reads_as_unreachable_and_is_retried():
    """A port that accepts and closes at once (a gateway still starting; once in CI the link's
    reader thread died of this ConnectionClosedError and the job waited for a client that never
    came back) is a ConnectionError, which reopening retries."""
    import socket

    from opentinker.client.link import EnvironmentLink

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def drop() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    link = EnvironmentLink(f"http://127.0.0.1:{server.getsockname()[1]}", "otk_key", "acme-job", object)
    try:
        for _ in range(5):  # whichever moment of the handshake the close hits
            with pytest.raises(ConnectionError, match=r"^cannot reach the gateway at ws://127\.0\.0\.1:\d+/v1/jobs/acme-job/link: "):
                link._connect()
    finally:
        server.close()


@pytest.mark.slow  # a gateway restart under a live fit (75 s); the link's other tests stay in the default run
def test_a_fit_rides_out_a_gateway_restart_and_keeps_its_link_until_taken_over(service, tmp_path):
    """One job, three clients: the first's fit() outlives a SIGKILLed gateway (its link reopens,
    the job waits for it), a second fit() is refused in one line, a third takes over and the first
    is told; the job ends COMPLETED as one flow run, run once."""
    from opentinker.client import SchedulerClient
    from tests.stack_fixtures import restart_gateway

    settings, _, key = service
    args = _args(tmp_path, epoch_size=12)  # 6 steps; the first client's game is slow, the last one's fast
    first_log = tmp_path / "first.stderr"
    with first_log.open("w") as sink:
        first = _client(tmp_path, settings, key, "train", json.dumps(args), step_s=1.0, stderr=sink)
    job_id = json.loads(first.stdout.readline())["job_id"]
    scheduler = SchedulerClient(url=settings.gateway_url, api_key=key)
    _until_step(scheduler, job_id, first, 1)
    restart_gateway(settings, down_s=1)  # with its start-up, the job and fit() find no gateway for ~10 s
    _until_logged(first, first_log, "reopened")  # its fit() says so (and "dropped; reopening it" before)
    code, report = _report(_client(tmp_path, settings, key, "resume", json.dumps(args), job_id), timeout=120)
    assert code == 3 and report["error"] == (f"LinkRefused: the gateway refused the environment link of job {job_id}: another client "
                                             "is linked to this job (its fit() serves the game); fit(takeover=True) replaces it")
    assert first.poll() is None  # the first one goes on, untouched
    third = _client(tmp_path, settings, key, "takeover", json.dumps(args), job_id)
    code, told = _report(first, timeout=120)
    assert code == 3 and told["error"] == (f"LinkLost: another client took over the environment link of job {job_id} "
                                           "(fit(takeover=True)); the job goes on with it, this fit() stops")
    assert told["reopened"] == 1
    code, report = _report(third)
    assert code == 0 and report["final"]["state"] == "COMPLETED" and report["final"]["step"] == 6, report
    assert _runs_once(job_id)  # nothing resubmitted


def test_racing_links_and_racing_starts_exactly_one_wins(service, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from opentinker.client import LinkRefused, SchedulerClient
    from opentinker.client.link import EnvironmentLink

    settings, _, key = service
    scheduler = SchedulerClient(url=settings.gateway_url, api_key=key)
    job_id = scheduler.submit_job(config=_args(tmp_path), num_gpus=0)["job_id"]  # parked until a /start
    links = [EnvironmentLink(settings.gateway_url, key, job_id, object) for _ in range(8)]
    together = threading.Barrier(8)

    def open_link(link: EnvironmentLink) -> str:
        together.wait()
        try:
            link.open()
            return "linked"
        except LinkRefused as err:
            return str(err)

    def start(steps: int) -> int:
        together.wait()
        return httpx.post(f"{settings.gateway_url}/v1/jobs/{job_id}/start", json={"env": {"link": "CountingGame"}, "steps": steps},
                          headers={"Authorization": f"Bearer {key}"}, trust_env=False, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        opened = list(pool.map(open_link, links))
        started = list(pool.map(start, range(1, 9)))
    try:
        assert opened.count("linked") == 1 and all("another client is linked" in o for o in opened if o != "linked"), opened
        assert sorted(started) == [200] + [409] * 7, started
        assert scheduler.job_status(job_id)["total_steps"] == started.index(200) + 1  # the winner's parameters, no one else's
    finally:
        for link in links:
            link.close()
        scheduler.cancel_job(job_id)


class SizedGame:
    """A client's game whose step answers as many bytes of observation as the action asks for."""

    def get_system_prompt(self) -> str:
        return ""

    def get_initial_user_message(self) -> str:
        return ""

    def get_example_turns(self) -> list:
        return []

    def reset(self, **task) -> str:
        return "ready"

    def step(self, action: str):
        from opentinker.env import StepResult

        return StepResult(observation="x" * int(action), reward=0.0, done=False)

    def close(self) -> None:
        pass


def test_an_answer_over_the_limit_costs_its_call_and_the_link_plays_on(service, tmp_path):
    """Through the real gateway: an answer over OPENTINKER_ENV_MAX_RESPONSE_BYTES (the stack's
    4 MiB) reaches the job as that call's error with the numbers; a job reading with a lower limit
    refuses the line as it streams in; an answer too large for one of the link's frames goes as its
    call's error (a frame over the gateway's 16 MiB WebSocket limit would close the link). The other
    calls, and episodes, go on."""
    import httpx

    from opentinker.client.link import EnvironmentLink
    from opentinker.env.linked import LinkedGameClass
    from opentinker.env.remote import RemoteGameError

    settings, _, key = service
    config = {"model": {"name": "tiny-random"}, "storage": {"base_url": f"file://{tmp_path}/runs"}}
    job = httpx.post(f"{settings.gateway_url}/v1/jobs", json={"config": config}, headers={"Authorization": f"Bearer {key}"},
                     trust_env=False, timeout=60).json()  # parked until a /start: the test plays the job's side itself
    link = EnvironmentLink(settings.gateway_url, key, job["job_id"], SizedGame).open()
    limit = r"the answer is over the limit of OPENTINKER_ENV_MAX_RESPONSE_BYTES \({}\): "
    try:
        games = LinkedGameClass(settings.gateway_url, job["job_id"], job["job_token"], "SizedGame", timeout_s=60)
        game = games()
        assert game.reset() == "ready"
        with pytest.raises(RemoteGameError, match="^" + limit.format("4,194,304 bytes") + r"10,000,0\d\d bytes from the client$"):
            game.step("10000000")
        assert game.step("5").observation == "xxxxx"  # the same episode's next call: the link is up, the session lives

        strict = LinkedGameClass(settings.gateway_url, job["job_id"], job["job_token"], "SizedGame", max_answer_bytes=1024**2)()
        strict.reset()
        with pytest.raises(RemoteGameError, match="^gateway link: " + limit.format("1,048,576 bytes") + r"1,\d{3},\d{3} bytes of one answer read"):
            strict.step("3000000")

        with pytest.raises(RemoteGameError, match=r"the answer is 20,000,0\d\d bytes, over what one link frame carries \(16,776,192\)"):
            game.step("20000000")  # the client sends it as the call's error: a frame over the gateway's 16 MiB would close the link
        assert link.reopened == 0 and link.lost is None
        again = games()
        assert again.reset() == "ready" and again.step("3").observation == "xxx"
    finally:
        link.close()
        httpx.post(f"{settings.gateway_url}/v1/jobs/{job['job_id']}/cancel", headers={"Authorization": f"Bearer {key}"}, trust_env=False, timeout=60)
