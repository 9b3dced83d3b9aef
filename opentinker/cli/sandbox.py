"""`opentinker sandbox`: serve SandboxFusion's `/run_code` from the bubblewrap sandbox, for its owner."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

console = Console()


def sandbox(
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port: int = typer.Option(8310, help="port (0: any free port)"),
    max_running: Optional[int] = typer.Option(None, help="programs running at once (default: its CPUs)"),
    key_file: Optional[Path] = typer.Option(None, help="read the key from this file (the stack's: <state_dir>/sandbox-key); "
                                                         "what is printed then names the file, not the key"),
) -> None:
    """Serve SandboxFusion's API (POST /run_code; python) until Ctrl-C. Its key is --key-file's, else
    OPENTINKER_SANDBOX_KEY, else a new one: the endpoint URL printed (http://HOST:PORT/k/KEY) carries it, for
    sandbox_fusion's client and verl; others may send `Authorization: Bearer KEY` to http://HOST:PORT/run_code."""
    from opentinker.tools.sandbox import Sandbox, SandboxLimits
    from opentinker.tools.sandbox_service import KEY_ENV, new_key, serve_in_thread

    limits = SandboxLimits() if max_running is None else SandboxLimits(max_running=max(1, max_running))
    try:
        runner = Sandbox(limits)
    except RuntimeError as err:
        console.print(f"cannot serve: {err}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    try:
        key = key_file.read_text().strip() if key_file is not None else (os.environ.get(KEY_ENV) or new_key())
    except OSError as err:
        console.print(f"cannot read the key: {err}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    if not key:
        console.print(f"cannot serve: the key file {key_file} is empty", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    try:
        service = serve_in_thread(runner, key, host, port)
    except (OSError, RuntimeError, TimeoutError) as err:
        console.print(f"cannot serve on {host}:{port}: {err}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    shown = f"{service.url}/k/$(cat {shlex.quote(str(key_file))})" if key_file is not None else service.endpoint
    print(f"sandbox (SandboxFusion API, python, {limits.max_running} at once) at {shown}  (the URL holds its key; Ctrl-C stops)",
          flush=True)
    try:
        while service.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
