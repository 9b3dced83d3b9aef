"""Streaming rollouts and off-policy training against the synchronous job and the lock-step loop,
on the same seeds, one run.

Task: examples/math_tool_grpo.yaml (SmolLM2-135M-Instruct, LoRA r16, GRPO, 8 prompts x 4 samples,
up to 4 turns) with the calculator answering as a remote tool would: lognormal latency, mean
0.5 s, sigma 1.0 (`tool_latency`, seeded: the same problems wait the same times every run).
Ways, each in a process of its own, one after another:

- `k=0`: this code, algorithm.max_staleness 0: episodes are streams, a step's groups start once
  the previous update is published (the synchronous job); torch on every core;
- `k=2`: this code, max_staleness 2: the producer plays up to two steps ahead while the trainer
  updates, on its own model copy; the cores split between the two (torch: one thread each), both
  threads of one process (`opentinker run`'s layout);
- `k=2 actors`: the same job as a flow runs it: the flow's step calls (tasks/steps.py, without
  Prefect) on a Policy and a Sampler Ray actor, two processes of a core each;
- `lockstep`: the synchronous job of the code before streaming (`--lockstep-ref`, checked out in a
  git worktree of this repository): every turn of every episode waits for the slowest.

Per way: training episodes per second (of the steps' own time, evaluations left out), the greedy
held-out accuracy curve against wall time (evaluations every --every steps), and for `k=2` the
version lag of trained tokens and the groups dropped. Ratios: `k=2` against `k=0` episodes/s (goal
>= 1.6x) and wall time to reach `k=0`'s final held-out accuracy (goal <= 0.7x); `k=0` against
`lockstep` episodes/s (goal >= 2x). `--demo` also times examples/math_grpo.yaml (no latency) with
k=0 and k=2 to 75% greedy held-out accuracy (goal <= 0.8x).

    python bench/async_rl.py                                  # all of it, about two hours on the 2-core CPU
    python bench/async_rl.py --steps 2 --every 1 --eval-n 8 --model tiny-random --out /tmp/smoke   # a smoke run
    python bench/async_rl.py --skip k=k,lockstep --steps 8 --every 4 --out bench/results/async_rl_actors   # k=0 against the actors (~30 min)
writes bench/results/async_rl.{json,md} and the plot's data (docs generate the plot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LATENCY = {"distribution": "lognormal", "mean_s": 0.5, "sigma": 1.0}
LOCKSTEP_REF = "7e48e46"  # main before streaming rollouts landed (its agent loop is the lock-step one)

# One way's run, in a fresh process (the code under test is whatever `sys.path[0]` holds).
RUN = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(int(sys.argv[3]))
from opentinker.cli.common import quiet_libraries
from opentinker.core.spec import parse_spec
from opentinker.rl import RLJob
quiet_libraries()
spec = parse_spec(json.loads(sys.argv[2]))
if sys.argv[4] == "actors":  # the service's layout: the flow's step calls on the job's Ray actors, without Prefect
    import ray
    from opentinker.orchestration.actors import create_actors
    from opentinker.rl import LoopHooks, run_steps
    from tasks.steps import TaskSteps
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    class OverActors(TaskSteps):
        def _run(self, step_task, step, **kwargs):
            return step_task.fn(actors=self.actors, job_id=self.job_id, step=step, **kwargs)
    class ActorJob:
        def __init__(self):
            self.actors = create_actors(spec, "bench")
        def run(self, on_step, on_eval):
            return run_steps(spec, OverActors(self.actors, "bench"), LoopHooks(on_step=on_step, on_eval=on_eval))
        def close(self):
            self.actors.kill()
            ray.shutdown()
    job = ActorJob()
else:
    job = RLJob(spec, job_id="bench")
t0 = time.perf_counter()
curve, steps = [], []
def on_eval(e):
    curve.append({"step": e.step, "wall_s": time.perf_counter() - t0, "accuracy": e.metrics.get("eval/accuracy", 0.0),
                  "eval_s": e.metrics.get("eval/seconds", 0.0)})
def on_step(report):
    m = report.metrics
    steps.append({"step": report.step, "seconds": m.get("step/seconds", 0.0), "eval_s": m.get("eval/seconds", 0.0),
                  "episodes": m.get("rollout/episodes", 0.0), "lag_mean": m.get("rollout/version_lag_mean", 0.0),
                  "lag_max": m.get("rollout/version_lag_max", 0.0), "dropped": m.get("rollout/groups_dropped", 0.0),
                  "lag_shares": {k.rsplit("_", 1)[1]: v for k, v in m.items() if k.startswith("rollout/version_lag_share_")},
                  "env_p95": m.get("rollout/env_step_p95", 0.0)})
job.run(on_step=on_step, on_eval=on_eval)
if hasattr(job, "close"):
    job.close()
print("RESULT " + json.dumps({"curve": curve, "steps": steps, "wall_s": time.perf_counter() - t0}), flush=True)
"""


def run_way(code_root: Path, data: dict, threads: int, layout: str = "process") -> dict:
    """One way in a fresh process: the job in that process ("process"), or on Ray actors of their
    own ("actors": what a flow runs; with max_staleness > 0 the producer and the trainer are two
    processes, a core each on this machine)."""
    out = subprocess.run([sys.executable, "-c", RUN, str(code_root), json.dumps(data), str(threads), layout], capture_output=True, text=True,
                         env=os.environ | {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}, cwd=str(code_root))
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the run failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def summary(result: dict) -> dict:
    steps = result["steps"]
    train_s = sum(s["seconds"] - s["eval_s"] for s in steps)
    episodes = sum(s["episodes"] for s in steps)
    return {"episodes_per_s": episodes / train_s if train_s else 0.0, "train_s": train_s, "wall_s": result["wall_s"],
            "final_accuracy": result["curve"][-1]["accuracy"] if result["curve"] else 0.0,
            "lag_mean": sum(s["lag_mean"] for s in steps) / max(len(steps), 1), "lag_max": max((s["lag_max"] for s in steps), default=0),
            "dropped": sum(s["dropped"] for s in steps)}


def train_times(curve: list[dict]) -> list[float]:
    """Each evaluation's wall time with the evaluations' own time left out."""
    out, spent = [], 0.0
    for point in curve:
        spent += point["eval_s"]
        out.append(point["wall_s"] - spent)
    return out


def lag_histogram(steps: list[dict]) -> dict[str, float]:
    """The share of trained tokens per version lag, over all steps (each step weighs the same)."""
    shares: dict[str, float] = {}
    for s in steps:
        for lag, share in s.get("lag_shares", {}).items():
            shares[lag] = shares.get(lag, 0.0) + share / len(steps)
    return dict(sorted(shares.items(), key=lambda kv: int(kv[0])))


def time_to(curve: list[dict], accuracy: float) -> float | None:
    """Wall seconds (evaluations left out) until the greedy held-out accuracy first reaches `accuracy`."""
    spent = 0.0
    for point in curve:
        spent += point["eval_s"]
        if point["accuracy"] >= accuracy - 1e-9:
            return point["wall_s"] - spent
    return None


def spec_data(path: str, model: str, steps: int, every: int, eval_n: int, k: int, tmp: str, latency: dict | None, seed: int) -> dict:
    """The way's spec: `tmp` a folder of its own (a job finds its checkpoints there)."""
    from opentinker.core.spec import load_spec

    base = load_spec(path).model_dump(mode="json", exclude_unset=True)  # what the file sets: the lock-step ref predates later fields
    env = base["env"]
    if latency is not None:
        config = env["config"] | {"game_kwargs": env["config"].get("game_kwargs", {}) | {"tool_latency": latency}}
        env = env | {"config": config}
    data = base | {"model": base["model"] | {"name": model}, "optimization": base["optimization"] | {"steps": steps},
                   "evaluation": base["evaluation"] | {"every": every, "n_samples": eval_n, "greedy": True},
                   "checkpoint": base["checkpoint"] | {"every": 0, "base_url": f"file://{tmp}"}, "env": env, "seed": seed}
    if k:
        data["algorithm"] = base["algorithm"] | {"max_staleness": k}
    return data


def lockstep_tree(ref: str) -> Path:
    """A git worktree of `ref` (the code before streaming) to run the lock-step baseline from, with
    today's environments (the calculator's latency option came with streaming)."""
    import shutil

    tree = Path(tempfile.mkdtemp(prefix="lockstep-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True, capture_output=True)
    shutil.copytree(ROOT / "envs", tree / "envs", dirs_exist_ok=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--eval-n", type=int, default=32)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--lockstep-ref", default=LOCKSTEP_REF, help="the commit whose agent loop is the lock-step one ('' to skip)")
    parser.add_argument("--demo", action="store_true", help="also examples/math_grpo.yaml, k=0 and k against 75%% accuracy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="ways left out, comma-separated: 'k=k' (in one process), 'k=k actors', 'lockstep'")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_rl"))
    args = parser.parse_args()
    skip = {w.strip() for w in args.skip.split(",") if w.strip()}
    import torch

    cores = os.cpu_count() or 1
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        task = str(ROOT / "examples" / "math_tool_grpo.yaml")
        ways = (("k=0", 0, cores, "process"), (f"k={args.k}", args.k, max(1, cores // 2), "process"),
                (f"k={args.k} actors", args.k, max(1, cores // 2), "actors"))
        for way, k, threads, layout in ways:
            if way.replace(f"={args.k}", "=k") in skip:
                continue
            print(f"{way} ...", flush=True)
            data = spec_data(task, args.model, args.steps, args.every, args.eval_n, k, f"{tmp}/{way}", LATENCY, args.seed)
            results[way] = run_way(ROOT, data, threads, layout)
        if args.lockstep_ref and "lockstep" not in skip:
            print("lockstep ...", flush=True)
            tree = lockstep_tree(args.lockstep_ref)
            try:
                data = spec_data(task, args.model, args.steps, args.every, args.eval_n, 0, f"{tmp}/lockstep", LATENCY, args.seed)
                data["algorithm"].pop("importance_cap", None)  # a field the older spec does not know
                results["lockstep"] = run_way(tree, data, cores)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        if args.demo:
            demo = str(ROOT / "examples" / "math_grpo.yaml")
            for way, k, threads in (("demo k=0", 0, cores), (f"demo k={args.k}", args.k, max(1, cores // 2))):
                print(f"{way} ...", flush=True)
                results[way] = run_way(ROOT, spec_data(demo, args.model, 25, 5, 64, k, f"{tmp}/{way}", None, args.seed), threads)
    stats = {way: summary(r) for way, r in results.items()}
    sync = stats["k=0"]
    target = sync["final_accuracy"]
    reach_sync = time_to(results["k=0"]["curve"], target)
    ratios = {}
    for way, suffix in ((f"k={args.k}", ""), (f"k={args.k} actors", "_actors")):
        if way in stats:
            reach = time_to(results[way]["curve"], target)
            ratios["episodes_per_s" + suffix] = stats[way]["episodes_per_s"] / sync["episodes_per_s"] if sync["episodes_per_s"] else None
            ratios["time_to_sync_final_accuracy" + suffix] = reach / reach_sync if reach and reach_sync else None
    if "lockstep" in stats:
        lock = stats["lockstep"]["episodes_per_s"]
        ratios["streaming_vs_lockstep_episodes_per_s"] = sync["episodes_per_s"] / lock if lock else None
    if args.demo:
        a, b = time_to(results["demo k=0"]["curve"], 0.75), time_to(results[f"demo k={args.k}"]["curve"], 0.75)
        ratios["demo_time_to_75"] = b / a if a and b else None
    plot = {"x": "wall seconds (evaluations left out)", "y": "greedy held-out accuracy",
            "series": {way: [[t, p["accuracy"]] for p, t in zip(r["curve"], train_times(r["curve"]))]
                       for way, r in results.items() if not way.startswith("demo")}}
    result = {"command": " ".join(["python", "bench/async_rl.py", *sys.argv[1:]]), "plot": plot,
              "machine": f"{platform.machine()}, {cores} CPU cores, torch {torch.__version__}", "latency": LATENCY,
              "stats": stats, "ratios": ratios, "target_accuracy": target, "runs": results}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    fmt = lambda x: "not reached" if x is None else f"{x:.2f}x"  # noqa: E731 - None: a way never reached the accuracy
    md = [f"# Streaming rollouts and bounded staleness ({args.model})", "",
          f"{result['machine']}. examples/math_tool_grpo.yaml, {args.steps} steps, the calculator's latency lognormal (mean 0.5 s, "
          f"sigma 1.0); greedy held-out accuracy on {args.eval_n} problems every {args.every} steps. Each way in a process of its own.", "",
          "| way | episodes/s | train s | final accuracy | version lag mean / max | groups dropped |", "|---|---:|---:|---:|---:|---:|"]
    for way, st in stats.items():
        md.append(f"| {way} | {st['episodes_per_s']:.3f} | {st['train_s']:.0f} | {st['final_accuracy']:.1%} | "
                  f"{st['lag_mean']:.2f} / {st['lag_max']:.0f} | {st['dropped']:.0f} |")
    for way, suffix, where in ((f"k={args.k}", "", "in one process"), (f"k={args.k} actors", "_actors", "on Ray actors, as a flow runs it")):
        if way not in results:
            continue
        histogram = lag_histogram(results[way]["steps"])
        md += ["", f"Version lag of the tokens {way} trained on (trainer version - the version that drew them): "
               + ", ".join(f"{lag}: {share:.1%}" for lag, share in histogram.items()) + "."]
        md += ["", f"- k={args.k} {where} against k=0, episodes/s: **{fmt(ratios['episodes_per_s' + suffix])}** (goal >= 1.6)",
               f"- k={args.k} {where} against k=0, wall time to k=0's final accuracy ({target:.1%}): "
               f"**{fmt(ratios['time_to_sync_final_accuracy' + suffix])}** (goal <= 0.7)"]
    if "streaming_vs_lockstep_episodes_per_s" in ratios:
        md.append(f"- streaming (k=0) against the lock-step loop ({args.lockstep_ref}), episodes/s: "
                  f"**{fmt(ratios['streaming_vs_lockstep_episodes_per_s'])}** (goal >= 2)")
    if args.demo:
        md.append(f"- the demo (no latency), k={args.k} against k=0, wall time to 75% greedy accuracy: **{fmt(ratios['demo_time_to_75'])}** (goal <= 0.8)")
    md += ["", f"Made with `{result['command']}`"]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
