"""Scheduler under load, both ways in one run: N jobs (tiny model, 2 steps each) submitted at once
through the gateway to the `cpu` pool with 2 slots, first on a stack whose jobs each start their
own Ray (`ray_head: false`), then on a stack with the shared Ray head every job joins; each stack
is started by this script, loaded, and stopped before the next.

Sampled every 0.5 s: how many jobs hold slots (the `slots-cpu` global concurrency limit) and how
many the gateway reports RUNNING. Printed per way: the most ever running at once, submit-call
latency, submit→running latency (the queue wait; median, p95), run time per job, total time, and
the packing ratio total / (Σ run time / slots) — 1.0 would be perfect packing, the excess is the
cost of the scheduler hand-offs (worker poll, process start, Ray start or join, slot acquisition).

    python bench/scheduler_load.py --jobs 10 --slots 2
writes bench/results/scheduler_load.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = {"per-job Ray": {"ray_head": False}, "shared Ray head": {"ray_head": True}}


def job_config(tmp: Path) -> dict:
    from tests.conftest import tiny_spec

    return tiny_spec(tmp, optimization={"steps": 2}, evaluation={"every": 0, "n_samples": 8},
                     checkpoint={"every": 2}).model_dump(mode="json")


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def one_way(name: str, overrides: dict, args, tmp: Path) -> dict:
    """Start a stack configured `overrides` in `tmp`, load it with the burst, stop it. (`tmp` outlives
    the stack: this process's Prefect settings keep naming files of the first stack's state folder.)"""
    from opentinker.control.stack import Stack
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env
    from tests.stack_fixtures import local_settings

    saved = dict(os.environ)
    settings = local_settings(tmp / "state", cpu_slots=args.slots, gpu_slots=0, **overrides)
    os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
    stack = Stack(settings)
    print(f"[{name}] starting a local stack ...", flush=True)
    stack.up(timeout=240)
    try:
        return {"way": name, **run_load(settings, args, tmp)}
    finally:
        stack.down()
        os.environ.clear()
        os.environ.update(saved)


def row(r: dict) -> str:
    return (f"| {r['way']} | {r['completed']} / {r['jobs']} | {r['max_slots_held']} / {r['max_running_seen']} "
            f"| {r['submit_call_s']['median']:.2f} / {r['submit_call_s']['p95']:.2f} "
            f"| {r['queue_wait_s']['median']:.1f} / {r['queue_wait_s']['p95']:.1f} | {r['run_s_median']:.1f} "
            f"| {r['total_s']:.1f} | {r['ideal_s']:.1f} | **{r['packing_ratio']:.2f}** |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        results = [one_way(name, overrides, args, Path(tmp) / f"way{i}") for i, (name, overrides) in enumerate(WAYS.items())]
    out = ROOT / "bench" / "results" / "scheduler_load"
    out.with_suffix(".json").write_text(json.dumps({"jobs": args.jobs, "slots": args.slots, "cpus": os.cpu_count(),
                                                    "ways": results}, indent=2))
    md = (
        f"# Scheduler load: {args.jobs} jobs (tiny model, 2 steps) at once, `cpu` pool with {args.slots} slots, "
        f"{os.cpu_count()} cores\n\nBoth ways in one run, the same burst on a fresh stack each.\n\n"
        "| way | completed | most running (slots held / RUNNING seen) | submit call, median / p95 (s) "
        "| submit → running, median / p95 (s) | run time per job, median (s) | total (s) | Σ run / slots (s) | packing |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        + "\n".join(row(r) for r in results)
        + "\n\nPacking ratio = total / (Σ run time / slots); 1.00 = no scheduling gaps.\n"
    )
    out.with_suffix(".md").write_text(md)
    print(md)
    ok = all(r["completed"] == args.jobs and r["max_slots_held"] <= args.slots and r["max_running_seen"] <= args.slots
             for r in results)
    return 0 if ok else 1


def run_load(settings, args, tmp: Path) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from opentinker.client import SchedulerClient
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    deploy(settings)
    key = TenantStore(settings.state_dir / "tenants.json").create("bench")
    client = SchedulerClient(url=settings.gateway_url, api_key=key, timeout=180)  # a burst on 2 busy cores
    config = job_config(tmp)

    def submit(i: int) -> tuple[str, float, float]:
        t0 = time.perf_counter()
        job = client.submit_job(config={**config, "job_id": f"load-{i:02d}"})
        return job["job_id"], t0, time.perf_counter()

    start = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        submitted = list(pool.map(submit, range(args.jobs)))
    submit_at = {job_id: t0 for job_id, t0, _ in submitted}
    submit_call = [t1 - t0 for _, t0, t1 in submitted]
    print(f"submitted {args.jobs} jobs in {time.perf_counter() - start:.1f}s", flush=True)

    first_running: dict[str, float] = {}
    ended: dict[str, tuple[float, str]] = {}
    max_slots = max_running = 0
    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}), get_client(sync_client=True) as prefect:
        while len(ended) < args.jobs and time.perf_counter() - start < args.timeout:
            now = time.perf_counter()
            states = {j["job_id"]: j["state"] for j in client.list_jobs()}
            held = prefect.read_global_concurrency_limit_by_name("slots-cpu").active_slots
            running = [j for j, s in states.items() if s == "RUNNING"]
            max_slots, max_running = max(max_slots, held), max(max_running, len(running))
            for job_id in running:
                first_running.setdefault(job_id, now)
            for job_id, state in states.items():
                if state in ("COMPLETED", "FAILED", "CANCELLED") and job_id not in ended:
                    ended[job_id] = (now, state)
                    first_running.setdefault(job_id, now)  # ran between two samples
            print(f"\r{now - start:6.0f}s  running {len(running)}  slots {held}  done {len(ended)}/{args.jobs}  ", end="", flush=True)
            time.sleep(0.5)
    print()
    failures = {j: client.job_status(j) for j, (_, state) in ended.items() if state != "COMPLETED"}
    for job_id, status in failures.items():
        print(f"{job_id}: {status.get('state')}: {status.get('reason')}", flush=True)
    total = max((t for t, _ in ended.values()), default=time.perf_counter()) - start
    waits = [first_running[j] - submit_at[j] for j in first_running]
    runs = [ended[j][0] - first_running[j] for j in ended]
    return {
        "jobs": args.jobs, "slots": args.slots, "cpus": os.cpu_count(),
        "completed": sum(s == "COMPLETED" for _, s in ended.values()),
        "not_completed": {j: f"{st.get('state')}: {st.get('reason')}" for j, st in failures.items()},
        "max_slots_held": max_slots, "max_running_seen": max_running,
        "submit_call_s": {"median": statistics.median(submit_call), "p95": p95(submit_call)},
        "queue_wait_s": {"median": statistics.median(waits), "p95": p95(waits)},
        "run_s_median": statistics.median(runs), "total_s": total, "ideal_s": sum(runs) / args.slots,
        "packing_ratio": total / (sum(runs) / args.slots),
    }


if __name__ == "__main__":
    sys.exit(main())
