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
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
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
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
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


def test_a_session_is_a_job_that_trains_samples_logs_and_ends(tenant, stack):
    """Through the stack's gateway: the session's flow run holds a slot while the client trains;
    a gateway killed and restarted mid-session costs nothing; every optimizer step reaches MLflow;
    close() ends the run; a state saved in that session trains on in a new one after the whole stack
    (Prefect, MLflow, Ray, gateway, worker) went down and came up again, exactly as it would have
    trained on in the first."""
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
    state = trainer.save_state("after-4").result().path
    uninterrupted = _next_steps(trainer, data)  # what the client would do next had nothing stopped
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

    from opentinker.control.stack import Stack

    services = Stack(settings)
    services.down()
    stack[1].update(services.up(timeout=180))  # nothing of the session survives but its storage
    again = tinker.ServiceClient(base_url=settings.gateway_url, api_key=key)
    resumed = again.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id.split(":")[0] != session_id
    assert _next_steps(resumed, data) == pytest.approx(uninterrupted, rel=1e-5)
    again.close("success")
    _wait_final(resumed.model_id.split(":")[0], timeout=60)


def test_a_quiet_session_expires_and_frees_its_slot(tenant):
    """A session whose client sends nothing past its heartbeat timeout ends on its own (COMPLETED,
    slot released), and its client's next call is told the session ended."""
    from opentinker.control.gateway.tinker_sessions import PrefectSessions
    from opentinker.tinker.paths import SessionGone, SessionStarting

    settings, _ = tenant
    sessions = PrefectSessions(settings.model_copy(update={"tinker_heartbeat_timeout_s": 5.0}))
    session_id = sessions.create("tinkerer", {})
    deadline = time.monotonic() + 120
    while True:  # it starts serving, then nobody calls
        try:
            sessions.endpoint("tinkerer", session_id)
            break
        except SessionStarting:
            assert time.monotonic() < deadline, "the session never started"
            time.sleep(0.5)
    ended = _wait_final(session_id, timeout=60)
    assert ended.state.is_completed()
    with pytest.raises(SessionGone, match="ended"):
        sessions.forget(session_id) or sessions.endpoint("tinkerer", session_id)


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
    assert httpx.get(f"{server_url}/health", timeout=5).status_code == 404  # its door on the worker is closed
    started = time.monotonic()
    with pytest.raises(tinker.TinkerError, match=rf"session {session_id} has ended \(cancelled"):
        trainer.forward_backward(data, "cross_entropy").result()
    assert time.monotonic() - started < 30
    service.close("success")
