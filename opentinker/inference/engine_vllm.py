"""The GPU serving engine: vLLM's own OpenAI-compatible server (`vllm serve`) in a child process.

A LoRA checkpoint on a plain base model is served as the base plus the adapter through vLLM's
LoRA support (`--enable-lora --lora-modules`), under the job's model name; the base stays
reachable as `<name>-base`. Anything else (a full fine-tune, or a LoRA whose base was itself a
trained policy via `init_from`) is merged with `load_policy` and served as one model folder.
Weights are served in the dtype they were trained in, so greedy answers match the job's.

vLLM lives in an environment of its own on GPU workers: it pins the fastapi, torch and
transformers it was built with, and those cannot share one environment with Prefect 3.8
(fastapi <0.137 against >=0.139). Only its `vllm` command is used: `OPENTINKER_VLLM` names it
(the GPU worker image sets /opt/vllm/bin/vllm), else the one beside this Python, else the PATH's.
`check_available` says plainly what is missing before any slot is taken or any file is fetched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from opentinker.core.polling import wait_for
from opentinker.inference.engine_hf import ModelLoadError

# Ranks vLLM accepts for --max-lora-rank (LoRAConfig.max_lora_rank is a closed set).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMUnavailable(RuntimeError):
    """This worker cannot run vLLM (no GPU, or the package is not installed)."""


INSTALL_HINT = "python -m venv /opt/vllm && /opt/vllm/bin/pip install vllm==0.33.0, then OPENTINKER_VLLM=/opt/vllm/bin/vllm"


def vllm_executable() -> str | None:
    """The `vllm` command this worker runs, or None: OPENTINKER_VLLM, else beside this Python, else on the PATH."""
    named = os.environ.get("OPENTINKER_VLLM")
    if named:
        return named if os.path.isfile(named) and os.access(named, os.X_OK) else None
    beside = Path(sys.executable).with_name("vllm")
    return str(beside) if beside.is_file() else shutil.which("vllm")


def check_available() -> None:
    from opentinker.core.hardware import detect_gpus

    if vllm_executable() is None:
        where = f"OPENTINKER_VLLM={os.environ['OPENTINKER_VLLM']} is not an executable file" if os.environ.get("OPENTINKER_VLLM") \
            else "no vllm command on this worker"
        raise VLLMUnavailable(f"engine 'vllm' needs the vllm package on the worker ({where}; GPU machines only: {INSTALL_HINT}); "
                              "serve on CPU with engine 'hf'")
    if detect_gpus() == 0:
        raise VLLMUnavailable("engine 'vllm' needs a CUDA GPU, and nvidia-smi lists none on this worker; "
                              "serve on CPU with engine 'hf' (num_gpus=0)")


def _lora_rank(r: int) -> int:
    for rank in LORA_RANKS:
        if rank >= r:
            return rank
    raise ModelLoadError(f"LoRA rank {r} is above the largest rank vLLM serves ({LORA_RANKS[-1]})")


def model_args(checkpoint_url: str, workdir: Path, name: str) -> list[str]:
    """`vllm serve` arguments that serve the checkpoint under `name` (files are made local in `workdir`)."""
    import fsspec

    from opentinker.model.loading import resolve_model
    from opentinker.model.policy import load_policy, read_policy_info

    info = read_policy_info(checkpoint_url)
    adapter = info.get("adapter") or {}
    fs, path = fsspec.core.url_to_fs(checkpoint_url)
    path = path.rstrip("/")
    dtype = ["--dtype", info.get("dtype", "auto")]
    if adapter.get("kind", "lora") == "lora" and not info.get("init_from") and fs.exists(f"{path}/adapter/adapter_config.json"):
        local = workdir / "adapter"
        fs.get(f"{path}/adapter/", str(local) + "/", recursive=True)
        base = f"{name}-base"
        module = {"name": name, "path": str(local), "base_model_name": base}
        return [str(resolve_model(info["base_model"])), "--served-model-name", base, *dtype,
                "--enable-lora", "--max-lora-rank", str(_lora_rank(int(adapter.get("r", 16)))),
                "--lora-modules", json.dumps(module)]
    model, tokenizer, _ = load_policy(checkpoint_url)
    merged = workdir / "model"
    model.save_pretrained(merged)
    tokenizer.save_pretrained(merged)
    del model
    return [str(merged), "--served-model-name", name, *dtype]


def adapter_server_args(model_name: str, init_from: str | None, dtype: str, max_rank: int, workdir: Path, name: str) -> list[str]:
    """`vllm serve` arguments for a job's rollout server: the job's base (merged with its
    `init_from` policy, if any) taking LoRA adapters at run time (`/v1/load_lora_adapter`; the
    process needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), with logprobs of the sampling
    distribution (after temperature), the ones the trainer scores."""
    from opentinker.model import load_model
    from opentinker.model.loading import resolve_model

    if init_from:
        model, tokenizer = load_model(model_name, dtype, init_from=init_from)
        base = workdir / "base"
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
        del model
    else:
        base = resolve_model(model_name)
    return [str(base), "--served-model-name", name, "--dtype", dtype, "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", str(_lora_rank(max_rank)), "--logprobs-mode", "processed_logprobs",
            "--gpu-memory-utilization", "0.4"]  # the trainer holds the rest of the job's GPU


# Linux: the child asks for SIGTERM when its parent dies (PR_SET_PDEATHSIG survives exec), so a
# flow process killed even by SIGKILL never leaves a GPU server behind. Done in the child itself,
# not through preexec_fn, which is unsafe in a process with threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM)\nexcept OSError:\n    pass\n"
    "os.execv(sys.argv[1], sys.argv[1:])"
)


class VLLMServer:
    """`vllm serve` as a child process; `url`, `alive()` and `stop()` like the CPU server's handle."""

    engine = "vllm"

    def __init__(self, serve_args: list[str], host: str, port: int, name: str, workdir: Path,
                 num_gpus: float = 1, max_model_len: int | None = None, timeout: float = 900.0, api_key: str | None = None,
                 env: dict[str, str] | None = None):
        """Start `vllm serve <serve_args>` (see `model_args`, `adapter_server_args`); the child
        sees this process's CUDA_VISIBLE_DEVICES, so it uses the GPUs Ray gave the job."""
        from opentinker.inference.server import advertised_host

        self.model = name
        self.url = f"http://{advertised_host(host)}:{port}"
        self.log = workdir / "vllm.log"
        command = [vllm_executable() or "vllm", "serve", *serve_args, "--host", host, "--port", str(port)]
        if max_model_len:
            command += ["--max-model-len", str(max_model_len)]
        if api_key:  # vLLM then asks every /v1 request for it
            command += ["--api-key", api_key]
        if num_gpus >= 2:
            command += ["--tensor-parallel-size", str(int(num_gpus))]
        with self.log.open("ab") as out:
            self._process = subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, *command], stdout=out, stderr=subprocess.STDOUT,
                                             env={**os.environ, **(env or {})})
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        def healthy() -> bool | None:
            if self._process.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise ModelLoadError(f"vllm serve exited with code {self._process.returncode}:\n{tail}")
            try:
                return True if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).is_success else None
            except httpx.HTTPError:
                return None

        try:
            wait_for(healthy, interval=1.0, timeout=timeout, what="vllm serve")
        except TimeoutError:
            self.stop()
            raise ModelLoadError(f"vllm serve did not become healthy within {timeout:g}s (log: {self.log})") from None

    def alive(self) -> bool:
        return self._process.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
