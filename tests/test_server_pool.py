"""A job sampling through several servers of its own (`rollout.servers`): the requests shared by
load, each server synced to the same version and verified after every update, one that dies
named and restarted once while the others live on. The servers are the job's own CPU servers
(`rollout.engine: server` on the tiny model), started by the real `rollout_server`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opentinker.backend import SamplingParams
from opentinker.backend.device import placement
from opentinker.backend.server_pool import ServerPool
from opentinker.core.spec_limits import SpecError
from opentinker.inference.launch import rollout_server, server_share
from opentinker.rl import RLJob
from tests.conftest import tiny_spec


def _spec(tmp_path, servers: int = 2, steps: int = 2, **rollout):
    return tiny_spec(tmp_path, rollout={"engine": "server", "servers": servers, "max_new_tokens": 4, **rollout},
                     optimization={"steps": steps}, checkpoint={"every": 1})


def _starter(starts: list[int]):
    def start(spec, job_id, where, index):
        starts.append(index)
        return rollout_server(spec, job_id, where, index)
    return start


def test_a_job_samples_through_two_servers_each_synced_and_verified(tmp_path):
    starts: list[int] = []
    job = RLJob(_spec(tmp_path), job_id="two-servers", start_server=_starter(starts))
    try:
        result = job.run()
        pool = job.sampler.engine
        assert result.steps_done == 2 and sorted(starts) == [0, 1]
        # every server holds the final version, loaded under its name and answering the probe as the trainer does
        assert [(m.synced_version, m.served) for m in pool.members] == [(2, "policy-v2")] * 2
        assert all(n > 0 for n in pool.requests), pool.requests  # both took episodes
        last = result.history[-1]
        assert last["rollout/servers"] == 2 and 0.5 <= last["rollout/server_busiest_share"] < 1
        assert last["rollout/sync_logprob_gap"] < 1e-3  # the worst of the two probes
    finally:
        job.close()


def test_requests_go_to_the_server_with_the_fewest_in_flight(tmp_path):
    spec = _spec(tmp_path)
    where = placement(0, spec.model.dtype)
    pool = ServerPool([rollout_server(spec, "routing", where, i) for i in range(2)], tolerance=1e-3)
    params = SamplingParams(max_new_tokens=2)
    try:
        for _ in range(4):
            pool.generate([[1, 2, 3]], params)
        assert pool.requests == [2, 2]  # idle servers take turns
        held = pool._pick()  # the routing's own decision: a request now in flight on `held`
        for _ in range(3):
            pool.generate([[1, 2, 3]], params)
        assert pool.requests[held] == 3 and pool.requests[1 - held] == 5  # the busy one took none of them
    finally:
        pool.close()


def test_a_server_that_dies_is_named_and_restarted_alone(tmp_path):
    """The second server stopped after step 1's checkpoint: the job's line names it (2 of 2), a new
    one takes its place, the first lives on, and the job goes on from step 1 to the end."""
    starts: list[int] = []
    job = RLJob(_spec(tmp_path, steps=3), job_id="one-dies", start_server=_starter(starts))
    first = job.sampler.engine.members[0].server

    def stop_the_second(report) -> None:
        if report.step == 1 and len(starts) == 2:
            job.sampler.engine.members[1].server.stop()
    try:
        result = job.run(on_step=stop_the_second)
        assert result.steps_done == 3 and sorted(starts) == [0, 1, 1]
        assert result.restarted.startswith("inference server 2 of 2 at http://127.0.0.1:"), result.restarted
        assert job.sampler.engine.members[0].server is first  # not restarted
        assert [m.synced_version for m in job.sampler.engine.members] == [3, 3]
        assert [h["step"] for h in result.history] == [1.0, 2.0, 3.0]
    finally:
        job.close()


def test_each_server_gets_its_share_of_the_jobs_devices(tmp_path, monkeypatch):
    """On a CPU, contiguous shares of the job's cores; on GPUs, tensor_parallel of the job's
    devices each, and a clear line where they run out."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {2, 3, 4, 5, 6, 7})
    cpu = SimpleNamespace(device=torch.device("cpu"))
    spec = _spec(tmp_path, servers=4)
    assert [server_share(i, spec, cpu)["cpu_cores"] for i in range(4)] == [[2, 3], [4, 5], [6], [7]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    gpu = SimpleNamespace(device=torch.device("cuda"))
    spec = tiny_spec(tmp_path, rollout={"engine": "vllm", "servers": 2, "tensor_parallel": 2}, resources={"num_gpus": 4})
    assert [server_share(i, spec, gpu) for i in range(2)] == [{"num_gpus": 2, "env": {"CUDA_VISIBLE_DEVICES": "3,5"}},
                                                              {"num_gpus": 2, "env": {"CUDA_VISIBLE_DEVICES": "6,7"}}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")
    with pytest.raises(ValueError, match=r"server 2 of 2 needs 2 of the job's GPUs \(3,5,6\)"):
        server_share(1, spec, gpu)


@pytest.mark.parametrize(("rollout", "resources", "match"), [
    ({"engine": "local", "servers": 2}, {}, r"rollout\.servers: 2 servers are the job's own inference servers"),
    ({"engine": "server", "servers": 2, "server_url": "http://127.0.0.1:9"}, {}, r"rollout\.servers"),
    ({"engine": "vllm", "tensor_parallel": 2}, {}, r"rollout\.tensor_parallel: 2 GPUs a server .* \(the job has 0\)"),
    ({"engine": "vllm", "servers": 2, "tensor_parallel": 2}, {"num_gpus": 2}, r"servers x tensor_parallel = 4 \(the job has 2\)"),
])
def test_servers_the_job_cannot_have_fail_the_spec(tmp_path, rollout, resources, match):
    with pytest.raises(SpecError, match=match):
        tiny_spec(tmp_path, rollout=rollout, resources=resources)


def test_auto_refuses_several_servers_where_it_would_sample_in_process(tmp_path):
    """`rollout.engine: auto` with servers: 2 on a model vLLM cannot run (the tiny model's head size):
    one line, not a job that quietly samples in its own process."""
    from opentinker.rl.engine_choice import choose_engine

    with pytest.raises(ValueError, match=r"^rollout\.servers: 2 servers sample through vLLM, which cannot sample this job here: "):
        choose_engine(tiny_spec(tmp_path, rollout={"servers": 2}), starts_servers=True)
