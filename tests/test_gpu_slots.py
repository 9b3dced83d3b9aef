"""GPU slots are devices: jobs' actors get distinct GPUs from Ray, and what a job starts sees only
its own. Tested on a CPU machine with a Ray node that declares two GPUs (Ray hands out ids and
sets CUDA_VISIBLE_DEVICES whether or not CUDA is there), with the very options the job actors and
the serving actor are created with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import tiny_spec


@pytest.fixture(scope="module")
def two_gpu_node():
    import ray

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    yield
    ray.shutdown()


class DeviceProbe:
    """Stands where a job's actor stands and reports what it, and a child process it starts
    (an inference server, vLLM), are given."""

    def devices(self) -> dict:
        from opentinker.orchestration.serving import devices

        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return devices() | {"child": child}


def _probe(options: dict):
    import ray

    handle = ray.remote(DeviceProbe).options(**options).remote()
    return handle, ray.get(handle.devices.remote(), timeout=60)


def test_two_one_gpu_jobs_get_distinct_devices(two_gpu_node, tmp_path):
    import ray

    from opentinker.orchestration.actors import actor_options

    spec = tiny_spec(tmp_path, resources={"num_gpus": 1, "num_cpus": 0.5})
    a, seen_a = _probe(actor_options(spec, "job-a", "operator/job-a"))
    b, seen_b = _probe(actor_options(spec, "job-b", "operator/job-b"))
    try:
        assert len(seen_a["gpu_ids"]) == len(seen_b["gpu_ids"]) == 1
        assert seen_a["gpu_ids"] != seen_b["gpu_ids"]
        for seen in (seen_a, seen_b):  # the job's process and what it starts see its GPU only
            assert seen["cuda_visible_devices"] == seen["child"] == seen["gpu_ids"][0]
    finally:
        ray.kill(a)
        ray.kill(b)


def test_an_inference_job_beside_a_training_job_gets_another_device(two_gpu_node, tmp_path):
    import ray

    from opentinker.inference.spec import InferenceSpec
    from opentinker.orchestration.actors import actor_options
    from opentinker.orchestration.serving import serving_options

    train, seen_train = _probe(actor_options(tiny_spec(tmp_path, resources={"num_gpus": 1, "num_cpus": 0.5}), "train", "operator/train"))
    serve, seen_serve = _probe(serving_options(InferenceSpec(model_path="file:///x", num_gpus=1, engine="vllm"), "serve"))
    try:
        assert seen_train["gpu_ids"] != seen_serve["gpu_ids"]
        assert seen_serve["cuda_visible_devices"] == seen_serve["child"] == seen_serve["gpu_ids"][0]
    finally:
        ray.kill(train)
        ray.kill(serve)


def test_a_job_given_a_gpu_without_cuda_fails_at_start_in_one_line(two_gpu_node, tmp_path):
    """The real job actor, holding a GPU id on a machine without CUDA: it refuses to start
    (instead of training on the CPU while holding the slot)."""
    import torch

    from opentinker.orchestration.actors import create_actors
    from opentinker.orchestration.layout import layout_for

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    spec = tiny_spec(tmp_path, resources={"num_gpus": 1, "num_cpus": 0.5})
    with pytest.raises(Exception) as caught:
        create_actors(layout_for(spec, "no-cuda", None, on_cluster=False), "no-cuda")
    assert "resources.num_gpus: the job asks for 1 GPU(s); this process sees 0" in str(caught.value)


def test_a_checkpoint_served_from_a_serving_actor_answers(two_gpu_node, tmp_path):
    """The serving actor's path end to end (on CPU: the transformers engine, no GPU asked)."""
    import httpx

    from opentinker.inference.spec import InferenceSpec
    from opentinker.orchestration.serving import serve_in_actor
    from opentinker.rl import RLJob

    checkpoint = RLJob(tiny_spec(tmp_path, optimization={"steps": 1}), job_id="to-serve").run().checkpoint.url
    server = serve_in_actor(checkpoint, InferenceSpec(model_path=checkpoint), "served", "key", 16)
    try:
        assert server.alive() and server.info["gpu_ids"] == []
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                            headers={"Authorization": "Bearer key"}, timeout=60, trust_env=False)
        assert answer.status_code == 200 and answer.json()["model"] == "served"
    finally:
        server.stop()
    assert not server.alive()
    with pytest.raises(RuntimeError, match=r"^num_gpus: the inference job needs 3 GPU\(s\), the Ray cluster has 2$"):
        serve_in_actor(checkpoint, InferenceSpec(model_path=checkpoint, num_gpus=3, engine="vllm"), "big", "key", 16)
