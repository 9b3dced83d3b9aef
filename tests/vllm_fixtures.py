"""Real vLLM servers for the test session, one per (model folder, way of taking weights, dtype), started
at first use (25-75 s each on the 2-core CPU) and stopped when the session ends: at most three kept,
each holding about 3.1 GiB with its 1 GiB key/value cache (measured), fewer where the machine's free
memory would not hold another (a test that starts a server of its own asks `room()` first); and the tiny model in a shape vLLM's CPU
attention takes (heads of 32; the suite's tiny model has heads of 16). Skipped, with the reason,
where vLLM cannot run (no `.venv-vllm`, or a CPU without AVX-512)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    import torch

    from opentinker.backend.vllm_env import VLLMUnavailable, check_available

    try:
        check_available(int(torch.cuda.is_available()))
    except VLLMUnavailable as err:
        return str(err)
    return None


class VLLMPool:
    KEEP = 3  # servers alive at once (the least recently used goes first)
    ROOM_GIB = 4.0  # free memory one more server needs: its ~3.1 GiB and a margin

    def __init__(self):
        self.running: dict[tuple[str, str, str], object] = {}

    def room(self, servers: int = 1) -> None:
        """Stop the least recently used servers while the machine could not hold `servers` more."""
        import psutil

        while self.running and psutil.virtual_memory().available < servers * self.ROOM_GIB * 2**30:
            self._stop_oldest()

    def _stop_oldest(self) -> None:
        self.running.pop(next(iter(self.running))).stop()

    def discard(self, folder: str, weights: str = "lora", dtype: str = "float32") -> None:
        """Stop a server no later test asks for (or one a test broke)."""
        if (server := self.running.pop((folder, weights, dtype), None)) is not None:
            server.stop()

    def get(self, folder: str, weights: str = "lora", max_rank: int = 8, dtype: str = "float32"):
        """A server on `folder`, named "base", in `dtype`, taking adapters by name (`lora`) or merged weights;
        keyed as a job's own server is (`server.api_key`; `server.handle()` carries it)."""
        import secrets

        import torch

        from opentinker.inference.engine_vllm import VLLMServer, adapter_server_args, merged_server_args
        from opentinker.inference.launch import free_port

        key = (folder, weights, dtype)
        if key in self.running:
            self.running[key] = self.running.pop(key)  # now the most recently used
        else:
            while len(self.running) >= self.KEEP:
                self._stop_oldest()
            self.room()
            workdir = Path(tempfile.mkdtemp(prefix="vllm-test-"))
            if weights == "merged":
                args, env = merged_server_args(folder, None, dtype, workdir, "base")
            else:
                args, env = adapter_server_args(folder, None, dtype, max_rank, workdir, "base"), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
            self.running[key] = VLLMServer(args, "127.0.0.1", free_port("127.0.0.1"), "base", workdir,
                                           num_gpus=int(torch.cuda.is_available()), env=env, api_key=secrets.token_urlsafe(16))
        return self.running[key]

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


@pytest.fixture(scope="session")
def vllm_tiny_path(tmp_path_factory) -> str:
    """The tiny model with heads of 32 (2 heads, 1 key/value head), built once from the real tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from opentinker.model.loading import tokenizer_path

    folder = tmp_path_factory.mktemp("tiny-h32")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def lora_checkpoint(spec, job_id: str, scale: float = 0.1) -> str:
    """A saved LoRA checkpoint of `spec` whose adapter changes every greedy answer of the tiny random
    model (lora_B is zero at its start; seeded). At 0.1 the answers are far from ties; from 0.3 on, a
    few of 16 came within float32 noise of one and vLLM and the HF engine parted there (the
    logprobs' agreement is tests/test_vllm_rollouts.py's). Seeded whole (lora_A's draw too): the
    same checkpoint in every run, whatever ran before (unseeded, two answers of 16 were near-ties
    in about one run of five)."""
    import torch

    from opentinker.core.seeding import seed_everything
    from opentinker.env import environment_from_spec
    from opentinker.rl import Policy

    seed_everything(0)
    policy = Policy(spec, job_id=job_id)
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, weight in policy.model.named_parameters():
            if "lora_B" in name:
                weight.copy_(torch.randn(weight.shape, generator=draw) * scale)
    return policy.save(1, environment_from_spec(spec).state()).url
