"""The console's jobs list: one page of a tenant's (or every tenant's) jobs, fast.

`TenantJobs.list()` reads up to 200 flow runs with everything Prefect holds and asks MLflow for
each job's history; with a long history that takes seconds. This reads one page (50 flow runs,
newest first) with Prefect's own filters (state type, flow for the kind, the job's tag for a
search), counts by state with `count_flow_runs` (all queries at once on the async client), and
takes the page's last reward and accuracy from one MLflow search per experiment (the latest
values a run already carries, no history), while the counts are still coming. A job that ended a
while ago never changes, so its step, reward and accuracy are kept once read and MLflow is asked
only about the page's live jobs. (The routes keep whole answers a moment: recent.py.)

Rows are newest first by when a job started, or was submitted if it has not started: a job parked
until its environment is known (Client link, `fit()`) is Scheduled ten years ahead, and Prefect
keeps that as its expected start, so one that never started (waiting still, or cancelled while
waiting) sorts first.

The counts are of flow runs (a job re-submitted under the same id counts once per run), and a
state filter that Prefect cannot express exactly (QUEUED includes RUNNING runs still waiting for
their slots) is finished on the page, which may then hold fewer than 50 rows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from opentinker.control.scheduler import SLOTS_HELD_TAG, TINKER_TAG, job_state
from opentinker.tracking.metrics import headline_key
from opentinker.tracking.runs import JOB_TAG

PAGE = 50
MAX_PAGE = 10_000
STATES = ("QUEUED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED")
KINDS = {"rl": ("rl-train", "self-play"), "sft": ("sft",), "inference": ("serve-model",), "tinker": ("tinker-session",),
         "evaluation": ("evaluate-promote",)}
KIND_OF_FLOW = {flow: kind for kind, flows in KINDS.items() for flow in flows}
# The Prefect state types a user-facing state may come from (job_state finishes the choice).
_CANDIDATES = {"QUEUED": ("SCHEDULED", "PENDING", "PAUSED", "RUNNING"), "RUNNING": ("RUNNING", "CANCELLING"),
               "COMPLETED": ("COMPLETED",), "FAILED": ("FAILED", "CRASHED"), "CANCELLED": ("CANCELLED", "CANCELLING", "FAILED", "CRASHED")}
ENDED = ("COMPLETED", "FAILED", "CANCELLED")
SETTLED_S = 30.0  # an ended job's last metrics are in MLflow this long after its flow run ended
PROGRESS = ("step", "total_steps", "reward", "accuracy")
_flow_names: dict[Any, str] = {}
_settled: dict[tuple[str, int], dict[str, Any]] = {}  # (job id, created ms) -> its PROGRESS, for jobs long ended


def _tags(tenant: str | None) -> list[str]:
    return [f"tenant:{tenant}"] if tenant else ["opentinker"]


def _filter(tenant: str | None, types: tuple[str, ...] | None = None, job_ids: list[str] | None = None, tag: str | None = None):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
    from prefect.client.schemas.objects import StateType

    tags = _tags(tenant) + ([tag] if tag else [])
    out = FlowRunFilter(tags=FlowRunFilterTags(all_=tags))
    if types:
        out.state = FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(t) for t in types]))
    if job_ids:
        out.tags = FlowRunFilterTags(all_=tags + [f"job:{job_ids[0]}"])
    return out


def _flow_filter(kind: str | None):
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    return FlowFilter(name=FlowFilterName(any_=list(KINDS[kind]))) if kind in KINDS else None


async def _counts(client: Any, tenant: str | None, kind: str | None) -> dict[str, int]:
    flows = _flow_filter(kind)

    async def count(types: tuple[str, ...], tag: str | None = None) -> int:
        return await client.count_flow_runs(flow_filter=flows, flow_run_filter=_filter(tenant, types, tag=tag))

    waiting, running, holding, cancelling, completed, failed, cancelled = await asyncio.gather(
        count(("SCHEDULED", "PENDING", "PAUSED")), count(("RUNNING",)), count(("RUNNING",), SLOTS_HELD_TAG),
        count(("CANCELLING",)), count(("COMPLETED",)), count(("FAILED", "CRASHED")), count(("CANCELLED",)))
    return {"QUEUED": waiting + running - holding, "RUNNING": holding + cancelling, "COMPLETED": completed,
            "FAILED": failed, "CANCELLED": cancelled}


def job_id_of(run: Any) -> str | None:
    return next((t.split(":", 1)[1] for t in run.tags or [] if t.startswith("job:")), None)


def kind_of(run: Any, flow_name: str | None) -> str:
    if TINKER_TAG in (run.tags or []):
        return "tinker"
    if "kind:inference" in (run.tags or []):
        return "inference"
    return KIND_OF_FLOW.get(flow_name or "", flow_name or "rl")


def row(run: Any, flow_name: str | None) -> dict[str, Any]:
    state, reason = job_state(run)
    spec = (run.parameters or {}).get("spec") or {}
    return {"job_id": job_id_of(run), "tenant": (run.parameters or {}).get("tenant"), "kind": kind_of(run, flow_name),
            "state": state, "reason": reason, "step": None, "total_steps": (spec.get("optimization") or {}).get("steps"),
            "reward": None, "accuracy": None, "created": run.created.isoformat() if run.created else None,
            "started": run.start_time.isoformat() if run.start_time else None,
            "created_ms": int(run.created.timestamp() * 1000) if run.created else 0,
            "ended_ms": int(run.end_time.timestamp() * 1000) if run.end_time and state in ENDED else None}


def _progress(settings: Any, rows: list[dict[str, Any]]) -> None:
    """Each row's step, last reward and accuracy: kept from an earlier read for a job long ended,
    else from its MLflow run's latest values, one search per experiment for the page's others."""
    from mlflow.tracking import MlflowClient

    by_experiment: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if (kept := _settled.get((r["job_id"], r["created_ms"]))) is not None:
            r.update(kept)
        elif r["job_id"] and r["kind"] in ("rl", "sft", "evaluation"):
            by_experiment.setdefault(r["tenant"] or settings.project, []).append(r)
    if not by_experiment:
        return
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    for name, group in by_experiment.items():
        experiment = ml.get_experiment_by_name(name)
        if experiment is None:
            continue
        # MLflow filters tags and run names by one value at a time (IN is for run ids only): ask for
        # the runs that started since the oldest of these jobs was created, and pick theirs
        since = min(r["created_ms"] for r in group) - 60_000
        runs = ml.search_runs([experiment.experiment_id], filter_string=f"attributes.start_time >= {since}",
                              order_by=["attributes.start_time DESC"], max_results=1000)
        newest: dict[str, Any] = {}
        for run in runs:
            newest.setdefault(run.data.tags.get(JOB_TAG), run)
        for r in group:
            if (run := newest.get(r["job_id"])) is not None:
                _read_progress(run, r)
    settled_before = time.time() * 1000 - SETTLED_S * 1000
    if len(_settled) > 20_000:
        _settled.clear()
    for group in by_experiment.values():
        for r in group:
            if r["ended_ms"] is not None and r["ended_ms"] < settled_before:
                _settled[(r["job_id"], r["created_ms"])] = {k: r[k] for k in PROGRESS}


def _read_progress(run: Any, r: dict[str, Any]) -> None:
    keys = run.data.metrics
    steps = {m.key: m.step for m in getattr(run.data, "_metric_objs", [])}
    reward_key = headline_key(keys, "rollout/reward_mean")
    if reward_key in keys:
        r["reward"], r["step"] = keys[reward_key], steps.get(reward_key)
    elif "sft/loss" in keys:
        r["step"], r["total_steps"] = steps.get("sft/loss"), int(keys.get("sft/max_steps", 0)) or r["total_steps"]
    if (acc_key := headline_key(keys, "eval/accuracy")) in keys:
        r["accuracy"] = keys[acc_key]


async def _flow_name(client: Any, flow_id: Any) -> str | None:
    if flow_id not in _flow_names:
        try:
            _flow_names[flow_id] = (await client.read_flow(flow_id)).name
        except Exception:  # noqa: BLE001 - a flow deleted under us: its runs show their tags' kind
            return None
    return _flow_names[flow_id]


def query(state: str | None = None, kind: str | None = None, q: str | None = None, page: int = 0) -> tuple:
    """(state, kind, q, page) as the page reads them: unknown values dropped, the page clamped."""
    q = (q or "").strip()[:200] or None
    return state if state in STATES else None, kind if kind in KINDS else None, q, max(0, min(page, MAX_PAGE))


def read_jobs_page(settings: Any, tenant: str | None, *query: Any) -> dict[str, Any]:
    """`jobs_page` on an event loop of its own, for a thread of its own: the gateway's console reads
    on its own thread, so that parsing Prefect's answers never holds up the gateway's loop."""
    return asyncio.run(jobs_page(settings, tenant, *query))


async def jobs_page(settings: Any, tenant: str | None, state: str | None = None, kind: str | None = None,
                    q: str | None = None, page: int = 0) -> dict[str, Any]:
    """{"jobs": rows, "counts": {state: n}, "page", "more"} for the tenant (None: every tenant)."""
    state, kind, q, page = query(state, kind, q, page)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    ids = None
    if q:
        ids = [q] if tenant is None or q.startswith(f"{tenant}-") else [f"{tenant}-{q}"]
    async with get_client() as client:
        counting = asyncio.ensure_future(_counts(client, tenant, kind))
        runs = await client.read_flow_runs(flow_filter=_flow_filter(kind), flow_run_filter=_filter(
            tenant, _CANDIDATES[state] if state else None, ids), sort=FlowRunSort.START_TIME_DESC,
            limit=PAGE, offset=page * PAGE)
        names = {run.flow_id: await _flow_name(client, run.flow_id) for run in runs}
        rows, seen = [], set()
        for run in runs:
            r = row(run, names.get(run.flow_id))
            if r["job_id"] is None or r["job_id"] in seen or (state and r["state"] != state):
                continue
            seen.add(r["job_id"])
            rows.append(r)
        counts, _ = await asyncio.gather(counting, asyncio.to_thread(_progress, settings, rows))
    return {"jobs": rows, "counts": counts, "page": page, "more": len(runs) == PAGE}
