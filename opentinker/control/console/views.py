"""What the console's pages show, read through the gateway's own views of jobs (`TenantJobs`, or
`StackJobs` for the operator), so that a tenant can only ever see what its API key sees.

Everything here returns plain data; the templates escape every string (Jinja2 autoescape) and the
page's script writes text with `textContent` only.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from opentinker.control.follow import mlflow_runs
from opentinker.control.gateway.jobs import JobNotFound, StackJobs, TenantJobs

# The curves a job page draws: (title, the metric names to look for, first found wins).
CURVES = [
    ("reward", ("rollout/reward_mean",)),
    ("accuracy", ("eval/accuracy",)),
    ("loss", ("update/loss", "update/policy_loss", "sft/loss")),
    ("KL", ("update/kl",)),
    ("entropy", ("update/entropy",)),
    ("tokens per step", ("rollout/generated_tokens", "update/tokens")),
]
# Where a step's time went (seconds).
TIMES = [("rollout", "rollout/seconds"), ("update", "update/seconds"), ("weight sync", "rollout/sync_seconds"),
         ("evaluation", "eval/seconds"), ("whole step", "step/seconds")]
MAX_TRANSCRIPT_BYTES = 8 * 2**20
MAX_EPISODES = 256  # of one file shown
MAX_TOKEN_CHARS = 200_000  # of one episode's tokens shown
HIDDEN = ("job_token", "api_key")  # secrets a status carries for clients: never on a page
POLLED = ("job_id", "tenant", "state", "reason", "step", "total_steps", "reward", "accuracy", "started", "ended", "failure")


def view(settings: Any, tenant: str | None) -> TenantJobs:
    return StackJobs(settings) if tenant is None else TenantJobs(settings, tenant)


def _find(keys: Any, names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in keys:
            return name
        if match := sorted(k for k in keys if k.endswith("/" + name)):  # a self-play job: <agent>/<name>
            return match[0]
    return None


def public(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if k not in HIDDEN}


def job_summary(jobs: TenantJobs, job_id: str) -> dict[str, Any]:
    """The job's status (JobNotFound for another tenant's) without its secrets."""
    return public(jobs.status(job_id))


def job_curves(jobs: TenantJobs, job_id: str, status: dict[str, Any]) -> dict[str, Any]:
    """{"curves": [{title, key, points}], "times": [{title, key, points}]} from the job's MLflow run:
    the history of the few metrics drawn, not of every metric."""
    keys = status.get("metrics") or {}
    wanted = [(title, _find(keys, names)) for title, names in CURVES] + [(f"time: {title}", _find(keys, (name,))) for title, name in TIMES]
    wanted = [(t, k) for t, k in wanted if k]
    out: dict[str, Any] = {"curves": [], "times": []}
    if not wanted:
        return out
    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=jobs.settings.mlflow_url)
    experiment = status.get("tenant") or jobs.tenant or jobs.settings.project
    _, runs = mlflow_runs(ml, experiment, job_id)
    if job_id not in runs:
        return out
    run_id = runs[job_id].info.run_id
    for title, key in wanted:
        points = sorted(([m.step, m.value] for m in ml.get_metric_history(run_id, key)), key=lambda p: p[0])
        (out["times"] if title.startswith("time: ") else out["curves"]).append(
            {"title": title.removeprefix("time: "), "key": key, "points": points})
    return out


def job_poll(jobs: TenantJobs, job_id: str) -> dict[str, Any]:
    """What a job's page polls every 2 s: its state and progress, and its curves."""
    status = job_summary(jobs, job_id)
    return {"job": {k: status.get(k) for k in POLLED}, **job_curves(jobs, job_id, status)}


def job_page(settings: Any, jobs: TenantJobs, job_id: str) -> dict[str, Any]:
    """What a job's page shows when it opens (JobNotFound for another tenant's)."""
    return {"job": job_summary(jobs, job_id), "checkpoints": checkpoints(jobs, job_id), "transcripts": transcript_files(jobs, job_id),
            "spec": spec_text(settings, jobs.tenant, job_id)}


def spec_text(settings: Any, tenant: str | None, job_id: str) -> str:
    """The job's spec as YAML (its newest flow run's parameters), as the job runs it."""
    import yaml
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    from opentinker.control.scheduler import prefect_client

    tags = [f"tenant:{tenant}" if tenant else "opentinker", f"job:{job_id}"]
    with prefect_client() as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags)), limit=1,
                                     sort=FlowRunSort.EXPECTED_START_TIME_DESC)
    spec = (runs[0].parameters or {}).get("spec") if runs else None
    return yaml.safe_dump(spec, sort_keys=False, allow_unicode=True) if spec else ""


def checkpoints(jobs: TenantJobs, job_id: str) -> list[dict[str, Any]]:
    """The job's step folders, each with what takes it: a Tinker client's `tinker://` path is the
    session's; `opentinker serve` and `model_path` of an inference job take the folder URL."""
    try:
        return jobs.list_checkpoints(job_id)
    except JobNotFound:
        raise
    except Exception:  # noqa: BLE001 - a job kind with no step folders (inference, a Tinker session)
        return []


def transcript_sizes(jobs: TenantJobs, job_id: str) -> dict[str, int | None]:
    """The job's recorded episode files (MLflow artifacts `transcripts/step-NNNNNN.json`), newest
    first, with their sizes as MLflow lists them."""
    try:
        found = jobs.artifacts(job_id, "transcripts")
    except Exception:  # noqa: BLE001 - no run yet, no artifacts: an empty list
        found = []
    files = {f["path"].rpartition("/")[2]: f.get("size") for f in found if f["path"].endswith(".json") and not f["is_dir"]}
    return dict(sorted(files.items(), reverse=True))


def transcript_files(jobs: TenantJobs, job_id: str) -> list[str]:
    return list(transcript_sizes(jobs, job_id))


def _parts(content: Any) -> list[dict[str, str]]:
    """A message's content as parts a template renders: text, or an image with a data: URL."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out = []
    for part in content if isinstance(content, list) else [content]:
        if isinstance(part, dict) and part.get("type") == "image_url":
            url = str((part.get("image_url") or {}).get("url", ""))
            out.append({"type": "image", "url": url} if url.startswith("data:image/") else {"type": "text", "text": "[image not shown]"})
        elif isinstance(part, dict):
            out.append({"type": "text", "text": str(part.get("text", ""))})
        else:
            out.append({"type": "text", "text": str(part)})
    return out


def _spans(raw: Any) -> list[dict[str, Any]] | None:
    """The record's tokens by loss mask (tracking/transcripts.token_spans), cut to what a page shows."""
    if not isinstance(raw, list):
        return None
    out, left = [], MAX_TOKEN_CHARS
    for span in raw:
        if not isinstance(span, dict) or left <= 0:
            break
        text = str(span.get("text", ""))[:left]
        left -= len(text)
        out.append({"text": text, "trained": span.get("trained") is True})
    return out


def episode(raw: dict[str, Any]) -> dict[str, Any]:
    """One recorded episode for the page: each turn as the model saw it, and, where the record has
    them, its tokens by loss mask. A record without them (written before they were kept) shows
    assistant turns as trained and every other as masked, as the agent loop trains them."""
    turns = []
    for m in raw.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "?"))
        calls = [json.dumps(c.get("function", c), ensure_ascii=False) if isinstance(c, dict) else str(c) for c in m.get("tool_calls") or []]
        turns.append({"role": role, "parts": _parts(m.get("content")), "tool_calls": calls, "trained": role == "assistant",
                      "name": str(m.get("name") or m.get("tool_call_id") or "")})
    return {"task": json.dumps(raw.get("task"), ensure_ascii=False, default=str)[:500], "reward": raw.get("reward"),
            "failed": bool(raw.get("failed")), "failure": raw.get("failure"), "stop_reason": raw.get("stop_reason"),
            "info": json.dumps(raw.get("info") or {}, ensure_ascii=False, default=str)[:2000], "turns": turns,
            "tokens": _spans(raw.get("tokens"))}


def transcripts(jobs: TenantJobs, job_id: str, name: str) -> list[dict[str, Any]]:
    """The episodes of one transcript file of the job (JobNotFound for another tenant's)."""
    sizes = transcript_sizes(jobs, job_id)
    if name not in sizes:
        return []
    if (sizes[name] or 0) > MAX_TRANSCRIPT_BYTES:  # refused before it is downloaded (its writer is the tenant's game)
        raise ValueError(f"{name} is {sizes[name]} bytes, more than the console shows")
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(jobs.download_artifact(job_id, f"transcripts/{name}", tmp))
        if local.stat().st_size > MAX_TRANSCRIPT_BYTES:
            raise ValueError(f"{name} is {local.stat().st_size} bytes, more than the console shows")
        data = json.loads(local.read_text())
    return [episode(e) for e in data[:MAX_EPISODES] if isinstance(e, dict)] if isinstance(data, list) else []


def operator_overview(settings: Any) -> dict[str, Any]:
    """The pools' slots (each global concurrency limit the scheduler keeps: pools, seats, tenants)
    and the jobs that wait or run, each with its tenant."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
    from prefect.client.schemas.objects import StateType

    from opentinker.control.console.listing import row
    from opentinker.control.scheduler import prefect_client

    live = [StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED, StateType.RUNNING, StateType.CANCELLING]
    with prefect_client() as client:
        limits = [{"name": lim.name, "limit": lim.limit, "active": lim.active_slots}
                  for lim in client.read_global_concurrency_limits(limit=200)]
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["opentinker"]), state=FlowRunFilterState(
            type=FlowRunFilterStateType(any_=live))), limit=200)
        names = {}
        for run in runs:
            if run.flow_id not in names:
                names[run.flow_id] = client.read_flow(run.flow_id).name
    rows = [row(run, names.get(run.flow_id)) for run in runs]
    order = {"slots-": 0, "tenant-": 2}
    limits.sort(key=lambda lim: (next((v for k, v in order.items() if lim["name"].startswith(k)), 1), lim["name"]))
    return {"limits": limits, "running": [r for r in rows if r["state"] == "RUNNING"],
            "queued": sorted((r for r in rows if r["state"] == "QUEUED"), key=lambda r: r["created"] or "")}


def tinker_overview(jobs: TenantJobs) -> dict[str, Any]:
    """The tenant's Tinker training runs with their checkpoints (tinker:// paths)."""
    from opentinker.tinker.paths import TenantCheckpoints

    store = TenantCheckpoints(jobs.storage_url)
    runs = []
    for run in store.runs()[:50]:
        try:
            ckpts = store.checkpoints(run["training_run_id"])
        except Exception:  # noqa: BLE001 - a run being written: shown without checkpoints
            ckpts = []
        runs.append({**run, "checkpoints": ckpts})
    return {"training_runs": runs}
