"""`opentinker jobs`, `job`, `cancel` and `logs`: the job verbs of a job service.

With OPENTINKER_API_KEY set they go through the gateway as that tenant (OPENTINKER_GATEWAY_URL
names it, as for the Python client) and see only the tenant's jobs; without a key they read the
local stack's Prefect and MLflow directly, the operator's view of every job on it. Both answer
with the same fields (the gateway's and the operator's views share one class), shown as tables,
or as plain JSON on stdout with `--json`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from opentinker.cli.common import console, fmt, settings_and_env
from opentinker.cli.jobs import checked_job_id

JSON = typer.Option(False, "--json", help="plain JSON on stdout, for scripts")
PAGE = 200  # log lines per request: the most the gateway (and Prefect) answers at once
POLL_S = 2.0  # between two looks of `logs --follow`
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class _Local:
    """The operator's view (no key), answering as the gateway does: the same dicts, and the
    client's exceptions with the gateway's lines (a missing job reads `no job 'ID'`)."""

    def __init__(self, settings) -> None:
        from opentinker.control.gateway.jobs import StackJobs

        self.jobs = StackJobs(settings)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        from opentinker.client.http import GatewayError, GatewayUnreachable, JobNotFound
        from opentinker.control.gateway.jobs import JobConflict
        from opentinker.control.gateway.jobs import JobNotFound as Missing
        from opentinker.core.polling import is_blip

        try:
            return fn(*args)
        except Missing as err:
            raise JobNotFound(404, f"no job {err.args[0]!r}") from None
        except JobConflict as err:
            raise GatewayError(409, str(err)) from None
        except Exception as err:
            if is_blip(err):  # as the gateway's client says it, and `logs --follow` rides it out
                raise GatewayUnreachable(0, f"the local stack does not answer ({type(err).__name__}); "
                                            "is it up (`opentinker up`)?") from None
            raise

    def list_jobs(self) -> list[dict[str, Any]]:
        return self._call(self.jobs.list)

    def job_status(self, job_id: str) -> dict[str, Any]:
        return self._call(self.jobs.status, job_id)

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._call(self.jobs.cancel, job_id)

    def list_checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._call(self.jobs.list_checkpoints, job_id)

    def logs(self, job_id: str, offset: int = 0, limit: int = PAGE) -> dict[str, Any]:
        return self._call(self.jobs.logs, job_id, offset, limit)


def _fail(line: str, code: int) -> None:
    console.print(_safe(line), style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _source() -> Any:
    """The gateway as the tenant whose key OPENTINKER_API_KEY holds, else the local stack (exit 1
    with one line when its Prefect server does not answer)."""
    if os.environ.get("OPENTINKER_API_KEY"):
        from opentinker.client import SchedulerClient

        return SchedulerClient()
    import httpx

    settings = settings_and_env()
    try:
        httpx.get(f"{settings.prefect_api_url}/health", timeout=5.0, trust_env=False).raise_for_status()
    except httpx.HTTPError:
        _fail(f"no OPENTINKER_API_KEY, and the local stack's Prefect server at {settings.prefect_ui_url} does not answer: "
              "set OPENTINKER_API_KEY (and OPENTINKER_GATEWAY_URL) for a gateway, or start the stack (`opentinker up`)", 1)
    return _Local(settings)


@contextmanager
def _one_line() -> Iterator[None]:
    """The gateway's answer (or the local stack's, in the same words) as one red line: a missing
    job (another tenant's reads the same) exits 2, anything else 1."""
    from opentinker.client.http import GatewayError, JobNotFound

    try:
        yield
    except JobNotFound as err:
        _fail(str(err), 2)
    except GatewayError as err:
        _fail(str(err), 1)


def _safe(text: Any) -> str:
    """Text from a job (log lines, failure reasons) with its control characters made visible:
    nothing a job prints may move the cursor or recolour the operator's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def _when(iso: Optional[str]) -> str:
    return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S") if iso else "-"


def _steps(job: dict[str, Any]) -> str:
    return f"{job.get('step') or 0}/{job.get('total_steps') or '-'}"


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2))


def jobs(as_json: bool = JSON) -> None:
    """List jobs, newest first: id, state, step/total, last reward and accuracy, started, reason.

    With OPENTINKER_API_KEY (and OPENTINKER_GATEWAY_URL), the tenant's jobs through the gateway;
    without a key, every job on the local stack, with its tenant."""
    source = _source()
    with _one_line():
        rows = source.list_jobs()
    if as_json:
        return _print_json(rows)
    if not rows:
        console.print("no jobs")
        return
    local = isinstance(source, _Local)
    table = Table("job", *(["tenant"] if local else []), "state", "step", "reward", "accuracy", "started", "reason")
    for job in rows:
        cells = [job["job_id"], *([job.get("tenant") or "-"] if local else []), job["state"], _steps(job), fmt(job.get("reward")),
                 fmt(job.get("accuracy"), pct=True), _when(job.get("started")), job.get("reason") or job.get("failure") or ""]
        table.add_row(*(Text(_safe(cell)) for cell in cells))
    console.print(table)


def job(job_id: str = typer.Argument(..., metavar="JOB", help="the job's id (as `opentinker jobs` lists it)"),
        as_json: bool = JSON) -> None:
    """Show one job: its state, progress, checkpoints and links (Prefect run, MLflow run)."""
    checked_job_id(job_id, "JOB")
    source = _source()
    with _one_line():
        status = source.job_status(job_id)
        points = source.list_checkpoints(job_id)
    if as_json:
        return _print_json(status | {"checkpoints": points})
    table = Table(title=f"job {job_id}", show_header=False)
    rows = {"state": status["state"] + (f" ({status['reason']})" if status.get("reason") else ""), "tenant": status.get("tenant"),
            "progress": f"step {_steps(status)}", "reward": fmt(status.get("reward")),
            "validation accuracy": fmt(status.get("accuracy"), pct=True)
            + (f" (step {status['accuracy_step']})" if status.get("accuracy_step") is not None else ""),
            "failing episodes": status.get("failure"), "submitted": _when(status.get("created")),
            "started": _when(status.get("started")), "ended": _when(status.get("ended"))}
    for point in points:  # oldest first: valid, or the reason resume skips it
        rows[f"checkpoint step {point['step']}" + (f" ({point['agent']})" if point.get("agent") else "")] = \
            "valid" if point["valid"] else f"skipped on resume: {point['problem']}"
    for key, value in rows.items():
        if value is not None:
            table.add_row(key, Text(_safe(value)))
    console.print(table)
    links = {"checkpoint": status.get("checkpoint"), "Prefect run": status["links"].get("prefect"),
             "MLflow run": status["links"].get("mlflow")}
    for key, value in links.items():  # plain lines: links stay whole and clickable
        console.print(f"  {key}: {_safe(value or '-')}", markup=False, highlight=False, soft_wrap=True)


def cancel(job_id: str = typer.Argument(..., metavar="JOB", help="the job's id"), as_json: bool = JSON) -> None:
    """Cancel a job: a queued one at once, a running one once its worker has stopped it.

    A running job shows RUNNING (cancelling) until its process is stopped and its slots are freed;
    a job that already ended is refused."""
    checked_job_id(job_id, "JOB")
    source = _source()
    with _one_line():
        status = source.cancel_job(job_id)
    if as_json:
        return _print_json(status)
    console.print(f"job {job_id}: {status['state']}" + (f" ({_safe(status['reason'])})" if status.get("reason") else ""),
                  markup=False, highlight=False, soft_wrap=True)


def logs(job_id: str = typer.Argument(..., metavar="JOB", help="the job's id"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines until the job ends"),
         offset: int = typer.Option(0, min=0, help="start at this line (0: the first); with --json each line has its number"),
         as_json: bool = typer.Option(False, "--json", help="one JSON object per line on stdout (JSON Lines), for scripts")) -> None:
    """Print a job's log, oldest first; with --follow, new lines until the job ends.

    The log is its Prefect flow run's: the flow, its tasks (named) and the worker that ran it. A
    line shows once it is a few seconds old, when no older line can still arrive."""
    from opentinker.core.polling import through_blips

    checked_job_id(job_id, "JOB")
    source = _source()

    def on_retry(attempt: int, err: BaseException) -> None:  # on stderr: stdout stays the log (or its JSON)
        Console(stderr=True).print(f"no answer ({type(err).__name__}); trying again (attempt {attempt})…", style="yellow",
                                   markup=False, highlight=False)

    while True:
        with _one_line():
            page = through_blips(lambda: source.logs(job_id, offset, PAGE), give_up_after_s=900.0 if follow else 0.0, on_retry=on_retry)
        for n, line in enumerate(page["lines"], start=offset):
            if as_json:
                print(json.dumps({"n": n, **line}))
            else:
                style = {"WARNING": "yellow", "ERROR": "red", "CRITICAL": "red"}.get(line["level"])
                task = f"{line['task']}: " if line.get("task") else ""
                text = _safe(f"{_when(line['time'])} {line['level']:<7} {task}{line['message']}")
                console.print(Text(text, style=style or ""), soft_wrap=True)
        offset = page["next_offset"]
        if len(page["lines"]) == PAGE:
            continue  # more are waiting
        if not follow:
            return
        if page["complete"]:  # ended, and every line of it is in
            break
        time.sleep(POLL_S)
    if not as_json:
        console.print(f"job {job_id} ended: {page['state']}" + (f" ({_safe(page['reason'])})" if page.get("reason") else ""),
                      markup=False, highlight=False, soft_wrap=True, style="bold")
