"""A Tinker session on the real stack: the unmodified SDK against the stack's gateway, the session a
`tinker-session` flow run (Prefect, tagged with its tenant, holding a seat of the pool's base-model
worker) hosted on that worker's Ray actor, its training clients adapters of the worker's one copy
of the base, and its optimizer steps in MLflow; it ends on `close()` or when its client goes quiet,
and a state saved in one session trains on in the next. Two tenants' sessions share one worker."""

from __future__ import annotations

import os
import signal
import time

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.rounding import TINY_LOGPROB, logprob_gap, same_metric  # noqa: E402
from tests.stack_fixtures import restart_gateway  # noqa: E402


@pytest.fixture(scope="module")
def tenant(stack_env):
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, _ = stack_env
    deploy(settings)
    key = TenantStore(settings.state_dir / "tenants.json").create("tinkerer", rotate=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    yield settings, key
    mp.undo()


def _run(session_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"job:{session_id}"])))
    return runs[0]


def _wait_final(session_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _run(session_id)
        if run.state and run.state.is_final():
            return run
        time.sleep(1.0)
    raise AssertionError(f"session {session_id} did not end within {timeout:g} s (state {run.state.name})")


def _slots() -> int:
    """Slots and base-model worker seats held in the CPU pool."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return sum(client.read_global_concurrency_limit_by_name(name).active_slots for name in ("slots-cpu", "slots-cpu-seats"))


def _seats() -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name("slots-cpu-seats").active_slots


def _worker_info(settings) -> dict | None:
    """What the CPU pool's base-model worker hosts, asked as a Ray driver with the stack's token (None: no worker)."""
    import ray

    from opentinker.core.settings import ray_env
    from opentinker.orchestration.base_worker import NAMESPACE, worker_name
    from opentinker.orchestration.task_runner import authenticate

    authenticate(ray_env(settings))
    ray.init(address=settings.ray_head_address, logging_level="ERROR", log_to_driver=False)
    try:
        return ray.get(ray.get_actor(worker_name("cpu"), namespace=NAMESPACE).info.remote(), timeout=60)
    except (ValueError, ray.exceptions.RayActorError):  # no actor of that name, or it is exiting
        return None
    finally:
        ray.shutdown()


def _passes(settings) -> int | None:
    """Passes the worker's bases have run (None: no worker)."""
    info = _worker_info(settings)
    return None if info is None else sum(base["passes"] for base in info["bases"].values())


@pytest.mark.slow  # two sessions through a whole stack (100 s); tests/test_tinker_shared.py holds the sharing in the default run
def test_two_tenants_sessions_share_one_base_model_worker(tenant, tmp_path):
    """Two tenants' sessions are two flow runs, each holding a seat, hosted on one worker actor:
    one base, both clients adapters of it, each session's door under the worker's server. Same
    seed and data give the same loss to both. A session that ends leaves the worker to the other;
    the worker killed, that one fails in one line, its client is told, and its saved state resumes
    in a new session on a new worker; with no session for `tinker_worker_idle_s` (5 s on the test
    stack) a worker exits. A native LoRA job that shares its base (`resources.share_base`) runs on
    the same worker beside them, as a flow run of its own with its own MLflow run."""
    from concurrent.futures import ThreadPoolExecutor

    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.gateway.tinker_sessions import PrefectSessions
    from opentinker.control.scheduler import job_state

    settings, key = tenant
    keys = {"tinkerer": key, "sharer": TenantStore(settings.state_dir / "tenants.json").create("sharer", rotate=True)}
    services = {name: tinker.ServiceClient(base_url=settings.gateway_url, api_key=k) for name, k in keys.items()}
    with ThreadPoolExecutor(2) as pool:  # both sessions start at once
        trainers = dict(zip(services, pool.map(
            lambda s: s.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result(), services.values())))
    sessions = {name: t.model_id.split(":")[0] for name, t in trainers.items()}
    tokens = list(range(300, 312))
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})]
    futures = [t.forward_backward(data, "cross_entropy") for t in trainers.values()]
    losses = [f.result().metrics["loss:sum"] for f in futures]
    # the same adapter twice, maybe in one pass: loss:sum = −Σ w·lp moves by Σ|w| = 11 times the logprobs' gap (tests/rounding.py)
    assert same_metric(losses[0], losses[1], 11.0, logprob_gap(TINY_LOGPROB))
    info = _worker_info(settings)
    assert sorted(info["sessions"]) == sorted(sessions.values())
    (adapters,) = info["adapters"].values()  # one base loaded, both clients on it
    assert sorted(adapters) == sorted(t.model_id for t in trainers.values())
    assert _seats() == 2
    _a_native_job_shares_the_worker(settings, info["pid"], tmp_path)
    for name, session_id in sessions.items():
        assert PrefectSessions(settings).endpoint(name, session_id)[0] == f"{info['url']}/s/{session_id}"
    state = trainers["sharer"].save_state("before-the-crash").result().path
    expected = trainers["sharer"].forward(data, "cross_entropy").result().metrics["loss:sum"]
    services["tinkerer"].close("success")  # one session ends: it leaves, the worker stays for the other
    assert _wait_final(sessions["tinkerer"], timeout=60).state.is_completed()
    after = _worker_info(settings)
    assert after["pid"] == info["pid"] and after["sessions"] == [sessions["sharer"]]
    assert list(after["adapters"].values()) == [[trainers["sharer"].model_id]]

    os.kill(info["pid"], signal.SIGKILL)  # the worker dies under the other session
    crashed = sessions["sharer"]
    state_name, reason = job_state(_wait_final(crashed, timeout=60))
    assert state_name == "FAILED" and reason == (f"WorkerLost: session {crashed}: its base-model worker died (killed, out of memory, "
                                                 "or its Ray node went away); its clients resume from their last saved state in a new session")
    with pytest.raises(tinker.TinkerError, match=rf"session {crashed} has ended \(failed: WorkerLost"):
        trainers["sharer"].forward(data, "cross_entropy").result()
    services["sharer"].close("success")
    again = tinker.ServiceClient(base_url=settings.gateway_url, api_key=keys["sharer"])
    resumed = again.create_training_client_from_state_with_optimizer(state).result()  # on a new worker
    assert same_metric(resumed.forward(data, "cross_entropy").result().metrics["loss:sum"], expected, 11.0, logprob_gap(TINY_LOGPROB))
    assert _worker_info(settings)["pid"] != info["pid"]
    again.close("success")
    _wait_final(resumed.model_id.split(":")[0], timeout=60)
    deadline = time.monotonic() + 90
    while _worker_info(settings) is not None:
        assert time.monotonic() < deadline, "the idle base-model worker did not exit"
        time.sleep(2.0)


def _a_native_job_shares_the_worker(settings, worker_pid: int, tmp_path) -> None:
    """A native RL job with `resources.share_base` submitted beside the sessions: hosted on their
    worker (its MLflow run says which), its episodes sampled by the worker's shared engine."""
    from mlflow.tracking import MlflowClient

    from opentinker.control.scheduler import job_state, prefect_client
    from opentinker.control.submit import submit_job
    from tests.conftest import tiny_spec

    spec = tiny_spec(tmp_path, optimization={"steps": 2}, checkpoint={"every": 2, "base_url": f"{settings.storage_url}/jobs"},
                     resources={"share_base": True})
    run_id = submit_job(spec.model_dump(mode="json"), "shares-a-base", settings)
    deadline = time.monotonic() + 180
    while True:
        with prefect_client() as client:
            state, reason = job_state(client.read_flow_run(run_id))
        if state in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        assert time.monotonic() < deadline, f"the shared job is still {state}"
        time.sleep(1.0)
    assert state == "COMPLETED", reason
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    (run,) = client.search_runs([client.get_experiment_by_name(settings.project).experiment_id],
                                filter_string="tags.`opentinker.job_id` = 'shares-a-base'")
    assert run.data.tags["opentinker.base_worker"].startswith(f"on the base-model worker (pid {worker_pid}): adapter 3 of its tiny-random")
    assert "rollout/batch_share" in run.data.metrics and run.data.metrics["update/sequences"] > 0


def _next_steps(trainer, data) -> list[float]:
    """The loss of the next update and the loss after it (weights, Adam moments and step count all matter)."""
    first = trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return [first, trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]]


def test_a_session_is_a_job_that_trains_samples_logs_and_ends(tenant):
    """Through the stack's gateway: the session's flow run holds a slot while the client trains;
    a gateway killed and restarted mid-session costs nothing; every optimizer step reaches MLflow;
    close() ends the run."""
    from mlflow.tracking import MlflowClient

    from opentinker.control.scheduler import SLOTS_HELD_TAG

    settings, key = tenant
    service = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)
    trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
    session_id = trainer.model_id.split(":")[0]
    run = _run(session_id)
    assert {"tenant:tinkerer", "kind:tinker"} <= set(run.tags) and SLOTS_HELD_TAG in run.tags
    assert run.state.is_running() and _slots() >= 1
    tokens = list(range(100, 120))
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 19})]
    losses = []
    for _ in range(3):
        losses.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0]
    restart_gateway(settings)  # the gateway keeps nothing: the client goes on where it was
    losses.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[-2]
    trainer.save_state("after-4").result()  # the run keeps a checkpoint once "final" is deleted below (its last one would take the run)
    _next_steps(trainer, data)
    trainer.save_weights_for_sampler("final").result()
    sample = trainer.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(tokens[:5]), 2, types.SamplingParams(max_tokens=4, stop=[])).result()
    assert all(len(s.tokens) == 4 and len(s.logprobs) == 4 for s in sample.sequences)
    service.close("success")
    ended = _wait_final(session_id, timeout=60)
    assert ended.state.is_completed(), ended.state
    client = MlflowClient(tracking_uri=settings.mlflow_url)
    experiment = client.get_experiment_by_name("tinkerer")
    ml = client.search_runs([experiment.experiment_id], filter_string=f"tags.`opentinker.job_id` = '{session_id}'")[0]
    assert [m.step for m in client.get_metric_history(ml.info.run_id, "grad_norm")] == [1, 2, 3, 4, 5]
    assert ml.info.status == "FINISHED"
    from opentinker.storage.registry import resolve_model_uri

    assert resolve_model_uri("models:/tinkerer-tinker@champion").endswith(f"{session_id}:train:0/sampler_weights/final")
    _a_registered_checkpoint_is_not_deleted(settings, key, f"tinker://{session_id}:train:0/sampler_weights/final")


@pytest.mark.slow  # the whole stack down and up (about a minute); in the default run tests/test_stack.py restarts a stack and test_tinker_api resumes a saved state exactly
def test_a_saved_state_trains_on_after_the_whole_stack_restarts(tenant, stack):
    """A state saved in a session trains on in a new one after the whole stack (Prefect, MLflow,
    Ray, gateway, worker) went down and came up again, exactly as it would have in the first."""
    from opentinker.control.stack import Stack

    settings, key = tenant
    service, trainer, session_id, data = _a_live_session(settings, key)
    _next_steps(trainer, data)
    state = trainer.save_state("after-1").result().path
    uninterrupted = _next_steps(trainer, data)  # what the client would do next had nothing stopped
    service.close("success")
    _wait_final(session_id, timeout=60)
    services = Stack(settings)
    services.down()
    stack[1].update(services.up(timeout=180))  # nothing of the session survives but its storage
    again = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)
    resumed = again.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id.split(":")[0] != session_id
    # the same weights, moments and data on the same machine's kernels: the same losses, bit for bit
    assert _next_steps(resumed, data) == uninterrupted
    again.close("success")
    _wait_final(resumed.model_id.split(":")[0], timeout=60)


def _a_registered_checkpoint_is_not_deleted(settings, key: str, path: str) -> None:
    """Deleting the sampler checkpoint that `champion` names is refused (400) with the model, version and
    aliases, and the checkpoint stays; once an operator deletes that version (`opentinker models
    delete`), the checkpoint deletes."""
    from typer.testing import CliRunner

    from opentinker.cli.main import app
    from opentinker.storage.registry import get_version, registry_client

    champion = get_version(registry_client(), "tinkerer-tinker", alias="champion").version
    rest = tinker.RestClient(base_url=settings.gateway_url, api_key=key)
    with pytest.raises(tinker.BadRequestError, match=rf"version {champion} of registered model 'tinkerer-tinker' "
                                                     rf"\(aliases: challenger, champion\) uses it.*opentinker models delete tinkerer-tinker {champion}"):
        rest.delete_checkpoint_from_tinker_path(path).result()
    def listed() -> list[str]:
        return [c.tinker_path for c in rest.list_checkpoints(path.split("/")[2]).result().checkpoints]

    assert path in listed()
    result = CliRunner().invoke(app, ["models", "delete", "tinkerer-tinker", champion], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and f"version {champion} and its aliases (challenger, champion) deleted" in result.output, result.output
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in listed()


def _mlflow_status(settings, session_id: str) -> str:
    """The status of the session's MLflow run (RUNNING, FINISHED, FAILED)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    (run,) = client.search_runs([client.get_experiment_by_name("tinkerer").experiment_id],
                                filter_string=f"tags.`opentinker.job_id` = '{session_id}'")
    return run.info.status


def _a_live_session(settings, key: str):
    """(service, trainer, session id, data) of a new session that has trained once."""
    service = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)
    trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
    tokens = list(range(400, 412))
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})]
    trainer.forward_backward(data, "cross_entropy").result()
    return service, trainer, trainer.model_id.split(":")[0], data


GO_ON = ("start a new session and resume from your last save_state with create_training_client_from_state_with_optimizer "
         "(create_training_client_from_state for the weights alone)")


PAUSED_CLIENT = """
import sys, tinker
from tinker import types
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
tokens = list(range(400, 412))
data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})]
trainer.forward_backward(data, "cross_entropy").result()
path = trainer.save_state("before-the-pause").result().path
long = [types.Datum(model_input=types.ModelInput.from_ints([100 + (i * 7 + j) % 3000 for j in range(1023)]),
                    loss_fn_inputs={"target_tokens": [100 + (i * 7 + j + 1) % 3000 for j in range(1023)], "weights": [1.0] * 1023})
        for i in range(200)]
running = trainer.forward_backward(long, "cross_entropy")  # minutes of passes: running when the client pauses
print(trainer.model_id.split(":")[0], path, flush=True)
sys.stdin.readline()  # the test pauses this process (SIGSTOP) meanwhile: no heartbeat, no poll leaves it
try:
    running.result()
except tinker.TinkerError as err:
    print(err, flush=True)
"""


@pytest.mark.slow  # a paused client's session expiring at its timeout (100 s); tests/test_tinker_sessions.py ends sessions whose clients are gone in the default run
def test_a_quiet_session_expires_and_its_client_is_told_how_to_go_on(tenant):
    """A client paused (SIGSTOP, as a laptop closed) sends no heartbeat: past the timeout (20 s here)
    its session ends on its own, apart from a close() in Prefect (a Completed state named Expired,
    saying why), its seat freed and its MLflow run ended; resumed, the client is told the session
    expired, after how long, the setting, and how to go on from its saved state. The client paused
    in the middle of a call that takes minutes of passes: the session still expires on time, and
    the call stops at its next pass boundary (the worker runs no pass of it once the session ended)."""
    import re
    import subprocess
    import sys

    from opentinker.control.scheduler import job_state

    settings, key = tenant
    restart_gateway(settings.model_copy(update={"tinker_heartbeat_timeout_s": 20.0}))  # the gateway gives its sessions 20 s
    client = subprocess.Popen([sys.executable, "-c", PAUSED_CLIENT, settings.gateway_url, key], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=os.environ | {"TINKER_TELEMETRY": "0"})
    try:
        session_id, _ = client.stdout.readline().split()
        passes = _passes(settings)
        while _passes(settings) == passes:  # its long call is in the worker's passes
            time.sleep(0.5)
        os.kill(client.pid, signal.SIGSTOP)
        paused = time.monotonic()
        ended = _wait_final(session_id, timeout=90)
        expired_after = time.monotonic() - paused
        after = _passes(settings)
        time.sleep(3)
        still = _passes(settings)
        os.kill(client.pid, signal.SIGCONT)
        told = client.communicate("go\n", timeout=120)[0].strip()
    finally:
        client.kill()
        restart_gateway(settings)
    assert ended.state.is_completed() and ended.state.name == "Expired", ended.state
    assert expired_after < 20 + 40, expired_after  # the timeout, a poll held when it paused (30 s at most), the flow's look
    assert still is None or still == after  # no pass after the session ended (or its worker, idle, exited)
    state, reason = job_state(ended)
    why = r"expired: no call or heartbeat for \d+ s \(OPENTINKER_TINKER_HEARTBEAT_TIMEOUT_S: 20 s\)"
    assert state == "COMPLETED" and re.fullmatch(why, reason), reason
    assert re.search(rf"session {session_id} {why}; {re.escape(GO_ON)}", told), told
    assert _mlflow_status(settings, session_id) == "FINISHED"
    deadline = time.monotonic() + 30
    while _slots() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _slots() == 0


FINISHED_SCRIPT = """
import sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
print(trainer.model_id.split(":")[0], flush=True)
"""  # and it ends without close(), as most of tinker-cookbook's recipes do


@pytest.mark.slow  # two gateway restarts and three sessions (100 s); tests/test_tinker_sessions.py checks the rule in the default run
def test_a_finished_scripts_session_gives_its_place_to_the_next_within_seconds(tenant):
    """A script that ended without close() leaves its session running; at the tenant's limit (1
    here) a new session is refused while the old one's client may only be between heartbeats, and
    once it has sent nothing for `tinker_absent_after_s` (12 s here, not the 120 s timeout) the old
    session ends Expired, saying why, and the new one opens."""
    import re
    import subprocess
    import sys

    from opentinker.control.scheduler import job_state

    settings, key = tenant
    restart_gateway(settings.model_copy(update={"tinker_max_sessions": 1, "tinker_absent_after_s": 12.0}))
    try:
        script = subprocess.run([sys.executable, "-c", FINISHED_SCRIPT, settings.gateway_url, key], capture_output=True, text=True,
                                timeout=180, env=os.environ | {"TINKER_TELEMETRY": "0"})
        assert script.returncode == 0, script.stderr[-2000:]
        left_behind, ended = script.stdout.split()[0], time.monotonic()
        with pytest.raises(Exception, match=r"tenant tinkerer has 1 live Tinker sessions, the limit is 1.*gives its place 12 s after"):
            tinker.ServiceClient(base_url=settings.gateway_url, api_key=key).create_lora_training_client(base_model="tiny-random").result()
        time.sleep(max(0.0, 13 - (time.monotonic() - ended)))
        service = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)
        service.create_lora_training_client(base_model="tiny-random", rank=4).result()
        old = _wait_final(left_behind, timeout=30)
        service.close("success")
    finally:
        restart_gateway(settings)
    state, reason = job_state(old)
    assert old.state.name == "Expired" and state == "COMPLETED", old.state
    found = re.fullmatch(r"expired: no call or heartbeat for (\d+) s, and a new session of its tenant needed its place "
                         r"\(OPENTINKER_TINKER_ABSENT_AFTER_S: 12 s\)", reason)
    assert found and 12 < int(found[1]) < 60, reason  # seconds after the script ended, not the 120 s timeout


@pytest.mark.slow  # a whole stack down and up (a minute); the quiet-session test covers the lines in the default run
def test_a_live_session_across_a_stack_restart_is_told_at_once_how_to_go_on(tenant, stack):
    """The whole stack stopped under a live client and started again: its session's flow run recorded
    its end as `down` stopped it (Crashed, its MLflow run ended), so the client's next call is told
    within seconds that the session's process died and how to go on from its saved state (it used to
    wait 126 s for the stack's automation to mark the run, then read "resubmit job <session>")."""
    import re

    from opentinker.control.stack import Stack

    settings, key = tenant
    service, trainer, session_id, data = _a_live_session(settings, key)
    services = Stack(settings)
    services.down()
    stack[1].update(services.up(timeout=180))
    started = time.monotonic()
    with pytest.raises(tinker.TinkerError, match=rf"session {session_id} has ended \(failed: its process died \(.+\): killed, out of "
                                                 rf"memory, the stack stopped, or its Ray node or head went away; {re.escape(GO_ON)}\)") as error:
        trainer.forward_backward(data, "cross_entropy").result()
    told_s = time.monotonic() - started
    assert told_s < 10 and "resubmit" not in str(error.value), told_s
    assert _run(session_id).state.is_crashed()
    assert _mlflow_status(settings, session_id) == "FAILED"
    service.close("success")


@pytest.mark.slow  # kills the stack's worker processes (40 s); the default run keeps the 30-minute budget
def test_a_session_whose_machine_went_away_is_told_within_seconds(tenant):
    """What a lost host does: the Prefect worker, the session's flow process and the base-model worker
    all SIGKILLed, so nothing records the run's end (the stack's automation would, `lost_run_after_s`
    (150 s) after its last heartbeat). The gateway, finding the session's server silent and its run
    with no end for a few seconds, marks it Crashed, ends its MLflow run and tells the client how to go on."""
    import re

    import psutil

    from opentinker.control.gateway.tinker_sessions import LOST_MESSAGE
    from opentinker.control.stack import Stack

    settings, key = tenant
    service, trainer, session_id, data = _a_live_session(settings, key)
    services = Stack(settings)
    worker = psutil.Process(services.pid("worker"))
    for proc in [worker, *worker.children(recursive=True), psutil.Process(_worker_info(settings)["pid"])]:
        proc.kill()
    started = time.monotonic()
    try:
        with pytest.raises(tinker.TinkerError, match=rf"session {session_id} has ended \(failed: its process died \({re.escape(LOST_MESSAGE)}\): "
                                                     rf".*; {re.escape(GO_ON)}\)"):
            trainer.forward_backward(data, "cross_entropy").result()
        told_s = time.monotonic() - started
    finally:
        services.start("worker")
    assert told_s < 20, told_s
    run = _run(session_id)
    assert run.state.is_crashed() and run.state.message == LOST_MESSAGE
    assert _mlflow_status(settings, session_id) == "FAILED"
    service.close("success")


def test_a_session_cancelled_in_prefect_ends_and_its_client_is_told(tenant):
    """Cancel, as the Prefect UI does (the run set to Cancelling): the run ends and reads CANCELLED
    (Prefect records the stopped process as Crashed; the run is tagged as a cancel), its slot is
    freed, its door on the worker is closed, and the client's next call fails in one line saying the session
    ended, not with a connection error."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from opentinker.control.gateway.tinker_sessions import PrefectSessions

    settings, key = tenant
    service = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)
    trainer = service.create_lora_training_client(base_model="tiny-random", rank=4, seed=0).result()
    session_id = trainer.model_id.split(":")[0]
    tokens = list(range(200, 212))
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11})]
    trainer.forward_backward(data, "cross_entropy").result()
    server_url, _ = PrefectSessions(settings).endpoint("tinkerer", session_id)  # its door on the base-model worker
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(_run(session_id).id, Cancelling(message="cancelled from the UI"))
    from opentinker.control.scheduler import job_state

    ended = _wait_final(session_id, timeout=120)
    assert job_state(ended)[0] == "CANCELLED", ended.state
    deadline = time.monotonic() + 30
    while _slots() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _slots() == 0
    try:  # its door on the worker is closed (or the worker, idle without it, has exited: tinker_worker_idle_s is 5 s here)
        assert httpx.get(f"{server_url}/health", timeout=5).status_code == 404
    except httpx.ConnectError:
        pass
    started = time.monotonic()
    with pytest.raises(tinker.TinkerError, match=rf"session {session_id} has ended \(cancelled"):
        trainer.forward_backward(data, "cross_entropy").result()
    assert time.monotonic() - started < 30
    service.close("success")
