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
With N > 1 the shared way first plays the jobs' rollouts one after another, then all at once (their
episodes in one decode batch), and reports the generated tokens/s of each: what joining the jobs'
rows saves on this machine (on a 2-core CPU, nothing: a demo step's decode is compute-bound).

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
from bench.shared_base import Memory, compared, quantile, write_results  # noqa: E402


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
    out: dict = {"latencies": [], "rollouts": [], "updates": [], "tokens": 0, "spans": []}

    def batching() -> None:
        """Shared, N > 1: the jobs' rollouts one after another, then all at once (one decode batch),
        as generated tokens/s each way: what joining the jobs' episodes saves on this machine."""
        probe = warmup + 1  # played again by the measured steps (a rollout keeps only its newest batch)
        t0 = time.perf_counter()
        alone = sum(call(seed, "rollout", probe)["rollout/generated_tokens"] for seed in seeds)
        engine = worker.jobs[keys[seeds[0]]].job.sampler.engine.engine  # the base's MultiLoraEngine
        before = (engine.batches, engine.mixed)
        t1 = time.perf_counter()
        together = [0.0] * len(seeds)
        threads = [threading.Thread(target=lambda i, s: together.__setitem__(i, call(s, "rollout", probe)["rollout/generated_tokens"]),
                                    args=(i, seed)) for i, seed in enumerate(seeds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["batching"] = {"in_turn_tokens_per_s": alone / (t1 - t0), "one_batch_tokens_per_s": sum(together) / (time.perf_counter() - t1),
                           "batches": engine.batches - before[0], "mixed_batches": engine.mixed - before[1]}

    def ready() -> None:
        if way == "shared" and len(seeds) > 1:
            batching()
        print("ready", flush=True)
        sys.stdin.readline()

    warm = threading.Barrier(len(seeds), action=ready)  # then every tenant starts

    def tenant(seed: int) -> None:
        started = None
        for step in range(1, warmup + steps + 1):
            if step == warmup + 1:
                warm.wait(timeout=3600)
                started = time.perf_counter()
            t0 = time.perf_counter()
            played = call(seed, "rollout", step)
            t1 = time.perf_counter()
            trained = sum(len(t.token_ids) for t in batch(seed, step).trajectories)
            call(seed, "update", step)
            if started is not None:
                out["latencies"].append(time.perf_counter() - t0)
                out["rollouts"].append(t1 - t0)
                out["updates"].append(time.perf_counter() - t1)
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
    def pick(key: str, q: float) -> float:
        return quantile([x for r in results for x in r[key]], q)

    return {"rss_mb": peak / 2**20, "tokens_per_s": sum(r["tokens"] for r in results) / wall, "p50_s": pick("latencies", 0.5),
            "p95_s": pick("latencies", 0.95), "rollout_p50_s": pick("rollouts", 0.5), "update_p50_s": pick("updates", 0.5), "wall_s": wall,
            **({"batching": results[0]["batching"]} if "batching" in results[0] else {})}


def where_the_time_goes(rows: list[dict]) -> list[str]:
    """A step's two halves per N (p50), and what one decode batch of the N jobs' episodes gains
    over their rollouts in turn on this machine: the arithmetic that sharing can save here."""
    lines = ["", "A step's halves (p50 s, shared / separate), and the shared worker's generated tokens/s with the jobs' "
             "rollouts in one decode batch against in turn (measured before the steps):", "",
             "| jobs | rollout | update | one batch / in turn (tok/s) | ratio | decode batches of several jobs |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, p, b = r["shared"], r["separate"], r["shared"].get("batching")
        gain = (f"{b['one_batch_tokens_per_s']:.0f} / {b['in_turn_tokens_per_s']:.0f} | **{b['one_batch_tokens_per_s'] / b['in_turn_tokens_per_s']:.2f}** | "
                f"{b['mixed_batches']} of {b['batches']}") if b else "- | - | -"
        lines.append(f"| {r['tenants']} | {s['rollout_p50_s']:.2f} / {p['rollout_p50_s']:.2f} | {s['update_p50_s']:.2f} / {p['update_p50_s']:.2f} | {gain} |")
    return lines


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
                  "true`); separate: one process per job, torch threads = cores // N each.", "jobs", where_the_time_goes(rows))

if __name__ == "__main__":
    main()
