"""Real vLLM servers for the test session, one per (model folder, way of taking weights), started at
first use (30-60 s each on the 2-core CPU) and stopped when the session ends. Skipped, with the
reason, where vLLM cannot run (no `.venv-vllm`, or a CPU without AVX-512)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    import torch

    from opentinker.inference.engine_vllm import VLLMUnavailable, check_available

    try:
        check_available(int(torch.cuda.is_available()))
    except VLLMUnavailable as err:
        return str(err)
    return None


class VLLMPool:
    def __init__(self):
        self.running: dict[tuple[str, str], object] = {}

    def get(self, folder: str, weights: str = "lora", max_rank: int = 8):
        """A server on `folder`, named "base", taking adapters by name (`lora`) or merged weights."""
        import torch

        from opentinker.inference.engine_vllm import VLLMServer, adapter_server_args, merged_server_args
        from opentinker.inference.launch import free_port

        if (folder, weights) not in self.running:
            workdir = Path(tempfile.mkdtemp(prefix="vllm-test-"))
            if weights == "merged":
                args, env = merged_server_args(folder, None, "float32", workdir, "base")
            else:
                args, env = adapter_server_args(folder, None, "float32", max_rank, workdir, "base"), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
            self.running[(folder, weights)] = VLLMServer(args, "127.0.0.1", free_port("127.0.0.1"), "base", workdir,
                                                         num_gpus=int(torch.cuda.is_available()), env=env)
        return self.running[(folder, weights)]

    def stop(self) -> None:
        for server in self.running.values():
            server.stop()
        self.running.clear()


@pytest.fixture(scope="session")
def vllm_pool():
    if reason := vllm_missing():
        pytest.skip(reason)
    pool = VLLMPool()
    yield pool
    pool.stop()
