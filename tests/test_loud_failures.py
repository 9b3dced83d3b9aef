"""No part of a job dies silently, a job that trains nothing is not a success, and the lines say what
happened: a task draw that raises fails the job at once with the cause (in process and through the
gateway), an engine whose thread dies fails its requests, abandoned environment calls are capped,
texts too long for an episode are cut without being tokenized and counted, a killed actor is named,
and a step trained again after a resume is marked in MLflow."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]
NARROW_MATH = {"game": "envs.math:MathGame", "config": {"low": 2, "high": 2, "operations": ["+"], "val_size": 4}}
HANG_S = 60  # a job that has not ended by then hangs (it fails within a second when it works)


# --- a part that dies takes the job with it, with the cause ----------------------------------------

def test_a_producer_whose_task_draw_raises_fails_the_next_take_at_once():
    from opentinker.rl.producer import Producer

    drawn = itertools.count()

    def draw():
        if next(drawn) >= 2:
            raise ValueError("the generator ran dry")
        return {"id": 0}, {}

    producer = Producer(draw, lambda group: [], prompts_per_step=2, max_staleness=0)
    try:
        assert len(producer.take(0)) == 2
        producer.publish(1)
        with pytest.raises(ValueError, match="the generator ran dry"):
            producer.take(1)
        assert not producer.thread.is_alive()
    finally:
        producer.stop()


def test_a_task_generator_that_only_yields_validation_tasks_fails_the_job_in_one_line(tmp_path):
    """The narrow MathGame (2 + 2 is its only task, and validation holds it): in process the run
    raises the cause at its first rollout; `opentinker run` prints one line and exits 1."""
    from opentinker.rl import RLJob

    spec = tiny_spec(tmp_path, env=NARROW_MATH, optimization={"steps": 2})
    job = RLJob(spec, job_id="narrow")
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            job.run()
        except Exception as err:  # noqa: BLE001 - what the test looks at
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    job.close()
    assert not thread.is_alive(), "the job hangs"
    assert isinstance(outcome.get("error"), RuntimeError) and "only produces validation tasks" in str(outcome["error"])

    path = tmp_path / "narrow.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    done = subprocess.run([sys.executable, "-m", "opentinker.cli", "run", str(path), "--job-id", "narrow-cli"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "the task generator only produces validation tasks: widen its ranges" in out, out
    assert "Traceback" not in out


class GarbledAfter:
    """An environment server whose /generate_task answers an HTML page (status 200) after its first `n` answers."""

    def __init__(self, app, n: int):
        self.app, self.left = app, n

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/generate_task":
            if self.left <= 0:
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
                await send({"type": "http.response.body", "body": b"<html>down for maintenance</html>"})
                return
            self.left -= 1
        await self.app(scope, receive, send)


@pytest.fixture
def garbled_server():
    """MathGame served; its /generate_task turns to garbage after the 4 validation draws."""
    from envs.math import MathGame
    from opentinker.env.server import create_app
    from tests.served import ServedApp

    served = ServedApp(lambda: GarbledAfter(create_app(MathGame), 4))
    yield served
    served.stop()


GARBLED_LINE = "/generate_task: the answer is not JSON"


def _garbled_env(url: str) -> dict:
    return {"game": None, "url": url, "config": {"low": 1, "high": 30, "operations": ["+"], "val_size": 4}, "timeout_s": 5, "retries": 0}


def test_a_generate_task_that_turns_to_garbage_fails_the_job_in_one_line(tmp_path, garbled_server):
    from opentinker.env.remote import RemoteGameError
    from opentinker.rl import RLJob

    job = RLJob(tiny_spec(tmp_path, env=_garbled_env(garbled_server.url), optimization={"steps": 2}), job_id="garbled")
    try:
        with pytest.raises(RemoteGameError, match=GARBLED_LINE):
            job.run()
    finally:
        job.close()


def test_an_engine_whose_thread_dies_fails_its_requests_instead_of_leaving_them_waiting(tiny):
    from opentinker.backend import HFRolloutEngine, SamplingParams

    model, tok = tiny
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0)
    try:
        engine.stream.waiting.put(42)  # not a request: taking it raises on the engine's thread
        engine.stream._thread.join(10)
        assert not engine.stream._thread.is_alive() and engine.stream.died is not None
        with pytest.raises(RuntimeError, match="the engine's thread died: TypeError"):
            engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()


def test_a_prefill_that_raises_fails_the_rows_it_was_admitting_instead_of_leaving_them_waiting(tiny):
    """Rows taken from the queue into a prefill that raises (a token id past the vocabulary) are in
    neither the queue nor the batch: they fail with the step's error, and the engine goes on."""
    from concurrent.futures import ThreadPoolExecutor

    from opentinker.backend import HFRolloutEngine, SamplingParams

    model, tok = tiny
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0)
    try:
        with ThreadPoolExecutor(1) as pool:
            bad = pool.submit(engine.generate, [[1, 2, 10**6]], SamplingParams(max_new_tokens=2))
            with pytest.raises(IndexError):
                bad.result(timeout=60)  # before the fix: never
        assert len(engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2
    finally:
        engine.close()


def test_environment_calls_past_their_deadline_are_capped_and_counted(monkeypatch):
    from opentinker.agent import guard

    monkeypatch.setattr(guard, "MAX_STUCK_CALLS", 2)
    release = threading.Event()
    stuck = guard.stuck_calls()
    outcomes = [guard.call_with_timeout(release.wait, 0.05) for _ in range(2)]
    assert [o.error for o in outcomes] == ["timed out after 0.05s"] * 2
    assert guard.stuck_calls() == stuck + 2
    refused = guard.call_with_timeout(lambda: "never called", 5)
    assert refused.value is None and refused.error.startswith("not called: 2 environment calls of this process are still running "
                                                             "past their deadline (at most 2)")
    release.set()
    deadline = time.monotonic() + 10
    while guard.stuck_calls() > stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert guard.stuck_calls() == stuck
    assert guard.call_with_timeout(lambda: "called", 5).value == "called"


# --- nothing trained is not success ------------------------------------------------------------------

def test_texts_too_long_for_the_episode_are_cut_counted_and_never_tokenized_whole(tiny):
    """A million-character prompt and a two-million-character observation: both episodes end at
    max_total_tokens (truncated, not failed), the tokenizer never sees more than the episode could
    still hold, and the records keep only the start of the text."""
    from opentinker.agent import EpisodeLimits, chat_format, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams
    from opentinker.tracking.metrics import episode_stats
    from tests.games import HugeObservationGame, HugePromptGame

    model, tok = tiny
    chat = chat_format(tok)
    encoded: list[int] = []
    encode = chat.encode_rendered
    chat.encode_rendered = lambda text, what: encoded.append(len(text)) or encode(text, what)
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0)
    limits = EpisodeLimits(max_turns=4, max_total_tokens=512)
    try:
        trajs = run_episodes(engine, chat, [HugePromptGame(), HugeObservationGame(turns=4)], [{"id": 0}, {"id": 1}],
                             SamplingParams(max_new_tokens=4), limits)
    finally:
        engine.close()
    prompt, observed = trajs
    assert [t.stop_reason for t in trajs] == ["max_total_tokens"] * 2 and not any(t.failed for t in trajs)
    assert prompt.truncation.startswith("the prompt is at least ") and "over rollout.max_total_tokens 512" in prompt.truncation
    assert prompt.num_sampled == 0 and len(prompt.messages[-1]["content"]) < 3000
    assert observed.truncation.startswith("turn 2's observation is at least ") and len(observed.turns) == 2
    assert len(observed.turns[-1].observation) < 3000
    assert max(encoded) <= chat.max_token_chars * limits.max_total_tokens  # never a text that cannot fit
    stats = episode_stats(trajs, "rollout")
    assert stats["rollout/truncated_episodes"] == 2 and stats["rollout/failed_episodes"] == 0
    assert stats["rollout/first_truncation"].endswith("(truncated 2 of 2 episodes)")


def test_a_job_whose_episodes_never_fit_fails_as_unhealthy_saying_truncated(tmp_path, monkeypatch):
    from opentinker.rl import RLJob
    from opentinker.rl.health import JobUnhealthy

    monkeypatch.setenv("OPENTINKER_GAME_ALLOWLIST", "envs,tests.games")
    spec = tiny_spec(tmp_path, env={"game": "tests.games:HugePromptGame", "config": {"dataset": [{"id": i} for i in range(8)]}},
                     optimization={"steps": 10})
    seen = []
    with pytest.raises(JobUnhealthy, match=r"every episode of step 3 failed or was cut at rollout.max_total_tokens, 3 steps in a row "
                                           r"unhealthy .*the prompt is at least [\d,]+ tokens, over rollout.max_total_tokens 1,024 "
                                           r"\(truncated 16 of 16 episodes\)"):
        RLJob(spec, job_id="never-fits").run(on_step=seen.append)
    assert [r.step for r in seen] == [1, 2, 3]
    assert all(r.metrics["rollout/truncated_episodes"] == 16 and r.metrics["rollout/failed_episodes"] == 0 for r in seen)


@pytest.fixture(scope="module")
def tenant(stack_env):
    from tests.stack_fixtures import deployed_tenants

    settings, _ = stack_env
    return settings, *deployed_tenants(settings, "loud")


def test_through_the_gateway_such_jobs_fail_in_one_line_with_the_cause_and_free_their_slots(tenant, tmp_path, garbled_server):
    """Both jobs above, submitted by a tenant: each ends FAILED (a job that hung would never end)
    with the cause in one line, and the pool's slots are free again."""
    from prefect.client.orchestration import get_client

    from opentinker.client import SchedulerClient

    settings, key = tenant
    client = SchedulerClient(url=settings.gateway_url, api_key=key)
    expected = {}
    for env, line in ((NARROW_MATH, "the task generator only produces validation tasks"), (_garbled_env(garbled_server.url), GARBLED_LINE)):
        data = tiny_spec(tmp_path, env=env, optimization={"steps": 2}).model_dump(mode="json")
        expected[client.submit_job(config=data, num_gpus=0)["job_id"]] = line
    try:
        for job_id, line in expected.items():
            final = client.wait(job_id, timeout=600, poll=1.0)
            assert final["state"] == "FAILED" and line in final["reason"] and "\n" not in final["reason"], final
        for job_id, line in expected.items():
            assert_tenant_log_is_the_jobs_own(settings, key, client, job_id, line)
    finally:
        client.close()
    with get_client(sync_client=True) as prefect:
        assert prefect.read_global_concurrency_limit_by_name("slots-cpu").active_slots == 0


def _whole_log(read_page, job_id: str) -> list[str]:
    """Every message of the job's log through `read_page(offset)` (a page of the gateway's logs
    answer), once its log is complete."""
    from opentinker.core.polling import wait_for

    def read() -> list[str] | None:
        messages, offset = [], 0
        while True:
            page = read_page(offset)
            messages += [line["message"] for line in page["lines"]]
            offset = page["next_offset"]
            if len(page["lines"]) < 200:
                return messages if page["complete"] else None

    return wait_for(read, interval=1.0, timeout=120, what=f"the whole log of {job_id}")


def assert_tenant_log_is_the_jobs_own(settings, key: str, client, job_id: str, reason: str) -> None:
    """The failed job's log as its tenant reads it (`opentinker logs`, the console's log view): its
    lines and the one-line reason, no traceback, none of Ray's internals, no path of the operator's
    machine; the operator's copy (Prefect's own lines) keeps the traceback."""
    import httpx

    from opentinker.control.gateway.jobs import StackJobs

    operator = _whole_log(lambda offset: StackJobs(settings).logs(job_id, offset, 200), job_id)
    assert any("Traceback (most recent call last)" in m for m in operator) and any("/site-packages/" in m for m in operator)
    with httpx.Client(base_url=settings.gateway_url, trust_env=False, timeout=60) as console:
        assert console.post("/console/signin", data={"key": key}, follow_redirects=False).status_code == 303
        views = {"gateway": _whole_log(lambda offset: client.logs(job_id, offset=offset, limit=200), job_id),
                 "console": _whole_log(lambda offset: console.get(f"/console/api/jobs/{job_id}/logs", params={"offset": offset}).json(), job_id)}
    import opentinker

    operators_paths = [str(settings.state_dir), str(Path(opentinker.__file__).parents[1]), str(Path.home()), sys.prefix, "/tmp/"]
    for view, messages in views.items():
        assert len(messages) == len(operator), view  # line for line: offsets are the operator's too
        text = "\n".join(messages)
        for leak in ["Traceback", "/site-packages/", "ray.", 'File "', *operators_paths]:
            assert leak not in text, (view, leak, text)
        assert any(reason in m for m in messages), (view, text)


# --- lines that say what happened ------------------------------------------------------------------

def test_a_killed_actor_is_named_not_called_a_lost_node(stack_env, tmp_path):
    """SIGKILL a job's actor (a real one, on the stack's Ray head): its error names the actor's
    class, says its node is still up, and where a resubmission resumes."""
    import ray

    from opentinker.core.settings import ray_env
    from opentinker.orchestration.job import lost_cluster_line
    from opentinker.orchestration.task_runner import authenticate

    settings, _ = stack_env
    spec = tiny_spec(tmp_path)
    authenticate(ray_env(settings))
    ray.init(address=settings.ray_head_address, logging_level="ERROR", log_to_driver=False)
    try:
        class Sampler:
            def pid(self) -> int:
                return os.getpid()

        actor = ray.remote(Sampler).options(num_cpus=0).remote()
        os.kill(ray.get(actor.pid.remote(), timeout=120), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get(actor.pid.remote(), timeout=30)
            except ray.exceptions.ActorDiedError as err:
                died = err
                break
            except ray.exceptions.RayActorError:  # unavailable for a moment before it reads dead
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        ray.shutdown()
    line = lost_cluster_line(died, spec, "killed-sampler")
    assert line == ("ActorDiedError: the job's Sampler actor died (its process was killed or ran out of memory; its Ray node is "
                    "still up); resubmit job killed-sampler to resume from the start (no checkpoint yet)"), line


def test_a_step_trained_again_after_a_resume_is_logged_anew_and_the_first_attempt_marked(stack_env, tmp_path):
    """Steps 1-3 logged, then the job resumes from step 1 (step 3's checkpoint refused, say): steps
    2 and 3 are marked abandoned, and what the job logs for them again is their newest value."""
    from mlflow.tracking import MlflowClient

    from opentinker.tracking.runs import ABANDONED_TAG, JobTracker

    settings, _ = stack_env
    spec = tiny_spec(tmp_path)
    first = JobTracker(settings.mlflow_url, settings.project, "redone", spec)
    first.log_steps([(s, {"rollout/reward_mean": 0.1 * s, "step/seconds": 1.0}) for s in (1, 2, 3)])
    again = JobTracker(settings.mlflow_url, settings.project, "redone", spec)
    assert again.run_id == first.run_id
    assert again.mark_abandoned(1) == [2, 3]
    again.log_steps([(2, {"rollout/reward_mean": 0.9, "step/seconds": 1.0})])
    client = MlflowClient(settings.mlflow_url)
    run = client.get_run(first.run_id)
    assert run.data.tags[ABANDONED_TAG].startswith("2, 3 (resumed from step 1 at ")
    at_two = sorted((m.timestamp, m.value) for m in client.get_metric_history(first.run_id, "rollout/reward_mean") if m.step == 2)
    assert [value for _, value in at_two] == [pytest.approx(0.2), 0.9]  # the newest is the job's
    assert again.mark_abandoned(3) == []


def test_a_failed_train_ends_with_the_command_that_resumes_it(stack_env, tmp_path):
    """`opentinker train` (what `make demo` runs) of a job that fails: its last line is the command
    that resumes it, with the job's id, which a user can paste."""
    settings, env = stack_env
    spec_path = tmp_path / "narrow.yaml"
    data = tiny_spec(tmp_path, env=NARROW_MATH, optimization={"steps": 2}).model_dump(mode="json")
    data.pop("job_id", None)
    spec_path.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "opentinker.cli", "train", str(spec_path), "--steps", "2", "--job-id", "resume-me"],
                         cwd=ROOT, env=os.environ | env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "the task generator only produces validation tasks" in lines[-2]
    assert lines[-1] == f"resume it from its last checkpoint: opentinker train {spec_path} --steps 2 --job-id resume-me"
    # The operator's console key stays in its file: the run's end names the file, never the key.
    from opentinker.control.console.session import operator_key, operator_key_path

    key_file = operator_key_path(settings)
    assert operator_key(settings) not in out.stdout + out.stderr
    assert f"  Console key (the operator's; a tenant signs in with its own): in {key_file} (read it: cat {key_file})" in lines
