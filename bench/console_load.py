"""200 console page loads at once, against `/v1/health` and the tenant API timed alone and meanwhile.

Starts a stack on free ports (its own state folder) and gives a tenant a history with
`bench/console_jobs.py`'s helper (`--jobs` ended jobs, the newest `--with-mlflow` with an MLflow
run of five steps). Then, in one run:

1. alone: `/v1/health` (every 100 ms) and the tenant API (`GET /v1/jobs/{id}`, the status a client
   polls, and `GET /v1/jobs`, the plain list), each probed one call after another for `--seconds`;
2. under load: the same probes while a separate process keeps `--sessions` signed-in console
   sessions × `--loads` page loads in flight (200 by default) for `--seconds`. A page load is what
   a browser does on opening a page: the jobs list (HTML, then its JSON), or a job's page (HTML,
   then its JSON with the curves and its first log lines), alternately, over the jobs with MLflow
   runs (the newest `--running` of them live: Running flow runs, whose pages change). A 429 is
   waited out for its Retry-After, as the page's script would, and counted.

    python bench/console_load.py                      # 20 sessions × 10 loads, 200 jobs
    python bench/console_load.py --save-as before     # keep this run as the "before" of the next
writes bench/results/console_load.{json,md} (with --save-as NAME: console_load_NAME.json only; the
.md of a later run shows that one's numbers beside its own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.console_jobs import TENANT, history, p95  # noqa: E402 - after ROOT is on the path

RESULTS = ROOT / "bench" / "results"
HEALTH_GAP_S = 0.1


def summary(seconds: list[float]) -> dict:
    if not seconds:
        return {"calls": 0}
    return {"calls": len(seconds), "median_ms": 1000 * statistics.median(seconds), "p95_ms": 1000 * p95(seconds),
            "max_ms": 1000 * max(seconds)}


# --- the probes: sync clients in threads of this process ------------------------------------------
def probe(base: str, path: str, until: float, gap_s: float, headers: dict | None = None) -> list[float]:
    import httpx

    seconds = []
    with httpx.Client(base_url=base, timeout=120, headers=headers or {}) as client:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            client.get(path).raise_for_status()
            seconds.append(time.perf_counter() - t0)
            time.sleep(gap_s)
    return seconds


def probes(base: str, key: str, job_id: str, seconds: float) -> dict:
    until = time.monotonic() + seconds
    auth = {"Authorization": f"Bearer {key}"}
    jobs = {"health": ("/v1/health", HEALTH_GAP_S, None), "status": (f"/v1/jobs/{job_id}", 0.0, auth), "list": ("/v1/jobs", 0.0, auth)}
    out: dict[str, list[float]] = {}
    threads = [threading.Thread(target=lambda n=n, a=a: out.__setitem__(n, probe(base, a[0], until, a[1], a[2]))) for n, a in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {name: summary(values) for name, values in out.items()}


# --- the load: its own process, so that its event loop does not slow the probes' clients -----------
async def _load(base: str, key: str, job_ids: list[str], sessions: int, loads: int, seconds: float) -> dict:
    import httpx

    clients = []
    for _ in range(sessions):
        client = httpx.AsyncClient(base_url=base, timeout=300, limits=httpx.Limits(max_connections=loads))
        r = await client.post("/console/signin", data={"key": key}, follow_redirects=False)
        assert r.status_code == 303, r.text
        clients.append(client)
    print("ready", flush=True)
    until = time.monotonic() + seconds
    done, refused, waited, statuses = [], 0, 0.0, {}

    async def get(client, url: str) -> None:
        nonlocal refused, waited
        while True:
            r = await client.get(url)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 429:
                r.raise_for_status()
                return
            refused += 1
            pause = float(r.headers.get("retry-after", "1"))
            waited += pause
            await asyncio.sleep(pause)

    async def worker(client, n: int) -> None:
        while time.monotonic() < until:
            job = job_ids[n % len(job_ids)]
            urls = (["/console/jobs", "/console/api/jobs"] if n % 2 == 0 else
                    [f"/console/jobs/{job}", f"/console/api/jobs/{job}", f"/console/api/jobs/{job}/logs?offset=0"])
            t0 = time.perf_counter()
            for url in urls:
                await get(client, url)
            done.append(time.perf_counter() - t0)
            n += sessions * loads

    await asyncio.gather(*(worker(c, s * loads + i) for s, c in enumerate(clients) for i in range(loads)))
    for c in clients:
        await c.aclose()
    return {"page_loads": summary(done), "refused_429": refused, "retry_after_waited_s": waited,
            "responses_by_status": {str(k): v for k, v in sorted(statuses.items())}}


def load_worker(args_json: str) -> int:
    a = json.loads(args_json)
    result = asyncio.run(_load(a["base"], a["key"], a["job_ids"], a["sessions"], a["loads"], a["seconds"]))
    print(json.dumps(result), flush=True)
    return 0


def under_load(base: str, key: str, job_ids: list[str], args) -> tuple[dict, dict]:
    worker = subprocess.Popen([sys.executable, __file__, "--load-worker", json.dumps(
        {"base": base, "key": key, "job_ids": job_ids, "sessions": args.sessions, "loads": args.loads, "seconds": args.seconds})],
        stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    measured = probes(base, key, job_ids[0], args.seconds)
    out, _ = worker.communicate(timeout=900)
    assert worker.returncode == 0
    return measured, json.loads(out.strip().splitlines()[-1])


# --- results ---------------------------------------------------------------------------------
def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "opentinker/control/console", "opentinker/control/gateway"],
                               cwd=ROOT, capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return head + ("+changes" if dirty.strip() else "")


def bounds_in_use() -> dict | None:
    """The console's bounds as this checkout sets them (None: a console without them)."""
    try:
        from opentinker.control.console.bounds import ReadBounds
    except ImportError:
        return None
    b = ReadBounds()
    b.threads.shutdown()
    return {"per_session": b.per_session, "in_flight": b.in_flight, "wait_s": b.wait_s, "reads": b.reads.size, "renders": b.renders.size,
            "per_s": round(1 / b.pace.gap_s, 3), "rest": b.rest}


def markdown(r: dict, before: dict | None) -> str:
    def ms(x: dict) -> str:
        return f"{x['median_ms']:.0f} / {x['p95_ms']:.0f}" if x.get("calls") else "-"

    def ratio(run: dict, k: str) -> str:
        a, u = run["alone"][k], run["under_load"][k]
        return f"{u['median_ms'] / a['median_ms']:.2f}× / {u['p95_ms'] / a['p95_ms']:.2f}×"

    def loads(run: dict) -> str:
        pl = run["load"]["page_loads"]
        return (f"{pl.get('calls', 0)} page loads completed (median / p95 {ms(pl)} ms), {run['load']['refused_429']} answers 429, "
                f"responses by status: {', '.join(f'{k}: {v}' for k, v in run['load']['responses_by_status'].items())}")

    calls = [("`/v1/health`", "health"), ("`GET /v1/jobs/{id}` (a job's status)", "status"), ("`GET /v1/jobs` (the list)", "list")]
    runs = ([("before", before)] if before else []) + [("after", r)]
    head = "| call | " + " | ".join(f"{n}: alone | {n}: under load | {n}: load ÷ alone" for n, _ in runs) + " |"
    rows = [head, "|---|" + "---:|---:|---:|" * len(runs)]
    for label, k in calls:
        rows.append(f"| {label} | " + " | ".join(f"{ms(run['alone'][k])} | {ms(run['under_load'][k])} | {ratio(run, k)}" for _, run in runs) + " |")
    goals, bounds = r["goals"], r.get("bounds")
    md = ["# 200 console page loads at once: `/v1/health` and the tenant API meanwhile", "",
          f"On {r['machine']}, shared with other work (load average {r['load_average']} at the start), a stack on free ports with "
          f"{r['jobs']} jobs of one tenant: the newest {r['jobs_with_mlflow_runs']} with an MLflow run of five steps, the newest "
          f"{r.get('running', 0)} of those live (Running, so their pages change), the others ended. For {r['seconds']:g} s, "
          f"{r['sessions']} signed-in console sessions × {r['loads']} page loads each are kept in flight ({r['sessions'] * r['loads']} "
          "at once, from a separate process); a page load is the jobs list (HTML, then its JSON) or a job's page (HTML, then its JSON "
          f"with the curves, then its first log lines), alternately over those {r['jobs_with_mlflow_runs']} jobs, a 429 waited out "
          "for its Retry-After. Meanwhile the calls below are made one after another (health every 100 ms), and for as long before the load, alone: "
          "milliseconds, median / p95.", "",
          *rows, "",
          f"After (commit {r['commit']}; the console's bounds: " + (", ".join(f"{k} {v}" for k, v in bounds.items()) if bounds else "none")
          + f"): {loads(r)}." + (f" Before (commit {before['commit']}, {before.get('note') or 'the same bench'}; load average "
                                f"{before['load_average']} at its start): {loads(before)}." if before else ""),
          "",
          f"Goals: `/v1/health` p95 under {goals['health_p95_ms']} ms — **{'met' if goals['health_met'] else 'not met'}** "
          f"({r['under_load']['health']['p95_ms']:.0f} ms); the tenant API within {goals['api_ratio']:g}× its time alone (median) — "
          f"**{'met' if goals['api_met'] else 'not met'}** (a job's status {goals['status_ratio']:.2f}×, the list {goals['list_ratio']:.2f}×)."]
    return "\n".join(md) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--with-mlflow", type=int, default=50, help="how many of the newest jobs get an MLflow run")
    parser.add_argument("--running", type=int, default=10, help="how many of those are live (Running, their pages change)")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--loads", type=int, default=10, help="page loads in flight per session")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each phase lasts")
    parser.add_argument("--save-as", default="", help="write console_load_NAME.json only (e.g. before)")
    parser.add_argument("--note", default="", help="a few words kept with a --save-as run")
    parser.add_argument("--load-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_worker:
        return load_worker(args.load_worker)

    from opentinker.control.console.listing import SETTLED_S
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.stack import Stack
    from opentinker.control.submit import deploy
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env
    from tests.stack_fixtures import local_settings

    load_average, measured_commit = " ".join(f"{x:.1f}" for x in os.getloadavg()), commit()  # before the gateway starts
    tmp = Path(tempfile.mkdtemp(prefix="ot-console-load-"))
    settings = local_settings(tmp / "state", cpu_slots=2, gpu_slots=0)
    os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
    stack = Stack(settings)
    print("starting a local stack ...", flush=True)
    try:
        stack.up(timeout=240)  # inside: a start that fails (Ray's, on a busy machine) still stops what it started
        deploy(settings)
        key = TenantStore(settings.state_dir / "tenants.json").create(TENANT)
        print(f"making {args.jobs} jobs of history ...", flush=True)
        history(settings, args.jobs, tmp, args.with_mlflow, args.running)
        time.sleep(SETTLED_S + 1)  # a history is old: its newest jobs too ended over SETTLED_S ago
        job_ids = [f"{TENANT}-job{i:05d}" for i in range(args.jobs - 1, max(0, args.jobs - args.with_mlflow) - 1, -1)]
        base = settings.gateway_url
        probes(base, key, job_ids[0], 3)  # warm: imports, connections
        print(f"alone, {args.seconds:g} s ...", flush=True)
        alone = probes(base, key, job_ids[0], args.seconds)
        print(f"under {args.sessions} × {args.loads} console page loads, {args.seconds:g} s ...", flush=True)
        loaded, load = under_load(base, key, job_ids, args)
    finally:
        stack.down()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    status_ratio = loaded["status"]["median_ms"] / alone["status"]["median_ms"]
    list_ratio = loaded["list"]["median_ms"] / alone["list"]["median_ms"]
    result = {
        "command": shlex.join(["python", "bench/console_load.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average": load_average, "commit": measured_commit,
        "note": args.note, "jobs": args.jobs, "jobs_with_mlflow_runs": args.with_mlflow, "running": args.running, "sessions": args.sessions,
        "loads": args.loads, "seconds": args.seconds, "bounds": bounds_in_use(), "alone": alone, "under_load": loaded, "load": load,
        "goals": {"health_p95_ms": 200, "api_ratio": 2.0, "status_ratio": status_ratio, "list_ratio": list_ratio,
                  "health_met": loaded["health"]["p95_ms"] < 200, "api_met": max(status_ratio, list_ratio) <= 2.0},
    }
    if args.save_as:
        (RESULTS / f"console_load_{args.save_as}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(markdown(result, None))
        return 0
    before_path = RESULTS / "console_load_before.json"
    before = json.loads(before_path.read_text()) if before_path.exists() else None
    (RESULTS / "console_load.json").write_text(json.dumps(result | ({"before": before} if before else {}), indent=1) + "\n")
    md = markdown(result, before)
    (RESULTS / "console_load.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
