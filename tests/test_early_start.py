"""A job's own server starts beside the model's load, not after it (vLLM's start is 16-20 s on a
CPU), and a job that fails before taking its server stops it. The server here is the job's own
(`rollout.engine: server`, our CPU server on the tiny model), started by the real `rollout_server`."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from opentinker.inference.launch import rollout_server
from opentinker.rl import RLJob
from opentinker.rl.sampler import EarlyStart
from tests.conftest import tiny_spec


def _spec(tmp_path, **rollout):
    return tiny_spec(tmp_path, rollout={"engine": "server", "max_new_tokens": 4, **rollout}, optimization={"steps": 1},
                     checkpoint={"every": 0})


def _starter(entered: threading.Event, stops: list[str]):
    def start(spec, job_id, where, index):
        entered.set()
        handle = rollout_server(spec, job_id, where, index)

        def stop() -> None:
            handle.stop()
            stops.append(threading.current_thread().name)
        return dataclasses.replace(handle, stop=stop)
    return start


def _load_waiting_for(entered: threading.Event, seen: list[bool], monkeypatch, fail: bool = False) -> None:
    """The policy's model load, waiting (at most 20 s) to see the server's start begin first."""
    import opentinker.rl.policy as policy

    real = policy.load_model

    def load(*args, **kwargs):
        seen.append(entered.wait(20))
        if fail:
            raise RuntimeError("the model's load failed")
        return real(*args, **kwargs)
    monkeypatch.setattr(policy, "load_model", load)


def test_the_jobs_server_starts_while_its_model_loads_and_serves_the_job(tmp_path, monkeypatch):
    entered, seen, stops = threading.Event(), [], []
    _load_waiting_for(entered, seen, monkeypatch)
    job = RLJob(_spec(tmp_path), job_id="early", start_server=_starter(entered, stops))
    try:
        assert seen == [True]  # the server's start had begun before the model's load went on
        result = job.run()
        assert result.steps_done == 1 and job.sampler.engine.synced_version == 1
    finally:
        job.close()
    assert len(stops) == 1


def test_a_job_that_fails_before_taking_its_server_stops_it(tmp_path, monkeypatch):
    entered, seen, stops = threading.Event(), [], []
    _load_waiting_for(entered, seen, monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="the model's load failed"):
        RLJob(_spec(tmp_path), job_id="early-fail", start_server=_starter(entered, stops))
    deadline = time.monotonic() + 30
    while not stops and time.monotonic() < deadline:  # stopped once it is up, by the thread that started it
        time.sleep(0.1)
    assert stops == ["server-start_0"]


def test_only_a_server_the_job_starts_itself_starts_early(tmp_path):
    def start(spec, job_id, where):
        raise AssertionError("not started here")

    assert EarlyStart.of(start, tiny_spec(tmp_path), "j") is start  # the in-process engine
    assert EarlyStart.of(start, _spec(tmp_path, server_url="http://127.0.0.1:9"), "j") is start  # someone else's server
    assert EarlyStart.of(start, _spec(tmp_path), "j", engine=object()) is start  # the host's engine
    assert EarlyStart.of(None, _spec(tmp_path), "j") is None
