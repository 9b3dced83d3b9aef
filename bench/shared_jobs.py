"""N native LoRA RL jobs on one base-model worker vs. N jobs with a model each: memory, throughput, step latency.

Each tenant is the demo's job (examples/math_grpo.yaml: SmolLM2-135M, LoRA r16, GRPO, 8 prompts x
group 4, 24 new tokens), its own seed, running RL steps (rollout, then update) as the flow's tasks
call them.

    shared:   one process hosting every job on a BaseModelWorker (`resources.share_base: true`, the
              worker class itself, without Ray): one copy of the base; the jobs' episodes decode
              in shared batches, their updates take the base's training lock in turn.
    separate: one process per job (`share_base: false`, what a job's own actor runs): a model each,
              and torch threads = cores // N each (with every core each, two such processes took
              52 s a step at p95 against 6.5 s alone: their thread pools fight over the cores).

Measured as bench/shared_base.py measures Tinker tenants: the peak summed RSS of the processes
(sampled every 0.5 s), aggregate tokens/s (generated tokens plus the tokens of the trajectories
trained on, over the measured span, which starts when every tenant has finished its warm-up),
each tenant's step latency (rollout + update) p50/p95. The two ways alternate per N (separate first).

    python bench/shared_jobs.py                    # N = 1, 2, 4
    python bench/shared_jobs.py --tenants 2 --steps 1 --model tiny-random   # smoke run
writes bench/results/shared_jobs.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.shared_base import Memory, compared, write_results  # noqa: E402


def _spec(model: str, seed: int, shared: bool):
    from opentinker.core.spec import load_spec

    spec = load_spec(ROOT / "examples" / "math_grpo.yaml")
    folder = tempfile.mkdtemp(prefix="shared-jobs-bench-")
    return spec.model_copy(update={"seed": seed, "model": spec.model.model_copy(update={"name": model}),
                                   "resources": spec.resources.model_copy(update={"share_base": shared}),
                                   "checkpoint": spec.checkpoint.model_copy(update={"base_url": f"file://{folder}"})})


def run(way: str, seeds: list[int], model: str, warmup: int, steps: int, threads: int) -> None:
    """A bench process: host the jobs, play warm-up steps, say `ready`, wait for `go` on stdin,
    play the measured steps, print the result as JSON."""
    if way == "shared":
        from opentinker.orchestration.base_worker import BaseModelWorker

        worker = BaseModelWorker(num_gpus=0, idle_s=3600)
        keys = {seed: worker.host_job(_spec(model, seed, True), f"job{seed}", None)["key"] for seed in seeds}
        call = lambda seed, method, *a: worker.job_call(keys[seed], method, *a)  # noqa: E731
        batch = lambda seed, step: worker.jobs[keys[seed]].job.sampler.batch(step)  # noqa: E731
    else:
        import torch

        from opentinker.rl import RLJob

        torch.set_num_threads(threads)

        jobs = {seed: RLJob(_spec(model, seed, False), f"job{seed}") for seed in seeds}
        call = lambda seed, method, *a: getattr(jobs[seed], method)(*a)  # noqa: E731
        batch = lambda seed, step: jobs[seed].sampler.batch(step)  # noqa: E731
    warm = threading.Barrier(len(seeds), action=lambda: (print("ready", flush=True), sys.stdin.readline()))  # then every tenant starts
    out: dict = {"latencies": [], "tokens": 0, "spans": []}

    def tenant(seed: int) -> None:
        started = None
        for step in range(1, warmup + steps + 1):
            if step == warmup + 1:
                warm.wait(timeout=3600)
                started = time.perf_counter()
            t0 = time.perf_counter()
            played = call(seed, "rollout", step)
            trained = sum(len(t.token_ids) for t in batch(seed, step).trajectories)
            call(seed, "update", step)
            if started is not None:
                out["latencies"].append(time.perf_counter() - t0)
                out["tokens"] += played["rollout/generated_tokens"] + trained
        out["spans"].append((started, time.perf_counter()))

    threads = [threading.Thread(target=tenant, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out), flush=True)


def one_way(n: int, shared: bool, args) -> dict:
    threads = max(1, (os.cpu_count() or 1) // n)  # separate: the cores split between the jobs (all of them each would thrash)
    base = [sys.executable, __file__, "--run", "shared" if shared else "own", "--model", args.model, "--threads", str(threads),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--seeds"]
    seeds = list(range(n))
    groups = [seeds] if shared else [[s] for s in seeds]
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([*base, *map(str, g)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for g in groups]
    memory = Memory([p.pid for p in procs])
    for p in procs:  # every job warmed up
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"bench process said {line!r} (exit {p.wait()})")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait(timeout=120)
    peak = memory.done()
    spans = [s for r in results for s in r["spans"]]
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    lat = sorted(x for r in results for x in r["latencies"])
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"rss_mb": peak / 2**20, "tokens_per_s": sum(r["tokens"] for r in results) / wall, "p50_s": pick(0.5),
            "p95_s": pick(0.95), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", choices=["shared", "own"], help=argparse.SUPPRESS)
    parser.add_argument("--seeds", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    if args.run:
        return run(args.run, args.seeds, args.model, args.warmup, args.steps, args.threads)
    rows = [compared(n, one_way(n, False, args), one_way(n, True, args)) for n in args.tenants]  # separate first, then shared
    write_results("shared_jobs", rows, args.model, {"spec": "examples/math_grpo.yaml", "steps": args.steps, "warmup": args.warmup},
                  f"N native LoRA RL jobs on one base-model worker vs. a model per job ({args.model})",
                  f"Each job: the demo's spec (examples/math_grpo.yaml, its own seed), {args.steps} measured steps (rollout + update) "
                  f"after {args.warmup} warm-up. Shared: one process, the jobs hosted on a BaseModelWorker (`resources.share_base: "
                  "true`); separate: one process per job, torch threads = cores // N each.", "jobs")

if __name__ == "__main__":
    main()
