"""`opentinker run` (train in this process), `train` (submit to the stack and follow) and
`follow` (re-attach to a job): live progress that says what fails, and the job's true end state."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from opentinker.cli.common import (console, fmt, load_job_spec, quiet_libraries, settings_and_env, stack_for_a_job, step_progress,
                                   submit_to_pool)


def checked_job_id(job_id: Optional[str], what: str = "--job-id") -> Optional[str]:
    """`job_id` (None stays None) when it follows the rule of core/ids.py, else one red line naming
    the argument and the reason, and exit 2: a bad id is refused before anything is started or written."""
    from opentinker.core.ids import InvalidJobId, check_job_id

    if job_id is None:
        return None
    try:
        return check_job_id(job_id, what)
    except InvalidJobId as err:
        console.print(str(err), style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2)


def _failed(metrics: dict[str, Any], prefix: str) -> str:
    """`failed N` and, when some failed, the most common reason; `truncated N` (with why) when
    episodes were cut at rollout.max_total_tokens."""
    n = int(metrics.get(f"{prefix}/failed_episodes", 0))
    reason = metrics.get(f"{prefix}/first_failure")
    cut = metrics.get(f"{prefix}/first_truncation")
    return f"failed {n}" + (f": {reason}" if n and reason else "") + (f"; {cut}" if cut else "")


def run(
    spec_path: Path = typer.Argument(..., help="job spec YAML"),
    steps: Optional[int] = typer.Option(None, help="override optimization.steps"),
    job_id: Optional[str] = typer.Option(None, help="job id; re-running the same id resumes from its last checkpoint"),
) -> None:
    """Train in this process (no scheduler): rollout → update → evaluate → checkpoint, with live progress."""
    job_id = checked_job_id(job_id)
    spec = load_job_spec(spec_path, steps)
    quiet_libraries()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from opentinker.inference.launch import rollout_server
    from opentinker.rl import RLJob

    console.print(f"[bold]OpenTinker[/] {spec.model.name} · {spec.adapter.kind} · {spec.algorithm.advantage} · env {spec.env.label}")
    with console.status("loading model (first use of smollm2 converts its GGUF once, ≈30 s)"):
        job = RLJob(spec, job_id=job_id, start_server=rollout_server)  # checks its storage and devices first, before the model loads
    console.print(f"job [cyan]{job.job_id}[/], checkpoints under {spec.checkpoint.base_url}/{job.job_id}")
    if job.engine_choice:
        console.print(job.engine_choice)

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
        progress.console.print(f"[magenta]eval @ step {ev.step}[/]: accuracy {fmt(state['acc'], pct=True)} · reward "
                               f"{fmt(m['eval/reward_mean'])}{extra} · {_failed(m, 'eval')}", highlight=False)
        progress.update(task, summary=summary())

    def on_step(report) -> None:
        m = report.metrics
        state["reward"] = m["rollout/reward_mean"]
        progress.console.print(
            f"step {report.step:>3}/{report.total_steps}: reward {fmt(m['rollout/reward_mean'])} "
            f"({_failed(m, 'rollout')}) · loss {fmt(m.get('update/policy_loss'))} · "
            f"entropy {fmt(m.get('update/entropy'))} · {m['rollout/tokens_per_s']:.0f} tok/s · {m['step/seconds']:.1f}s"
            + (" · no update: no episode had tokens to train" if m.get("update/skipped") else "")
            + (f" · checkpoint step {report.checkpoint.step}" if report.checkpoint else ""), highlight=False, markup=False)
        progress.update(task, completed=report.step, summary=summary())

    with progress:
        task = progress.add_task("train", total=spec.optimization.steps, summary=summary())
        try:
            result = job.run(on_step=on_step, on_eval=on_eval)
        finally:
            job.close()

    for line in result.skipped:  # checkpoint folders resume refused: it went on from an older one
        console.print(f"skipped {line}", style="yellow", markup=False, soft_wrap=True)
    table = Table(title=f"job {job.job_id}", show_header=False)
    table.add_row("steps", f"{result.steps_done} (resumed from {result.resumed_from})" if result.resumed_from else str(result.steps_done))
    if result.evaluations:
        first, last = result.evaluations[0].metrics, result.evaluations[-1].metrics
        table.add_row("validation accuracy", f"{fmt(first.get('eval/accuracy'), True)} → {fmt(last.get('eval/accuracy'), True)}")
    table.add_row("wall time", f"{result.seconds:.0f} s")
    table.add_row("checkpoint", result.checkpoint.url if result.checkpoint else "-")
    console.print(table)
    if result.not_registrable:
        console.print(f"unhealthy: {result.not_registrable}", style="red", markup=False)
        raise typer.Exit(1)


def _follow_and_report(flow_run_id: str, job_id: str, settings, total: int | None, checkpoint_hint: str | None,
                       resume: str | None = None) -> None:
    """Follow a job to its end, say on one line when the control plane does not answer, and report
    its true end state (exit 1 unless COMPLETED, 3 when the follower gave up); a failed job's last
    line is the command that resumes it (`resume`)."""
    from opentinker.control.follow import FollowLost, follow

    prefect_link = f"{settings.prefect_ui_url}/runs/flow-run/{flow_run_id}"
    progress = step_progress("[bold]{task.fields[state]}")
    seen = {"eval": None, "failure": None, "down": False}
    with progress:
        bar = progress.add_task("train", total=total, state="QUEUED", summary="")

        def on_update(p) -> None:
            if seen["down"]:
                progress.console.print("reconnected", style="green")
                seen["down"] = False
            summary = f"reward {fmt(p.reward)} · val acc {fmt(p.accuracy, pct=True)}" + (f" · failed {p.failed}" if p.failed else "")
            progress.update(bar, completed=p.step, state=p.state, summary=summary)
            if p.accuracy_step is not None and p.accuracy_step != seen["eval"]:
                seen["eval"] = p.accuracy_step
                failed = f" · failed {p.eval_failed}" if p.eval_failed else ""
                progress.console.print(f"[magenta]eval @ step {p.accuracy_step}[/]: validation accuracy {fmt(p.accuracy, pct=True)}{failed}")
            if p.failure and p.failure != seen["failure"]:
                seen["failure"] = p.failure
                progress.console.print(f"failing episodes: {p.failure}", style="yellow", markup=False)

        def on_retry(attempt: int, err: BaseException) -> None:
            seen["down"] = True
            progress.console.print(f"the control plane does not answer ({type(err).__name__}); reconnecting (attempt {attempt})…",
                                   style="yellow", markup=False)

        try:
            final = follow(flow_run_id, job_id, settings, on_update, on_retry=on_retry)
        except FollowLost as err:
            progress.stop()
            console.print(str(err), style="red", markup=False)
            raise typer.Exit(3)
    console.print(f"job {job_id}: {final.state}", style="bold")
    lines = {"Prefect run": prefect_link, "MLflow run": final.mlflow_run_url or "-"}
    if per_agent := final.result.get("checkpoints"):  # a self-play job: one checkpoint per learning agent
        lines |= {f"checkpoint {agent}": url for agent, url in per_agent.items()}
    else:
        lines["checkpoint"] = final.result.get("checkpoint") or checkpoint_hint or "-"
    if final.accuracy is not None:
        lines["validation accuracy"] = fmt(final.accuracy, pct=True)
    lines |= console_lines(settings)
    for key, value in lines.items():  # plain lines: links stay whole and clickable
        console.print(f"  {key}: {value}", markup=False, soft_wrap=True)
    if final.state != "COMPLETED":
        console.print(f"job {final.state.lower()}: {final.message or 'no message'}", style="red", markup=False, soft_wrap=True)
        if resume and final.state == "FAILED":
            console.print(f"resume it from its last checkpoint: {resume}", markup=False, soft_wrap=True)
        raise typer.Exit(1)


def train(
    spec_path: Path = typer.Argument(..., help="job spec YAML"),
    steps: Optional[int] = typer.Option(None, help="override optimization.steps"),
    job_id: Optional[str] = typer.Option(None, help="job id; submitting the same id again resumes it"),
) -> None:
    """Submit a training job to the stack (started if needed) and follow it until it ends."""
    job_id = checked_job_id(job_id)  # before the stack starts: nothing is queued or written
    spec = load_job_spec(spec_path, steps)
    settings = settings_and_env()
    quiet_libraries()
    stack_for_a_job(settings)
    from opentinker.core.ids import new_job_id

    job_id = job_id or new_job_id(spec)
    flow_run_id = submit_to_pool(spec, job_id, settings)
    console.print(f"submitted job [cyan]{job_id}[/] · Prefect {settings.prefect_ui_url}/runs/flow-run/{flow_run_id}")
    again = f"opentinker train {shlex.quote(str(spec_path))}" + (f" --steps {steps}" if steps is not None else "") + f" --job-id {job_id}"
    _follow_and_report(flow_run_id, job_id, settings, spec.optimization.steps, f"{spec.checkpoint.base_url}/{job_id}", resume=again)


def follow(job_id: str = typer.Argument(..., help="the job's id (as `train` printed it)")) -> None:
    """Re-attach to a job on the stack and follow it until it ends."""
    checked_job_id(job_id, "JOB_ID")
    settings = settings_and_env()
    from opentinker.control.follow import latest_flow_run

    try:
        run = latest_flow_run(job_id)
    except LookupError as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2)
    total = ((run.parameters.get("spec") or {}).get("optimization") or {}).get("steps")
    console.print(f"following job [cyan]{job_id}[/]")
    _follow_and_report(str(run.id), job_id, settings, total, None)


def console_lines(settings) -> dict[str, str]:
    """The web console's link and where the key that opens it lives: the operator's (made on first
    use, kept owner-only in the state folder). The key itself is never printed: this end of a run
    lands in logs (`make demo`'s); a tenant signs in with its own key (`opentinker tenant add NAME`)."""
    from opentinker.control.console.session import operator_key, operator_key_path

    operator_key(settings, create=True)
    path = operator_key_path(settings)
    return {"Console": f"{settings.public_gateway_url}/console",
            "Console key (the operator's; a tenant signs in with its own)": f"in {path} (read it: cat {shlex.quote(str(path))})"}
