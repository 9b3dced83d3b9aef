"""`opentinker` command line: validate a spec, run a job in this process with live progress."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from opentinker.cli_env import env_app
from opentinker.cli_models import models_app
from opentinker.inference.cli import serve
from opentinker.spec import JobSpec, SpecError, load_spec

app = typer.Typer(add_completion=False, no_args_is_help=True, help="OpenTinker: agentic RL as a service.")
console = Console()


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load(path: Path, steps: Optional[int] = None) -> JobSpec:
    try:
        spec = load_spec(path)
    except FileNotFoundError:
        console.print(f"[red]spec not found:[/] {path}")
        raise typer.Exit(2)
    except SpecError as err:
        console.print(f"[red]invalid spec {path}:[/]")
        for line in str(err).splitlines():
            console.print(f"  {line}", markup=False)
        raise typer.Exit(2)
    if steps is not None:
        spec = spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": steps})})
    return spec


@app.command()
def validate(spec_path: Path = typer.Argument(..., help="job spec YAML")) -> None:
    """Check a job spec without running anything."""
    spec = _load(spec_path)
    console.print(f"[green]ok[/] {spec_path}: {spec.model.name}, {spec.adapter.kind}, {spec.algorithm.advantage}, {spec.optimization.steps} steps")


def _fmt(value: Optional[float], pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if pct else f"{value:.2f}"


def _step_progress(label: str) -> Progress:
    """step n/N, bar, reward/accuracy summary, elapsed and ETA."""
    return Progress(
        TextColumn(label), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[summary]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
    )


@app.command()
def run(
    spec_path: Path = typer.Argument(..., help="job spec YAML"),
    steps: Optional[int] = typer.Option(None, help="override optimization.steps"),
    job_id: Optional[str] = typer.Option(None, help="job id; re-running the same id resumes from its last checkpoint"),
) -> None:
    """Train in this process (no scheduler): rollout → update → evaluate → checkpoint, with live progress."""
    spec = _load(spec_path, steps)
    _quiet_libraries()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from opentinker.runner import LocalJob
    from opentinker.storage import StorageError

    console.print(f"[bold]OpenTinker[/] {spec.model.name} · {spec.adapter.kind} · {spec.algorithm.advantage} · env {spec.env.label}")
    try:
        with console.status("loading model (first use of smollm2 converts its GGUF once, ≈30 s)"):
            job = LocalJob(spec, job_id=job_id)  # checks its storage first, before the model loads
    except StorageError as err:
        console.print(str(err), style="red", markup=False, soft_wrap=True)  # one line, however long
        raise typer.Exit(1)
    console.print(f"job [cyan]{job.job_id}[/], checkpoints under {spec.checkpoint.base_url}/{job.job_id}")

    state = {"acc": None, "reward": None}
    progress = _step_progress("[bold]step")

    def summary() -> str:
        return f"reward {_fmt(state['reward'])} · val acc {_fmt(state['acc'], pct=True)}"

    def on_eval(ev) -> None:
        m = ev.metrics
        state["acc"] = m.get("eval/accuracy")
        extra = ""
        if "eval/format_ok" in m:
            extra += f" · format {_fmt(m['eval/format_ok'], pct=True)}"
        if "eval/distinct_answer_share" in m:
            extra += f" · distinct answers {_fmt(m['eval/distinct_answer_share'], pct=True)}"
        progress.console.print(f"[magenta]eval @ step {ev.step}[/]: accuracy {_fmt(state['acc'], pct=True)} · reward {_fmt(m['eval/reward_mean'])}{extra}")
        progress.update(task, summary=summary())

    def on_step(report) -> None:
        m = report.metrics
        state["reward"] = m["rollout/reward_mean"]
        progress.console.print(
            f"step {report.step:>3}/{report.total_steps}: reward {_fmt(m['rollout/reward_mean'])} "
            f"(failed {int(m['rollout/failed_episodes'])}) · loss {_fmt(m.get('update/policy_loss'))} · "
            f"entropy {_fmt(m.get('update/entropy'))} · {m['rollout/tokens_per_s']:.0f} tok/s · {m['step/seconds']:.1f}s"
            + (f" · checkpoint step {report.checkpoint.step}" if report.checkpoint else "")
        )
        progress.update(task, completed=report.step, summary=summary())

    with progress:
        task = progress.add_task("train", total=spec.optimization.steps, summary=summary())
        result = job.run(on_step=on_step, on_eval=on_eval)

    table = Table(title=f"job {result.job_id}", show_header=False)
    table.add_row("steps", f"{result.steps_done} (resumed from {result.resumed_from})" if result.resumed_from else str(result.steps_done))
    if result.evaluations:
        first, last = result.evaluations[0].metrics, result.evaluations[-1].metrics
        table.add_row("validation accuracy", f"{_fmt(first.get('eval/accuracy'), True)} → {_fmt(last.get('eval/accuracy'), True)}")
    table.add_row("wall time", f"{result.seconds:.0f} s")
    table.add_row("checkpoint", result.checkpoint.url if result.checkpoint else "-")
    console.print(table)


def _settings_and_env():
    """Settings, exported for the Prefect/MLflow clients before either library is imported."""
    from opentinker.settings import get_settings
    from opentinker.stack import mlflow_env, prefect_env

    settings = get_settings()
    os.environ.update(prefect_env(settings) | mlflow_env(settings))
    return settings


def _status_table(status) -> Table:
    table = Table(title="OpenTinker stack")
    for col in ("service", "running", "healthy", "pid", "url"):
        table.add_column(col)
    for s in status.values():
        table.add_row(s.name, "yes" if s.running else "no", "yes" if s.healthy else "no", str(s.pid or "-"), s.url or "-")
    return table


def _bring_up(settings, deploy: bool):
    from opentinker.stack import Stack, StackError

    try:
        with console.status("starting the stack (Prefect server + worker, MLflow) on loopback"):
            status = Stack(settings).up()
    except StackError as err:
        console.print(f"stack: {err}", style="red", markup=False)
        raise typer.Exit(1)
    from opentinker.submit import deploy as deploy_all, deployed

    if deploy or not deployed(settings):
        with console.status("registering pools, slot limits and deployments"):
            deploy_all(settings)
    return status


def _stack_for_a_job(settings) -> None:
    """Before submitting: the Ray cluster the settings name must answer, then the stack is up."""
    from opentinker.submit import check_ray_address

    try:
        check_ray_address(settings.ray_address)
    except ConnectionError as err:
        console.print(f"ray: {err}", style="red", markup=False)
        raise typer.Exit(1)
    _bring_up(settings, deploy=False)


def _submit_to_pool(spec, job_id: str, settings) -> str:
    """Queue the job on its deployment (routed by the spec's kind); its flow-run id, or exit 2."""
    from opentinker.scheduler import SchedulingError
    from opentinker.submit import submit_rl_job

    try:
        return submit_rl_job(spec.model_dump(mode="json"), job_id, settings)
    except SchedulingError as err:
        console.print(f"cannot schedule: {err}", style="red", markup=False)
        raise typer.Exit(2)


@app.command()
def up() -> None:
    """Start (or reuse) the embedded stack on 127.0.0.1 and register the deployments."""
    settings = _settings_and_env()
    _quiet_libraries()
    console.print(_status_table(_bring_up(settings, deploy=True)))


@app.command()
def down() -> None:
    """Stop the embedded stack."""
    from opentinker.stack import Stack

    Stack(_settings_and_env()).down()
    console.print("stack stopped")


@app.command()
def status() -> None:
    """Show which services of the embedded stack run, with their URLs."""
    from opentinker.stack import Stack

    console.print(_status_table(Stack(_settings_and_env()).status()))


@app.command(name="deploy")
def deploy_cmd() -> None:
    """Create/resize the gpu and cpu work pools and slot limits, and register the deployments."""
    settings = _settings_and_env()
    _quiet_libraries()
    from opentinker.scheduler import capacity
    from opentinker.submit import deploy as deploy_all

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

    from opentinker.scheduler import POOLS
    from opentinker.stack import mlflow_env, prefect_env, settings_env

    if pool not in POOLS:
        console.print(f"--pool: must be one of {', '.join(POOLS)}", style="red")
        raise typer.Exit(2)
    settings = _settings_and_env()
    env = {**os.environ, **settings_env(settings), **prefect_env(settings), **mlflow_env(settings)}
    command = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process",
               "--name", f"opentinker-{pool}-{os.uname().nodename}", "--install-policy", "never"]
    raise typer.Exit(subprocess.call(command, env=env))


app.add_typer(env_app, name="env")
app.add_typer(models_app, name="models")
app.command(name="serve")(serve)

tenant_app = typer.Typer(help="Tenants and their API keys (stored hashed in the state folder).", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")


@tenant_app.command("add")
def tenant_add(name: str, rotate: bool = typer.Option(False, help="replace the key of an existing tenant")) -> None:
    """Create a tenant and print its API key once (it is stored only as a hash)."""
    from opentinker.gateway.tenants import TenantStore

    settings = _settings_and_env()
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
    from opentinker.gateway.tenants import TenantStore

    for name in TenantStore(_settings_and_env().state_dir / "tenants.json").names():
        print(name)


@app.command()
def train(
    spec_path: Path = typer.Argument(..., help="job spec YAML"),
    steps: Optional[int] = typer.Option(None, help="override optimization.steps"),
    job_id: Optional[str] = typer.Option(None, help="job id; submitting the same id again resumes it"),
) -> None:
    """Submit a training job to the stack (started if needed) and follow it until it ends."""
    spec = _load(spec_path, steps)
    settings = _settings_and_env()
    _quiet_libraries()
    from opentinker.submit import follow

    _stack_for_a_job(settings)
    from opentinker.runner import new_job_id

    job_id = job_id or new_job_id(spec)
    flow_run_id = _submit_to_pool(spec, job_id, settings)
    prefect_link = f"{settings.prefect_ui_url}/runs/flow-run/{flow_run_id}"
    console.print(f"submitted job [cyan]{job_id}[/] · Prefect {prefect_link}")
    progress = _step_progress("[bold]{task.fields[state]}")
    with progress:
        bar = progress.add_task("train", total=spec.optimization.steps, state="QUEUED", summary="")

        seen_eval = {"step": None}

        def on_update(p) -> None:
            summary = f"reward {_fmt(p.reward)} · val acc {_fmt(p.accuracy, pct=True)}"
            progress.update(bar, completed=p.step, state=p.state, summary=summary)
            if p.accuracy_step is not None and p.accuracy_step != seen_eval["step"]:
                seen_eval["step"] = p.accuracy_step
                progress.console.print(f"[magenta]eval @ step {p.accuracy_step}[/]: validation accuracy {_fmt(p.accuracy, pct=True)}")

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
        lines["validation accuracy"] = _fmt(final.accuracy, pct=True)
    for key, value in lines.items():  # plain lines: links stay whole and clickable
        console.print(f"  {key}: {value}", markup=False, soft_wrap=True)
    if final.state != "COMPLETED":
        console.print(f"job {final.state.lower()}: {(final.message or '').splitlines()[0] if final.message else 'no message'}", style="red", markup=False)
        raise typer.Exit(1)


from opentinker.sft_cli import sft as _sft_command  # noqa: E402 - the command lives beside the SFT job

app.command(name="sft")(_sft_command)


def main() -> None:  # pragma: no cover - console entry point
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
