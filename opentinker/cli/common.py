"""What the CLI's commands share: the console, quiet libraries, spec loading that exits with the
problems listed, the progress bar, and bringing the stack up before a job is submitted."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from opentinker.core.spec import JobSpec, SpecError, load_spec

console = Console()


def quiet_libraries() -> None:
    """No tokenizer fork warnings, FutureWarnings or transformers progress bars on the terminal."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def exit_invalid(kind: str, path: Path, err: SpecError) -> None:
    """Print `invalid <kind> <path>: field: reason` (one problem), or that header and one
    `field: reason` line per problem, then exit 2."""
    lines = str(err).splitlines() or ["<spec>: invalid"]
    if len(lines) == 1:  # a problem of the file itself already starts with its path
        where = "" if lines[0].startswith(f"{path}: ") else f"{path}: "
        console.print(f"invalid {kind} {where}{lines[0]}", style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2)
    console.print(f"invalid {kind} {path}:", style="red", markup=False, soft_wrap=True)
    for line in lines:
        console.print(f"  {line}", markup=False, soft_wrap=True)
    raise typer.Exit(2)


def load_any_spec(path: Path):
    """An RL or SFT spec (told apart by shape, as the scheduler routes them), or exit 2. The file
    is read and parsed once (opentinker.core.spec_limits bounds its size, nesting and aliases)."""
    from opentinker.core.spec import parse_spec, read_spec_yaml
    from opentinker.sft.spec import is_sft_spec, parse_sft_spec

    try:
        data = read_spec_yaml(path)
        return parse_sft_spec(data) if is_sft_spec(data) else parse_spec(data)
    except FileNotFoundError:
        console.print(f"spec not found: {path}", style="red", markup=False)
        raise typer.Exit(2)
    except SpecError as err:
        exit_invalid("spec", path, err)


def load_job_spec(path: Path, steps: Optional[int] = None) -> JobSpec:
    """The RL spec at `path` (`steps` overrides optimization.steps), or exit 2 with its problems."""
    try:
        spec = load_spec(path)
    except FileNotFoundError:
        console.print(f"spec not found: {path}", style="red", markup=False)
        raise typer.Exit(2)
    except SpecError as err:
        exit_invalid("spec", path, err)
    if steps is not None:
        spec = spec.model_copy(update={"optimization": spec.optimization.model_copy(update={"steps": steps})})
    check_env_or_exit(path, spec)  # before the model loads
    return spec


def check_env_or_exit(path: Path, spec: JobSpec) -> None:
    """What the gateway checks of an RL spec's environment (its game, config and players; that its
    prompts fit), with this machine's settings: the gateway's one line, or exit 2."""
    from opentinker.control.gateway.confine import check_job_env
    from opentinker.core.settings import get_settings

    try:
        check_job_env(get_settings(), spec)
    except SpecError as err:
        exit_invalid("spec", path, err)


def fmt(value: Optional[float], pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if pct else f"{value:.2f}"


def step_progress(label: str) -> Progress:
    """step n/N, bar, reward/accuracy summary, elapsed and ETA."""
    return Progress(
        TextColumn(label), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[summary]}"),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
    )


def settings_and_env():
    """Settings, exported for the Prefect/MLflow clients before either library is imported."""
    from opentinker.core.settings import get_settings, mlflow_env, prefect_env

    settings = get_settings()
    os.environ.update(prefect_env(settings) | mlflow_env(settings))
    # A follower must notice a dead MLflow in seconds (and retry itself), not after minutes of the client's retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    return settings


def status_table(status) -> Table:
    """Ours (running from this state folder) and healthy, and whether anything answers on the port:
    a server that answers without being ours was started from another state folder or is another program."""
    table = Table(title="OpenTinker stack")
    for col in ("service", "running", "healthy", "pid", "url"):
        table.add_column(col)
    for s in status.values():
        running = "yes" if s.running else ("no (another program answers there)" if s.answering else "no")
        table.add_row(s.name, running, "yes" if s.healthy else "no", str(s.pid or "-"), s.url or "-")
    return table


def say_sandbox_left_out(status) -> None:
    """One line where the stack leaves its sandbox service out (bubblewrap does not run here). Its
    endpoint, where it runs, is in the table: the key read from its file by `$(cat …)`, never shown."""
    from opentinker.control.services import sandbox_unavailable

    if "sandbox" not in status and (why := sandbox_unavailable()):
        console.print(f"sandbox service: not started: {why}", style="yellow", markup=False, soft_wrap=True)


def bring_up(settings, deploy: bool):
    """Start (or reuse) the stack and register the deployments (always with `deploy`, else only
    when some are missing); exit 1 with the reason when the stack cannot start."""
    from opentinker.control.stack import Stack, StackError
    from opentinker.control.submit import deploy as deploy_all
    from opentinker.control.submit import deployed

    try:
        with console.status("starting the stack (Prefect server + worker, MLflow) on loopback"):
            status = Stack(settings).up()
    except StackError as err:
        console.print(f"stack: {err}", style="red", markup=False)
        raise typer.Exit(1)
    say_sandbox_left_out(status)
    if deploy or not deployed(settings):
        with console.status("registering pools, slot limits and deployments"):
            deploy_all(settings)
    return status


def stack_for_a_job(settings) -> None:
    """Before submitting: the Ray cluster the settings name must answer, then the stack is up."""
    from opentinker.control.submit import check_ray_address

    try:
        check_ray_address(settings.ray_address)
    except ConnectionError as err:
        console.print(f"ray: {err}", style="red", markup=False)
        raise typer.Exit(1)
    bring_up(settings, deploy=False)


def submit_to_pool(spec, job_id: str, settings) -> str:
    """Queue the job on its deployment (routed by the spec's kind); its flow-run id, or exit 2."""
    from opentinker.control.scheduler import SchedulingError
    from opentinker.control.submit import submit_job

    try:
        return submit_job(spec.model_dump(mode="json"), job_id, settings)
    except SchedulingError as err:
        console.print(f"cannot schedule: {err}", style="red", markup=False)
        raise typer.Exit(2)
