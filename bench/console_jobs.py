"""The console's jobs page with 1,000 jobs in a tenant's history, against the plain job list.

Starts a stack on free ports (its own state folder), gives a tenant 1,000 jobs' worth of history
cheaply: flow runs created from the `rl-train/cpu` deployment with the tenant's tags, directly in
an ended state (900 completed, 50 failed, 50 cancelled: never run), each with an MLflow run holding
five steps of reward, accuracy and loss, as a finished job has. Then measures, over `--loads` loads
each (median, p95), through the gateway:

- the console's jobs page (HTML) and its JSON (`/console/api/jobs`), signed in as the tenant, each
  load after the console's short cache has expired (every load asks Prefect and MLflow), and the
  page loaded back to back (from the cache);
- the plain list the API and CLI use (`GET /v1/jobs`: `TenantJobs.list()`, 200 flow runs and each
  job's MLflow history).

    python bench/console_jobs.py --jobs 1000 --loads 20
writes bench/results/console_jobs.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TENANT = "benchco"


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def history(settings, jobs: int, tmp: Path, with_mlflow: int, running: int = 0) -> None:
    """`jobs` ended flow runs of the tenant, the newest `with_mlflow` of them with an MLflow run of
    five steps (MLflow takes ~1 s a run on the loaded 2-core machine; the plain list reads the
    newest 200 flow runs' MLflow runs, so its cost is the same beyond 200); the newest `running`
    of them Running instead (live jobs, whose pages change: no process runs them)."""
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient
    from opentinker.control.scheduler import deployment_name, prefect_client
    from opentinker.tracking.runs import JOB_TAG
    from tests.conftest import tiny_spec

    spec = tiny_spec(tmp, optimization={"steps": 5}).model_dump(mode="json")
    ml = MlflowClient(tracking_uri=settings.mlflow_url)
    experiment = ml.get_experiment_by_name(TENANT)
    experiment_id = experiment.experiment_id if experiment else ml.create_experiment(TENANT)
    with prefect_client() as client:
        deployment = client.read_deployment_by_name(deployment_name("rl-train", "cpu"))

    t0 = time.monotonic()
    import asyncio

    asyncio.run(_flow_runs(settings, deployment, spec, jobs, running))
    print(f"  {jobs} flow runs made ({time.monotonic() - t0:.0f} s)", flush=True)
    for i in range(max(0, jobs - with_mlflow), jobs):
        job_id = f"{TENANT}-job{i:05d}"
        run = ml.create_run(experiment_id, run_name=job_id, tags={JOB_TAG: job_id})
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for step in range(1, 6)
                   for key, value in (("rollout/reward_mean", 0.1 * step), ("eval/accuracy", 0.05 * step), ("update/policy_loss", 1.0 / step))]
        ml.log_batch(run.info.run_id, metrics=metrics, tags=[RunTag("opentinker.tenant", TENANT)])
    print(f"  {min(jobs, with_mlflow)} MLflow runs made ({time.monotonic() - t0:.0f} s)", flush=True)


async def _flow_runs(settings, deployment, spec: dict, jobs: int, running: int = 0) -> None:
    """The flow runs, written with Prefect's own server models into the stack's database in one
    transaction (through its API, one run at a time, they take ~1.5 s each on this loaded machine:
    the figure measured is the reading, not the making)."""
    from prefect.server import models, schemas
    from prefect.server.database import provide_database_interface
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

    from opentinker.control.scheduler import job_tags

    url = f"sqlite+aiosqlite:///{settings.state_dir / 'prefect' / 'prefect.db'}"
    with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: url}):
        db = provide_database_interface()
        async with db.session_context(begin_transaction=True) as session:
            for i in range(jobs):
                job_id = f"{TENANT}-job{i:05d}"
                state = (schemas.states.Running() if i >= jobs - running else
                         schemas.states.Failed(message="a step failed") if i % 20 == 7 else
                         schemas.states.Cancelled(message="cancelled") if i % 20 == 13 else schemas.states.Completed())
                await models.flow_runs.create_flow_run(session=session, flow_run=schemas.core.FlowRun(
                    flow_id=deployment.flow_id, deployment_id=deployment.id, name=f"bench-{i}", tags=job_tags(TENANT, job_id),
                    parameters={"spec": {**spec, "job_id": job_id}, "job_id": job_id, "tenant": TENANT}, state=state))


def timed(client, url: str, loads: int, gap_s: float = 0.0, **kw) -> dict:
    seconds = []
    for _ in range(loads):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        r = client.get(url, **kw)
        seconds.append(time.perf_counter() - t0)
        r.raise_for_status()
    return {"median_ms": 1000 * statistics.median(seconds), "p95_ms": 1000 * p95(seconds), "loads": loads, "bytes": len(r.content)}


def timed_each(client, urls: list[str]) -> dict:
    """One load of each url, none of them seen before (nothing of theirs cached)."""
    seconds = []
    for url in urls:
        t0 = time.perf_counter()
        client.get(url).raise_for_status()
        seconds.append(time.perf_counter() - t0)
    return {"median_ms": 1000 * statistics.median(seconds), "p95_ms": 1000 * p95(seconds), "loads": len(urls)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=20)
    parser.add_argument("--with-mlflow", type=int, default=200, help="how many of the newest jobs get an MLflow run")
    args = parser.parse_args()
    import httpx

    from opentinker.control.console.listing import SETTLED_S
    from opentinker.control.console.recent import CACHE_S

    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.stack import Stack
    from opentinker.control.submit import deploy
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env
    from tests.stack_fixtures import local_settings

    tmp = Path(tempfile.mkdtemp(prefix="ot-console-bench-"))
    settings = local_settings(tmp / "state", cpu_slots=2, gpu_slots=0)
    os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
    stack = Stack(settings)
    print("starting a local stack ...", flush=True)
    stack.up(timeout=240)
    try:
        deploy(settings)
        key = TenantStore(settings.state_dir / "tenants.json").create(TENANT)
        print(f"making {args.jobs} jobs of history ...", flush=True)
        t0 = time.monotonic()
        history(settings, args.jobs, tmp, args.with_mlflow)
        made_s = time.monotonic() - t0
        time.sleep(SETTLED_S + 1)  # a history is old: its newest jobs too ended over SETTLED_S ago
        base = settings.gateway_url
        with httpx.Client(base_url=base, timeout=120) as client:
            r = client.post("/console/signin", data={"key": key}, follow_redirects=False)
            assert r.status_code == 303, r.text
            client.get("/console/jobs").raise_for_status()  # warm: imports, the flow names
            gap = CACHE_S + 0.3  # each load after the console's cache has expired: every one asks Prefect and MLflow
            console_html = timed(client, "/console/jobs", args.loads, gap)
            console_json = timed(client, "/console/api/jobs", args.loads, gap)
            filtered = timed(client, "/console/api/jobs?state=FAILED", args.loads, gap)
            cached = timed(client, "/console/jobs", args.loads)
            pages = max(1, min(args.loads, args.jobs // 50 - 1))
            first_views = timed_each(client, [f"/console/api/jobs?page={k}" for k in range(1, pages + 1)])
            counts = client.get("/console/api/jobs").json()["counts"]
            client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).raise_for_status()
            plain = timed(client, "/v1/jobs", args.loads, headers={"Authorization": f"Bearer {key}"})
            plain_rows = len(client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).json())
    finally:
        stack.down()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "command": f"python bench/console_jobs.py --jobs {args.jobs} --loads {args.loads} --with-mlflow {args.with_mlflow}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jobs": args.jobs, "jobs_with_mlflow_runs": args.with_mlflow, "history_made_s": made_s, "counts": counts,
        "console_html": console_html, "console_json": console_json, "console_json_failed_filter": filtered, "console_html_cached": cached, "cache_s": CACHE_S,
        "console_json_first_view_of_each_page": first_views,
        "plain_list": plain | {"rows": plain_rows},
        "speedup_html": plain["median_ms"] / console_html["median_ms"],
        "goal_ms": 300,
    }
    out = ROOT / "bench" / "results"
    (out / "console_jobs.json").write_text(json.dumps(result, indent=1) + "\n")
    rows = [("console jobs page (HTML, 50 rows, counts)", console_html), ("console jobs JSON (50 rows, counts)", console_json),
            ("console jobs JSON, state=FAILED", filtered),
            (f"console jobs JSON, first view of history pages 2-{first_views['loads'] + 1} (nothing of theirs read before)", first_views),
            (f"console jobs page, from its {CACHE_S:g} s cache (loads back to back)", cached), (f"`GET /v1/jobs` (`TenantJobs.list()`, {plain_rows} rows)", plain)]
    md = [f"# The console's jobs page with {args.jobs:,} jobs in the tenant's history", "",
          f"One run on {result['machine']}: a stack on free ports, {args.jobs:,} ended jobs of one tenant (flow runs with the "
          f"tenant's tags; the newest {args.with_mlflow} with an MLflow run of five steps), each console load after its cache expired, "
          f"{args.loads} loads each through the gateway, one after another. A job that ended over "
          f"{SETTLED_S:g} s ago keeps the step, reward and accuracy read at its first view; MLflow is asked about the others.", "",
          "| what | median ms | p95 ms |", "|---|---:|---:|",
          *[f"| {name} | {r['median_ms']:.0f} | {r['p95_ms']:.0f} |" for name, r in rows], "",
          f"The console's page against the plain list: **{result['speedup_html']:.1f}×** faster (goal: under 300 ms; "
          f"{'met' if console_html['p95_ms'] < 300 else 'not met'} at p95). Counts by state: "
          + ", ".join(f"{k.lower()} {v}" for k, v in counts.items()) + "."]
    (out / "console_jobs.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
