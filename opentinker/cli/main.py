"""The `opentinker` command: validate and run jobs (in this process or on the stack), the
stack itself (up, down, status, deploy, worker), tenants, and the sub-commands (env, models,
serve, sft)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from opentinker.cli.common import (bring_up, check_env_or_exit, console, load_any_spec, quiet_libraries, say_sandbox_left_out,
                                   settings_and_env, status_table)
from opentinker.cli.env import env_app
from opentinker.cli.job_verbs import cancel, job, jobs, logs
from opentinker.cli.jobs import follow, run, train
from opentinker.cli.models import models_app
from opentinker.cli.sandbox import sandbox
from opentinker.cli.serve import serve
from opentinker.cli.sft import sft

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="OpenTinker: agentic RL as a service.")
app.command()(run)
app.command()(train)
app.command()(follow)
app.command()(jobs)
app.command()(job)
app.command()(cancel)
app.command()(logs)
app.add_typer(env_app, name="env")
app.add_typer(models_app, name="models")
app.command(name="serve")(serve)
app.command(name="sft")(sft)
app.command(name="sandbox")(sandbox)


@app.command()
def validate(spec_path: Path = typer.Argument(..., help="job spec YAML")) -> None:
    """Check a job spec (RL or SFT) without running anything: fields, sizes, the model folder, and
    what the gateway checks of its environment (the game and its config, that its prompts fit)."""
    spec = load_any_spec(spec_path)
    if hasattr(spec, "optimization"):
        check_env_or_exit(spec_path, spec)
        console.print(f"[green]ok[/] {spec_path}: {spec.model.name}, {spec.adapter.kind}, {spec.algorithm.advantage}, {spec.optimization.steps} steps")
    else:
        console.print(f"[green]ok[/] {spec_path}: SFT of {spec.model.name}, {spec.adapter.kind}, {spec.training.epochs} epoch(s) on {spec.data.path}")


@app.command()
def up() -> None:
    """Start (or reuse) the embedded stack on 127.0.0.1 and register the deployments."""
    settings = settings_and_env()
    quiet_libraries()
    console.print(status_table(bring_up(settings, deploy=True)))


@app.command()
def down() -> None:
    """Stop the embedded stack."""
    from opentinker.control.stack import Stack

    Stack(settings_and_env()).down()
    console.print("stack stopped")


@app.command()
def status() -> None:
    """Show which services of the embedded stack run, with their URLs."""
    from opentinker.control.stack import Stack

    status = Stack(settings_and_env()).status()
    console.print(status_table(status))
    say_sandbox_left_out(status)


@app.command(name="deploy")
def deploy_cmd() -> None:
    """Create/resize the gpu and cpu work pools and slot limits, and register the deployments."""
    settings = settings_and_env()
    quiet_libraries()
    from opentinker.control.scheduler import capacity
    from opentinker.control.submit import deploy as deploy_all

    try:
        names = deploy_all(settings)
    except Exception as err:  # noqa: BLE001 - one clear line (e.g. the server is down)
        console.print(f"deploy failed: {type(err).__name__}: {err}", style="red", markup=False)
        raise typer.Exit(1)
    console.print(f"pools: gpu ({capacity(settings, 'gpu')} slots), cpu ({capacity(settings, 'cpu')} slots)")
    console.print("deployments: " + ", ".join(names))


@app.command()
def worker(pool: str = typer.Option("cpu", help="work pool to poll: gpu or cpu"),
           join: Optional[str] = typer.Option(None, help="host:port of the stack's Ray head: this machine also joins it as a Ray node"),
           num_gpus: Optional[int] = typer.Option(None, help="GPUs the Ray node declares (default: what Ray detects)"),
           num_cpus: Optional[int] = typer.Option(None, help="CPUs the Ray node declares (default: its cores)"),
           resources: Optional[str] = typer.Option(None, help='custom Ray resources of the node, JSON, e.g. \'{"node_b": 1}\''),
           name: Optional[str] = typer.Option(None, help="the Prefect worker's name (default: opentinker-<pool>-<host name>)")) -> None:
    """Run a Prefect process worker for a pool in the foreground, with this stack's settings; with
    --join, this machine also becomes a Ray node of the stack's head (one command per GPU machine).

    On another machine than the stack, OPENTINKER_HOST names the stack (default with --join: the
    head's host), OPENTINKER_SECRET is the stack's, and OPENTINKER_STORAGE_URL is shared (s3://…)."""
    import json
    import signal
    import subprocess

    from opentinker.control.node import NodeError, WorkerNode, check_shared_storage, is_this_machine
    from opentinker.control.scheduler import POOLS

    if pool not in POOLS:
        console.print(f"--pool: must be one of {', '.join(POOLS)}", style="red")
        raise typer.Exit(2)
    if join and "OPENTINKER_HOST" not in os.environ:
        os.environ["OPENTINKER_HOST"] = join.rpartition(":")[0]
    settings = settings_and_env()
    try:
        extra = json.loads(resources) if resources else {}
        if not isinstance(extra, dict) or not all(isinstance(v, (int, float)) for v in extra.values()):
            raise ValueError("must be a JSON object of numbers")
        check_shared_storage(settings, remote=bool(join) or not is_this_machine(settings.host))
    except (ValueError, NodeError) as err:
        console.print(f"worker: {'--resources: ' if isinstance(err, ValueError) else ''}{err}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the node and the worker on the way out
    if join is None:
        from opentinker.core.settings import mlflow_env, prefect_env, ray_env, settings_env

        env = {**os.environ, **settings_env(settings), **prefect_env(settings), **mlflow_env(settings), **ray_env(settings)}
        command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
                   "--name", name or f"opentinker-{pool}-{os.uname().nodename}", "--install-policy", "never"]
        raise typer.Exit(subprocess.call(command, env=env))
    node = WorkerNode(settings, pool, join, num_gpus, num_cpus, extra, name or "",
                      say=lambda line: console.print(f"worker: {line}", markup=False, soft_wrap=True))
    try:
        code = node.run()
    except (ConnectionError, NodeError) as err:
        console.print(f"worker: {err}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    raise typer.Exit(code)


tenant_app = typer.Typer(help="Tenants and their API keys (stored hashed in the state folder).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")


@tenant_app.command("add")
def tenant_add(name: str = typer.Argument(..., help="2-32 lowercase letters and digits, starting with a letter"),
               rotate: bool = typer.Option(False, help="replace the key of an existing tenant")) -> None:
    """Create a tenant and print its API key once (it is stored only as a hash)."""
    from opentinker.control.gateway.tenants import TenantStore

    settings = settings_and_env()
    try:
        key = TenantStore(settings.state_dir / "tenants.json").create(name, rotate=rotate)
    except ValueError as err:
        console.print(str(err), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2)
    console.print(f"tenant [cyan]{name}[/]; API key (shown once, keep it secret):")
    print(key)


@tenant_app.command("list")
def tenant_list() -> None:
    """Tenant names (keys are not recoverable). A name that breaks the naming rule (let in by an
    older version, e.g. with a trailing newline) is shown quoted: its key is refused; remove it."""
    from opentinker.control.gateway.tenants import TENANT_NAME, TenantStore

    for name in TenantStore(settings_and_env().state_dir / "tenants.json").names():
        print(name if TENANT_NAME.fullmatch(name) else f"{name!r} (not a valid name, its key is refused: "
                                                        f"opentinker tenant remove {name!r})")


@tenant_app.command("remove")
def tenant_remove(name: str = typer.Argument(..., help="the tenant, as `opentinker tenant list` shows it")) -> None:
    """Remove a tenant: its API key is revoked at once (its next request to the gateway, native or
    Tinker door, is a 401; `tenant add NAME` later makes a new key).

    Nothing else is touched. Jobs it queued or started are not cancelled and run to their end:
    the command lists those still queued or running (when the stack's Prefect server answers);
    cancel them in the Prefect UI (tag tenant:NAME). Its data stays until the operator deletes
    it: checkpoints and files under <storage>/tenants/NAME, the MLflow experiment NAME, registered
    models NAME-*. A tenant added later under the same name reaches all of it, so delete it first
    when the name goes to someone else."""
    from opentinker.control.gateway.confine import tenant_storage
    from opentinker.control.gateway.tenants import TenantStore, UnknownTenant

    settings = settings_and_env()
    try:
        TenantStore(settings.state_dir / "tenants.json").remove(name)
    except UnknownTenant as err:
        console.print(str(err), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2)
    say = lambda line: console.print(line, markup=False, soft_wrap=True, highlight=False)  # noqa: E731
    say(f"tenant {name!r} removed: its API key no longer authenticates")
    live = _live_jobs(settings, name)
    if live is None:
        say(f"jobs: not checked (the Prefect server at {settings.prefect_ui_url} does not answer); none is cancelled")
    elif live:
        say(f"jobs: {len(live)} still queued or running, not cancelled: {', '.join(live)}; "
            f"cancel them in the Prefect UI ({settings.prefect_ui_url}, tag tenant:{name})")
    else:
        say("jobs: none queued or running")
    say(f"data: left in place ({tenant_storage(settings, name)}, MLflow experiment {name}, registered models {name}-*); "
        "delete it before the name goes to someone else")


def _live_jobs(settings, tenant: str) -> Optional[list[str]]:
    """Ids of the tenant's jobs still queued or running, or None when Prefect does not answer."""
    import httpx

    try:
        httpx.get(f"{settings.prefect_api_url}/health", timeout=3.0).raise_for_status()
    except httpx.HTTPError:
        return None
    from opentinker.control.gateway.jobs import TenantJobs
    from opentinker.control.scheduler import job_state

    return sorted(job_id for job_id, run in TenantJobs(settings, tenant).latest_runs().items() if job_state(run)[0] in ("QUEUED", "RUNNING"))


def main() -> None:  # pragma: no cover - console entry point
    """Run the command; an unexpected failure is one line on the terminal and its traceback in
    the state folder's logs/cli.log."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - the user sees one line; the traceback is kept
        import traceback

        from opentinker.core.errors import one_line
        from opentinker.core.settings import get_settings

        log = get_settings().state_dir / "logs" / "cli.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(f"--- {' '.join(sys.argv)}\n{traceback.format_exc()}\n")
            where = f" (traceback in {log})"
        except OSError:
            where = ""
        console.print(f"error: {one_line(err)}{where}", style="red", markup=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
