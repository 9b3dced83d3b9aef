"""Start serving a checkpoint with the engine its hardware calls for; used by the flow and the CLI."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path
from typing import Any

from opentinker.inference.spec import InferenceSpec


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_engine(spec: InferenceSpec) -> None:
    """Fail before any slot is taken when this worker cannot run the engine."""
    if spec.engine_kind == "vllm":
        from opentinker.inference.engine_vllm import check_available

        check_available()
    elif spec.num_gpus > 0:
        raise ValueError("engine 'hf' serves on CPU: ask for num_gpus=0, or engine 'vllm' for GPUs")


def launch(checkpoint_url: str, spec: InferenceSpec, host: str, port: int = 0, name: str = "policy",
           api_key: str | None = None, max_tokens_cap: int = 2048) -> Any:
    """A running server for a checkpoint (URL, job folder or registry URI): a handle with `url`, `model`,
    `engine`, `alive()` and `stop()`. With `api_key` it answers only requests that carry it; a
    completion is at most `max_tokens_cap` tokens. Raises ModelLoadError when the checkpoint cannot be served."""
    check_engine(spec)
    if spec.engine_kind == "vllm":
        from opentinker.inference.engine_hf import ModelLoadError
        from opentinker.inference.engine_vllm import VLLMServer
        from opentinker.storage.resolve import resolve_checkpoint

        try:
            checkpoint_url = resolve_checkpoint(checkpoint_url)
        except Exception as err:  # any cause: one clear message naming the checkpoint
            raise ModelLoadError(f"cannot serve {checkpoint_url}: {type(err).__name__}: {err}") from err
        workdir = Path(tempfile.mkdtemp(prefix=f"opentinker-serve-{name}-"))
        return VLLMServer(checkpoint_url, host, port or free_port(host), name, workdir,
                          num_gpus=spec.num_gpus, max_model_len=spec.max_model_len, api_key=api_key)
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread

    engine = HFEngine.from_checkpoint(checkpoint_url, max_model_len=spec.max_model_len)
    app = create_app(engine, name, api_key=api_key, max_tokens_cap=max_tokens_cap)
    return serve_in_thread(app, host, port, model=name, engine="hf", close=engine.close)
