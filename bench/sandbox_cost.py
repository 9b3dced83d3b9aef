"""What the sandbox costs, measured: (a) `print(1)` through `Sandbox.run` (bubblewrap, prlimit, the
system python3, and the call's cgroups where it has them) beside a bare `python3 -c 'print(1)'` and
the same sandbox without cgroups, alternated in the same run, N each; (b) the
SandboxFusion-compatible service (`opentinker sandbox`, in this process) under 32 concurrent
`/run_code` calls: throughput and latency.

    python bench/sandbox_cost.py --n 50 --rounds 8
writes bench/results/sandbox_cost.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opentinker.tools.sandbox import PYTHON, Sandbox, SandboxLimits  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def startup(sandbox: Sandbox, n: int) -> dict:
    bare, boxed, plain = [], [], []
    uncounted = Sandbox(SandboxLimits(), cgroups=False)  # the fallback: what the cgroups themselves cost
    for _ in range(3):  # warm the page cache for all
        subprocess.run([PYTHON, "-c", "print(1)"], capture_output=True, check=True)
        sandbox.run("print(1)")
        uncounted.run("print(1)")
    for _ in range(n):
        start = time.perf_counter()
        assert uncounted.run("print(1)").stdout == "1\n"
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        done = subprocess.run([PYTHON, "-c", "print(1)"], capture_output=True)
        bare.append(time.perf_counter() - start)
        assert done.stdout == b"1\n"
        start = time.perf_counter()
        result = sandbox.run("print(1)")
        boxed.append(time.perf_counter() - start)
        assert result.stdout == "1\n", result
    bare_ms, boxed_ms, plain_ms = (statistics.median(x) * 1000 for x in (bare, boxed, plain))
    return {"n": n, "bare_median_ms": round(bare_ms, 2), "sandbox_median_ms": round(boxed_ms, 2),
            "cgroups": sandbox.groups is not None, "without_cgroups_median_ms": round(plain_ms, 2),
            "cgroups_added_ms": round(boxed_ms - plain_ms, 2),
            "added_ms": round(boxed_ms - bare_ms, 2), "ratio": round(boxed_ms / bare_ms, 2),
            "bare_p95_ms": round(percentile(bare, 0.95) * 1000, 2), "sandbox_p95_ms": round(percentile(boxed, 0.95) * 1000, 2)}


def service_load(sandbox: Sandbox, rounds: int, concurrency: int = 32) -> dict:
    import httpx

    from opentinker.tools.sandbox_service import new_key, serve_in_thread

    running = serve_in_thread(sandbox, new_key())
    client = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=concurrency, keepalive_expiry=20))

    def call(i: int) -> float:
        start = time.perf_counter()
        body = client.post(f"{running.endpoint}/run_code", json={"code": f"print({i} * 2)", "language": "python"}).json()
        assert body["status"] == "Success" and body["run_result"]["stdout"] == f"{i * 2}\n", body
        return time.perf_counter() - start

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(call, range(concurrency)))  # connections opened, caches warm
            start = time.perf_counter()
            latencies = list(pool.map(call, range(rounds * concurrency)))
            elapsed = time.perf_counter() - start
    finally:
        client.close()
        running.stop()
    return {"concurrency": concurrency, "calls": len(latencies), "max_running": sandbox.limits.max_running,
            "seconds": round(elapsed, 2), "calls_per_s": round(len(latencies) / elapsed, 1),
            "p50_ms": round(percentile(latencies, 0.5) * 1000, 1), "p95_ms": round(percentile(latencies, 0.95) * 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="runs of print(1) each way")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of 32 concurrent calls to the service")
    a = parser.parse_args()
    sandbox = Sandbox(SandboxLimits())
    load = [round(x, 2) for x in os.getloadavg()]  # other work on the machine moves every number here: compare within one run
    first = startup(sandbox, a.n)
    print(f"print(1): bare {first['bare_median_ms']} ms, sandbox {first['sandbox_median_ms']} ms (median of {a.n}): "
          f"+{first['added_ms']} ms, {first['ratio']}x", flush=True)
    second = service_load(sandbox, a.rounds)
    print(f"service, 32 concurrent: {second['calls']} calls in {second['seconds']} s = {second['calls_per_s']}/s, "
          f"p50 {second['p50_ms']} ms, p95 {second['p95_ms']} ms ({second['max_running']} running at once)", flush=True)
    bwrap = subprocess.run([sandbox.bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    python = subprocess.run([PYTHON, "--version"], capture_output=True, text=True).stdout.strip()
    meta = {"command": f"python bench/sandbox_cost.py --n {a.n} --rounds {a.rounds}", "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average_at_start": load, "kernel": platform.release(), "bwrap": bwrap, "python": python, "startup": first, "service": second}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sandbox_cost.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# The sandbox's cost", "", f"`{meta['command']}` (one run, {os.cpu_count()} CPUs, {bwrap}, {python}, kernel {platform.release()}; load average {load[0]} at its start)", "",
             f"## print(1), {a.n} runs each, alternated", "", "| way | median ms | p95 ms |", "|---|---:|---:|",
             f"| bare `python3 -c 'print(1)'` | {first['bare_median_ms']} | {first['bare_p95_ms']} |",
             f"| `Sandbox.run('print(1)')`{' (cgroups)' if first['cgroups'] else ' (no cgroups here)'} | {first['sandbox_median_ms']} | {first['sandbox_p95_ms']} |",
             f"| the same without cgroups (`cgroups=False`, the fallback) | {first['without_cgroups_median_ms']} | |", "",
             f"Added by the sandbox: {first['added_ms']} ms ({first['ratio']}x); the goal is at most 50 ms. "
             f"Of that, the call's cgroups (made, joined, removed): {first['cgroups_added_ms']} ms.", "",
             f"## The service under {second['concurrency']} concurrent calls", "",
             "| calls | running at once | seconds | calls/s | p50 ms | p95 ms |", "|---:|---:|---:|---:|---:|---:|",
             f"| {second['calls']} | {second['max_running']} | {second['seconds']} | {second['calls_per_s']} | {second['p50_ms']} | {second['p95_ms']} |", ""]
    (out / "sandbox_cost.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
