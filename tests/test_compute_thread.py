"""A shared worker's arithmetic runs on one thread (opentinker.backend.compute_thread): libgomp
keeps an OpenMP team per thread that computes, and more teams than CPUs throttle them all."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from tests.conftest import tiny_spec

WHICH = contextvars.ContextVar("which", default=None)


def test_calls_run_on_one_thread_in_the_callers_context_and_raise_there():
    from opentinker.backend import compute_thread

    names = set()

    def where(tag):
        names.add(threading.current_thread().name)
        return WHICH.get(), tag, compute_thread.run(lambda: threading.current_thread().name)  # nested: runs at once

    results = []
    callers = [threading.Thread(target=lambda i=i: (WHICH.set(f"caller {i}"), results.append(compute_thread.run(where, i)))) for i in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert names == {"opentinker-compute"}
    assert sorted(results) == [(f"caller {i}", i, "opentinker-compute") for i in range(3)]
    with pytest.raises(ZeroDivisionError):
        compute_thread.run(lambda: 1 / 0)
    assert compute_thread.run(lambda: 2) == 2  # the thread serves on after a call raised
    assert compute_thread.run_on(torch.device("cuda", 0), lambda: threading.current_thread().name) == threading.current_thread().name


def test_a_hosted_jobs_sampling_and_update_run_on_the_compute_thread(base_worker, tmp_path, monkeypatch):
    from opentinker.backend.stream import StreamEngine
    from opentinker.backend.trainer import PolicyTrainer

    seen: dict[str, set[str]] = {"decode": set(), "update": set()}
    decode, update = StreamEngine._step, PolicyTrainer.update

    def spy(name, real):
        return lambda *a, **k: (seen[name].add(threading.current_thread().name), real(*a, **k))[1]

    monkeypatch.setattr(StreamEngine, "_step", spy("decode", decode))
    monkeypatch.setattr(PolicyTrainer, "update", spy("update", update))
    worker = base_worker()
    key = worker.host_job(tiny_spec(tmp_path, resources={"share_base": True}), "job", "tenant")["key"]
    worker.job_call(key, "rollout", 1)
    worker.job_call(key, "update", 1)
    assert seen == {"decode": {"opentinker-compute"}, "update": {"opentinker-compute"}}
