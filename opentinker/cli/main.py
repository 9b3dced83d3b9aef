"""The `opentinker` command: validate and run jobs (in this process or on the stack), the
stack itself (up, down, status, deploy, worker), tenants, and the sub-commands (env, models,
serve, sft)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from opentinker.cli.common import (bring_up, console, fmt, load_job_spec, quiet_libraries, settings_and_env, stack_for_a_job,
                                   status_table, step_progress, submit_to_pool)
from opentinker.cli.env import env_app
from opentinker.cli.models import models_app
from opentinker.cli.serve import serve
from opentinker.cli.sft import sft

app = typer.Typer(add_completion=False, no_args_is_help=True, help="OpenTinker: agentic RL as a service.")
app.add_typer(env_app, name="env")
app.add_typer(models_app, name="models")
app.command(name="serve")(serve)
app.command(name="sft")(sft)


@app.command()
def validate(spec_path: Path = typer.Argument(..., help="job spec YAML")) -> None:
    """Check a job spec without running anything."""
    spec = load_job_spec(spec_path)
    console.print(f"[green]ok[/] {spec_path}: {spec.model.name}, {spec.adapter.kind}, {spec.algorithm.advantage}, {spec.optimization.steps} steps")


@app.command()
def run(
    spec_path: Path = typer.Argument(..., help="job spec YAML"),
    steps: Optional[int] = typer.Option(None, help="override optimization.steps"),
    job_id: Optional[str] = typer.Option(None, help="job id; re-running the same id resumes from its last checkpoint"),
) -> None:
    """Train in this process (no scheduler): rollout → update → evaluate → checkpoint, with live progress."""
    spec = load_job_spec(spec_path, steps)
    quiet_libraries()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from opentinker.rl import RLJob
    from opentinker.storage.preflight import StorageError

    console.print(f"[bold]OpenTinker[/] {spec.model.name} · {spec.adapter.kind} · {spec.algorithm.advantage} · env {spec.env.label}")
    try:
        with console.status("loading model (first use of smollm2 converts its GGUF once, ≈30 s)"):
            job = RLJob(spec, job_id=job_id)  # checks its storage first, before the model loads
    except StorageError as err:
        console.print(str(err), style="red", markup=False, soft_wrap=True)  # one line, however long
        raise typer.Exit(1)
    console.print(f"job [cyan]{job.job_id}[/], checkpoints under {spec.checkpoint.base_url}/{job.job_id}")

    state = {"acc": None, "reward": None}
    progress = step_progress("[bold]step")

    def summary() -> str:
        return f"reward {fmt(state['reward'])} · val acc {fmt(state['acc'], pct=True)}"

    def on_eval(ev) -> None:
        m = ev.metrics
        state["acc"] = m.get("eval/accuracy")
        extra = ""
        if "eval/format_ok" in m:
            extra += f" · format {fmt(m['eval/format_ok'], pct=True)}"
        if "eval/distinct_answer_share" in m:
            extra += f" · distinct answers {fmt(m['eval/distinct_answer_share'], pct=True)}"
        progress.console.print(f"[magenta]eval @ step {ev.step}[/]: accuracy {fmt(state['acc'], pct=True)} · reward {fmt(m['eval/reward_mean'])}{extra}")
        progress.update(task, summary=summary())

    def on_step(report) -> None:
        m = report.metrics
        state["reward"] = m["rollout/reward_mean"]
        progress.console.print(
            f"step {report.step:>3}/{report.total_steps}: reward {fmt(m['rollout/reward_mean'])} "
            f"(failed {int(m['rollout/failed_episodes'])}) · loss {fmt(m.get('update/policy_loss'))} · "
            f"entropy {fmt(m.get('update/entropy'))} · {m['rollout/tokens_per_s']:.0f} tok/s · {m['step/seconds']:.1f}s"
            + (f" · checkpoint step {report.checkpoint.step}" if report.checkpoint else "")
        )
        progress.update(task, completed=report.step, summary=summary())

    with progress:
        task = progress.add_task("train", total=spec.optimization.steps, summary=summary())
        result = job.run(on_step=on_step, on_eval=on_eval)

    table = Table(title=f"job {job.job_id}", show_header=False)
    table.add_row("steps", f"{result.steps_done} (resumed from {result.resumed_from})" if result.resumed_from else str(result.steps_done))
    if result.evaluations:
        first, last = result.evaluations[0].metrics, result.evaluations[-1].metrics
        table.add_row("validation accuracy", f"{fmt(first.get('eval/accuracy'), True)} → {fmt(last.get('eval/accuracy'), True)}")
    table.add_row("wall time", f"{result.seconds:.0f} s")
    table.add_row("checkpoint", result.checkpoint.url if result.checkpoint else "-")
    console.print(table)


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

    console.print(status_table(Stack(settings_and_env()).status()))


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
def worker(pool: str = typer.Option("cpu", help="work pool to poll: gpu or cpu")) -> None:
    """Run a Prefect process worker for a pool in the foreground, with this stack's settings."""
    import subprocess

    from opentinker.control.scheduler import POOLS
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env

    if pool not in POOLS:
        console.print(f"--pool: must be one of {', '.join(POOLS)}", style="red")
        raise typer.Exit(2)
    settings = settings_and_env()
    env = {**os.environ, **settings_env(settings), **prefect_env(settings), **mlflow_env(settings)}
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
               "--name", f"opentinker-{pool}-{os.uname().nodename}", "--install-policy", "never"]
    raise typer.Exit(subprocess.call(command, env=env))


tenant_app = typer.Typer(help="Tenants and their API keys (stored hashed in the state folder).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")


@tenant_app.command("add")
def tenant_add(name: str, rotate: bool = typer.Option(False, help="replace the key of an existing tenant")) -> None:
    """Create a tenant and print its API key once (it is stored only as a hash)."""
    from opentinker.control.gateway.tenants import TenantStore

    settings = settings_and_env()
    try:
        key = TenantStore(settings.state_dir / "tenants.json").create(name, rotate=rotate)
    except ValueError as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
    console.print(f"tenant [cyan]{name}[/]; API key (shown once, keep it secret):")
    print(key)


@tenant_app.command("list")
def tenant_list() -> None:
    """Tenant names (keys are not recoverable)."""
    from opentinker.control.gateway.tenants import TenantStore

    for name in TenantStore(settings_and_env().state_dir / "tenants.json").names():
        print(name)


@app.command()
def train(
    spec_path: Path = typer.Argument(..., help="job spec YAML"),
    steps: Optional[int] = typer.Option(None, help="override optimization.steps"),
    job_id: Optional[str] = typer.Option(None, help="job id; submitting the same id again resumes it"),
) -> None:
    """Submit a training job to the stack (started if needed) and follow it until it ends."""
    spec = load_job_spec(spec_path, steps)
    settings = settings_and_env()
    quiet_libraries()
    from opentinker.control.submit import follow

    stack_for_a_job(settings)
    from opentinker.core.ids import new_job_id

    job_id = job_id or new_job_id(spec)
    flow_run_id = submit_to_pool(spec, job_id, settings)
    prefect_link = f"{settings.prefect_ui_url}/runs/flow-run/{flow_run_id}"
    console.print(f"submitted job [cyan]{job_id}[/] · Prefect {prefect_link}")
    progress = step_progress("[bold]{task.fields[state]}")
    with progress:
        bar = progress.add_task("train", total=spec.optimization.steps, state="QUEUED", summary="")

        seen_eval = {"step": None}

        def on_update(p) -> None:
            summary = f"reward {fmt(p.reward)} · val acc {fmt(p.accuracy, pct=True)}"
            progress.update(bar, completed=p.step, state=p.state, summary=summary)
            if p.accuracy_step is not None and p.accuracy_step != seen_eval["step"]:
                seen_eval["step"] = p.accuracy_step
                progress.console.print(f"[magenta]eval @ step {p.accuracy_step}[/]: validation accuracy {fmt(p.accuracy, pct=True)}")

        final = follow(flow_run_id, job_id, settings, on_update)
    console.print(f"job {job_id}: {final.state}", style="bold")
    lines = {
        "Prefect run": prefect_link,
        "MLflow run": final.mlflow_run_url or "-",
    }
    if per_agent := final.result.get("checkpoints"):  # a self-play job: one checkpoint per learning agent
        lines |= {f"checkpoint {agent}": url for agent, url in per_agent.items()}
    else:
        lines["checkpoint"] = final.result.get("checkpoint") or f"{spec.checkpoint.base_url}/{job_id}"
    if final.accuracy is not None:
        lines["validation accuracy"] = fmt(final.accuracy, pct=True)
    for key, value in lines.items():  # plain lines: links stay whole and clickable
        console.print(f"  {key}: {value}", markup=False, soft_wrap=True)
    if final.state != "COMPLETED":
        console.print(f"job {final.state.lower()}: {(final.message or '').splitlines()[0] if final.message else 'no message'}", style="red", markup=False)
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console entry point
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
