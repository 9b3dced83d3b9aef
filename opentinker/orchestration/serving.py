"""An inference job's server in a Ray actor holding the job's GPUs.

Ray gives the actor distinct devices (its GPU ids, exported as CUDA_VISIBLE_DEVICES to the actor
and to what it starts: vLLM's child process sees only those), so two 1-GPU inference jobs, or an
inference job beside a training job, never share a device. The server binds this node's listen
address and is published under the address other machines dial.
"""

from __future__ import annotations

import os
from typing import Any

from opentinker.inference.spec import InferenceSpec


def serving_options(spec: InferenceSpec, name: str) -> dict[str, Any]:
    """Ray options of a serving actor: the job's GPUs, one CPU, no restarts (a crashed server
    fails the job, which says so)."""
    return {"name": name, "num_gpus": spec.num_gpus, "num_cpus": 1, "max_restarts": 0}


def devices() -> dict[str, Any]:
    """The GPUs this process holds: Ray's ids and what CUDA will show it."""
    import ray

    return {"gpu_ids": [str(i) for i in ray.get_gpu_ids()], "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


class ServingActor:
    """Serves a checkpoint from inside the actor (see `opentinker.inference.launch.launch`)."""

    def __init__(self, checkpoint: str, spec: InferenceSpec, name: str, api_key: str, max_tokens_cap: int):
        from opentinker.core.settings import get_settings
        from opentinker.inference.launch import launch

        settings = get_settings()
        self.server = launch(checkpoint, spec, settings.listen_host, 0, name=name, api_key=api_key, max_tokens_cap=max_tokens_cap)
        self.url = settings.advertised_url(self.server.url)

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.server.model, "engine": self.server.engine, **devices()}

    def alive(self) -> bool:
        return self.server.alive()

    def stop(self) -> None:
        self.server.stop()


class RemoteServer:
    """The flow's handle on a serving actor: `url`, `model`, `engine`, `alive()`, `stop()` like a
    server started in-process."""

    def __init__(self, handle: Any, info: dict[str, Any]):
        self.handle, self.info = handle, info
        self.url, self.model, self.engine = info["url"], info["model"], info["engine"]

    def alive(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.handle.alive.remote(), timeout=60))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.handle.stop.remote(), timeout=60)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        ray.kill(self.handle)


def serve_in_actor(checkpoint: str, spec: InferenceSpec, name: str, api_key: str, max_tokens_cap: int,
                   start_timeout_s: float = 1800.0) -> RemoteServer:
    """Start the serving actor on the Ray cluster this process is connected to (one line when the
    cluster has too few GPUs: Ray would wait forever), and wait until its server answers."""
    import ray

    have = ray.cluster_resources().get("GPU", 0)
    if spec.num_gpus > have:
        raise RuntimeError(f"num_gpus: the inference job needs {spec.num_gpus:g} GPU(s), the Ray cluster has {have:g}")
    handle = ray.remote(ServingActor).options(**serving_options(spec, f"{name}-server")).remote(
        checkpoint, spec, name, api_key, max_tokens_cap)
    try:
        info = ray.get(handle.info.remote(), timeout=start_timeout_s)
    except BaseException:
        ray.kill(handle)
        raise
    return RemoteServer(handle, info)
