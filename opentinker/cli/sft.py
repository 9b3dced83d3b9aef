"""`opentinker sft SPEC.yaml`: submit an SFT job to the stack (or `--local`: train in this process)
and follow it with a progress bar. The spec and the data file are checked here first, so bad input
fails in the terminal, with its field or line, before anything is queued or loaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from opentinker.cli.common import console, exit_invalid, quiet_libraries, settings_and_env, stack_for_a_job, step_progress, submit_to_pool
from opentinker.core.polling import wait_for
from opentinker.core.states import TERMINAL


def _load(spec_path: Path, epochs: Optional[int]):
    from opentinker.core.spec import SpecError
    from opentinker.sft.data import load_chats
    from opentinker.sft.spec import load_sft_spec

    try:
        spec = load_sft_spec(spec_path)
        if epochs is not None:
            spec = spec.model_copy(update={"training": spec.training.model_copy(update={"epochs": epochs})})
        chats = load_chats(spec.data.path)
    except FileNotFoundError:
        console.print(f"spec not found: {spec_path}", style="red", markup=False)
        raise typer.Exit(2)
    except SpecError as err:
        exit_invalid("SFT job", spec_path, err)
    return spec, len(chats)


def _loss(metrics: dict, key: str) -> str:
    return f"{metrics[key]:.3f}" if key in metrics else "-"


def sft(
    spec_path: Path = typer.Argument(..., help="SFT spec YAML (see examples/sft_math.yaml)"),
    local: bool = typer.Option(False, "--local", help="train in this process instead of submitting to the stack"),
    epochs: Optional[int] = typer.Option(None, help="override training.epochs"),
    job_id: Optional[str] = typer.Option(None, help="job id (default: the spec's, else a new one)"),
) -> None:
    """SFT with TRL's SFTTrainer on JSONL chats; the checkpoint can start an RL job (model.init_from)."""
    from opentinker.cli.jobs import checked_job_id

    job_id = checked_job_id(job_id)
    spec, n = _load(spec_path, epochs)
    from opentinker.core.ids import new_job_id

    job_id = job_id or new_job_id(spec)
    console.print(f"[bold]OpenTinker SFT[/] {spec.model.name} · {spec.adapter.kind} · {n} chats · {spec.training.epochs} epoch(s)")
    quiet_libraries()
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # TRL's dataset preparation: one bar per pass, noise beside ours
    if local:
        _run_local(spec, job_id)
    else:
        _submit(spec, job_id)


def _run_local(spec, job_id: str) -> None:
    import torch

    from opentinker.core.spec import SpecError
    from opentinker.sft.job import SFTJob
    from opentinker.storage.preflight import StorageError

    torch.set_num_threads(os.cpu_count() or 1)
    try:
        with console.status("checking storage and the data against the chat template, loading the model"):
            job = SFTJob(spec, job_id)
    except (SpecError, StorageError) as err:
        for line in str(err).splitlines():
            console.print(line, style="red", markup=False)
        raise typer.Exit(2)
    for line in job.skipped:  # checkpoint folders of this job id that are not its own, intact
        console.print(f"skipped {line}", style="yellow", markup=False, soft_wrap=True)
    progress = step_progress("[bold]step")
    with progress:
        bar = progress.add_task("sft", total=None if job.reused else job.max_steps, summary="")

        def on_log(step: int, metrics: dict) -> None:
            if "sft/loss" in metrics:
                progress.update(bar, completed=step, summary=f"loss {metrics['sft/loss']:.3f}")
            elif "eval/loss" in metrics or "train_set/loss" in metrics:
                key = "eval/loss" if "eval/loss" in metrics else "train_set/loss"
                progress.console.print(f"[magenta]{key} @ step {step}[/]: {metrics[key]:.3f}")

        result = job.run(on_log=on_log)
    _summary(job_id, result["before"], result["after"], result["steps"], result["checkpoint"], result.get("seconds"))


def _summary(job_id: str, before: dict, after: dict, steps, checkpoint: str, seconds=None) -> None:
    from rich.table import Table

    table = Table(title=f"SFT job {job_id}", show_header=False)
    table.add_row("optimizer steps", str(steps))
    for key, label in (("eval/loss", "held-out loss"), ("train_set/loss", "training-set loss")):
        if key in before or key in after:
            table.add_row(label, f"{_loss(before, key)} → {_loss(after, key)}")
    if seconds is not None:
        table.add_row("wall time", f"{seconds:.0f} s")
    console.print(table)
    console.print(f"  checkpoint: {checkpoint}", markup=False, soft_wrap=True)
    console.print(f"  start an RL job from it with  model.init_from: {checkpoint}", markup=False, soft_wrap=True)


def _metrics(settings, run_id: str) -> dict[str, dict[int, float]]:
    """Metric histories of the job's MLflow run: {key: {step: value}}."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    keys = ("sft/loss", "sft/max_steps", "eval/loss", "train_set/loss")
    return {k: {m.step: m.value for m in client.get_metric_history(run_id, k)} for k in keys}


def _submit(spec, job_id: str) -> None:
    from opentinker.control.follow import poll

    settings = settings_and_env()
    stack_for_a_job(settings)
    flow_run_id = submit_to_pool(spec, job_id, settings)  # routed to the sft deployment
    prefect_link = f"{settings.prefect_ui_url}/runs/flow-run/{flow_run_id}"
    console.print(f"submitted SFT job [cyan]{job_id}[/] · Prefect {prefect_link}")
    progress = step_progress("[bold]{task.fields[state]}")
    metrics: dict[str, dict[int, float]] = {}
    with progress:
        bar = progress.add_task("sft", total=None, state="QUEUED", summary="")

        def look():
            nonlocal metrics
            p = poll(flow_run_id, job_id, settings)
            if p.mlflow_run_id:
                metrics = _metrics(settings, p.mlflow_run_id)
                total = max(metrics["sft/max_steps"].values(), default=None)
                loss = metrics["sft/loss"]
                step = max(loss, default=0)
                progress.update(bar, total=total, completed=step, state=p.state,
                                summary=f"loss {loss[step]:.3f}" if loss else "")
            else:
                progress.update(bar, state=p.state)
            return p if p.state in TERMINAL else None

        p = wait_for(look, interval=2.0, what=f"SFT job {job_id} to end")
    console.print(f"job {job_id}: {p.state}", style="bold")
    console.print(f"  Prefect run: {prefect_link}", markup=False, soft_wrap=True)
    console.print(f"  MLflow run: {p.mlflow_run_url or '-'}", markup=False, soft_wrap=True)
    if p.state != "COMPLETED":
        console.print(f"job {p.state.lower()}: {(p.message or 'no message').splitlines()[0]}", style="red", markup=False)
        raise typer.Exit(1)
    first = {k: v[min(v)] for k, v in metrics.items() if k in ("eval/loss", "train_set/loss") and v}
    last = {k: v[max(v)] for k, v in metrics.items() if k in ("eval/loss", "train_set/loss") and v}
    steps = max(metrics.get("sft/loss") or {0: 0})
    _summary(job_id, first, last, steps, p.result.get("checkpoint") or "-")
