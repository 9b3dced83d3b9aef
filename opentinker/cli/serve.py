"""`opentinker serve CHECKPOINT`: serve a checkpoint in the foreground, no scheduler involved."""

from __future__ import annotations

import time

import typer
from rich.console import Console

console = Console()


def serve(
    checkpoint: str = typer.Argument(..., help="step folder, job folder (latest complete step) or models:/<name>@<alias>"),
    host: str | None = typer.Option(None, help="interface to bind (default: the stack's host, 127.0.0.1)"),
    port: int = typer.Option(8000, help="port (0: any free port)"),
    name: str = typer.Option("policy", help="model id clients put in `model`"),
    engine: str = typer.Option("auto", help="auto (vllm with GPUs, and on a CPU where vLLM runs the model; else hf), hf or vllm"),
    num_gpus: float = typer.Option(0, help="GPUs for vLLM"),
    max_model_len: int | None = typer.Option(None, help="context length to serve (default: the model's)"),
) -> None:
    """Serve a trained checkpoint behind an OpenAI-compatible API until Ctrl-C."""
    from opentinker.inference.engine_hf import ModelLoadError
    from opentinker.inference.launch import launch
    from opentinker.inference.spec import InferenceSpec
    from opentinker.core.settings import get_settings

    try:
        spec = InferenceSpec(model_path=checkpoint, num_gpus=num_gpus, engine=engine, max_model_len=max_model_len)
    except ValueError as err:
        console.print(f"[red]invalid options:[/] {err}")
        raise typer.Exit(2)
    try:
        cap = get_settings().max_tokens_cap  # OPENTINKER_MAX_TOKENS_CAP
        with console.status(f"loading {checkpoint}"):
            server = launch(checkpoint, spec, host or get_settings().host, port, name=name, max_tokens_cap=cap)
    except (ModelLoadError, RuntimeError, ValueError, OSError) as err:
        console.print(f"cannot serve: {err}", style="red", markup=False)
        raise typer.Exit(1)
    console.print(f"serving [cyan]{server.model}[/] ({server.engine}) at [bold]{server.url}/v1[/], completions of at most {cap} tokens "
                  "(the length of one that gives no max_tokens, context allowing)  (Ctrl-C stops)")
    try:
        while server.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
