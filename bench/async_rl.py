"""Streaming rollouts and bounded staleness where agentic RL lives: a tool as slow as a turn's
generation, measured in rho on this machine, every way in one run.

rho = the tool's mean latency / the mean time a turn waits for the engine's reply, on this machine,
with the job's model, engine and batch. On a GPU a turn takes about 0.1-1 s and a remote tool (a
sandbox, a web call, a judge) 0.5-5 s, so rho ~ 1 is where agentic RL lives; on the 2-core CPU a
turn takes seconds, so an absolute latency (the earlier benchmark's 0.5 s) put it at rho ~ 0.1,
where there is little to hide. The run first calibrates a turn's time (the k = 0 job, no latency,
--calibration-steps steps, the first left out), then sets the calculator's latency (lognormal,
sigma 1, seeded per question and call: the same problems wait the same times in every way) to rho
times it, for each rho of --rhos.

Task: examples/math_tool_grpo.yaml (SmolLM2-135M-Instruct, LoRA r16, GRPO, 8 prompts x 4 samples,
up to 4 turns), sampled by the engine jobs use by default (`rollout.engine: auto`: vLLM where it
runs; the run records which). Ways, each in a process of its own, one after another:

- `lockstep`: the k = 0 job with the lock-step barrier in its environment (bench/lockstep_game.py):
  every turn waits for all episodes' generation of that turn and for the slowest tool call;
- `k=0`: the same job streaming (each episode on its own; a step's groups start once the previous
  update is published), in one process as a colocated job's actor runs it;
- `k=K actors`: max_staleness K in the stack's layout: the flow's step calls (tasks/steps.py,
  without Prefect) on a Policy and a Sampler Ray actor, the producer playing up to K steps ahead.

Per way: training episodes/s (the steps' own time, evaluations left out), the greedy held-out
accuracy curve against that time, where the time went (the engine computing, the trainer updating,
a turn waiting for its reply, an episode waiting on its tools, the step's last group after its
median one, evaluations) and the first step's time. Goals at rho = 1: k = 0 >= 2x lockstep's
episodes/s; k = K actors >= 1.3x k = 0's; its wall time to k = 0's final accuracy <= 0.75x.
`--check-recorded` also runs the barrier with the recorded lock-step run's setting (the HF engine,
0.5 s absolute latency) and compares it with bench/results/async_rl_lockstep.json, measured with
the lock-step loop itself (7e48e46) on an earlier day.

    python bench/async_rl.py                    # rho 0.1, 1 and 3, about 70 min on the 2-core CPU
    python bench/async_rl.py --rhos 1 --steps 2 --every 1 --eval-n 8 --calibration-steps 2 --model tiny-random --out /tmp/smoke
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
SIGMA = 1.0
from bench.lockstep_game import BARRIER_TIMEOUT_S  # noqa: E402 - after ROOT is on the path
RECORDED = ROOT / "bench" / "results" / "async_rl_lockstep.json"  # the lock-step loop's own run (7e48e46)
STEP_TIMEOUT_S = 600.0  # a tool of rho = 3 draws tails past the default 10 s, and the barrier waits inside a step

# One way's run, in a fresh process.
RUN = r"""
import json, os, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from opentinker.cli.common import quiet_libraries
from opentinker.core.spec import parse_spec
from opentinker.inference.launch import rollout_server
from opentinker.rl import RLJob
quiet_libraries()
spec = parse_spec(json.loads(sys.argv[1]))
if sys.argv[3] == "actors":  # the service's layout: the flow's step calls on the job's Ray actors, without Prefect
    import ray
    from opentinker.orchestration.actors import create_actors
    from opentinker.orchestration.layout import layout_for
    from opentinker.rl import LoopHooks, run_steps
    from tasks.steps import TaskSteps
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    class OverActors(TaskSteps):
        def _run(self, step_task, step, **kwargs):
            return step_task.fn(actors=self.actors, job_id=self.job_id, step=step, **kwargs)
    class ActorJob:
        def __init__(self):
            layout = layout_for(spec, "bench", None, on_cluster=False)
            self.actors = create_actors(layout, "bench")
            self.engine_choice = layout.engine_choice
        def run(self, on_step, on_eval):
            return run_steps(spec, OverActors(self.actors, "bench"), LoopHooks(on_step=on_step, on_eval=on_eval))
        def close(self):
            self.actors.kill()
            ray.shutdown()
    job = ActorJob()
else:
    job = RLJob(spec, job_id="bench", start_server=rollout_server)
KEYS = ("step/seconds", "eval/seconds", "rollout/episodes", "rollout/seconds", "update/seconds", "rollout/engine_seconds",
        "rollout/turn_seconds_mean", "rollout/episode_tool_seconds", "rollout/straggler_seconds", "rollout/version_lag_mean",
        "rollout/version_lag_max", "rollout/groups_dropped", "rollout/env_step_p95", "rollout/failed_episodes", "rollout/sync_seconds")
t0 = time.perf_counter()
curve, steps = [], []
def on_eval(e):
    curve.append({"step": e.step, "wall_s": time.perf_counter() - t0, "accuracy": e.metrics.get("eval/accuracy", 0.0),
                  "eval_s": e.metrics.get("eval/seconds", 0.0)})
def on_step(report):
    steps.append({"step": report.step, **{k: report.metrics.get(k, 0.0) for k in KEYS}})
try:
    job.run(on_step=on_step, on_eval=on_eval)
finally:
    job.close()
stalls = 0
if "bench.lockstep_game" in sys.modules:
    stalls = sys.modules["bench.lockstep_game"].BARRIER.stalls
print("RESULT " + json.dumps({"curve": curve, "steps": steps, "wall_s": time.perf_counter() - t0, "engine": job.engine_choice,
                              "barrier_stalls": stalls}), flush=True)
"""


def run_way(data: dict, threads: int, layout: str = "process") -> dict:
    """One way in a fresh process: the job in that process ("process"), or on Ray actors of their
    own ("actors": what a flow runs; at max_staleness > 0 the producer and the trainer are two processes)."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT),
                        "OPENTINKER_GAME_ALLOWLIST": "envs,bench.lockstep_game"}
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps(data), str(threads), layout], capture_output=True, text=True, env=env, cwd=str(ROOT))
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the run failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def spec_data(steps: int, every: int, eval_n: int, k: int, tmp: str, latency: dict | None, seed: int, lockstep: bool = False,
              model: str = "smollm2-135m-instruct", engine: str = "auto") -> dict:
    """A way's spec: the calculator task with `latency` (None: none), `tmp` a folder of its own."""
    from opentinker.core.spec import load_spec

    base = load_spec(str(ROOT / "examples" / "math_tool_grpo.yaml")).model_dump(mode="json", exclude_unset=True)
    env, rollout = base["env"], base["rollout"]
    kwargs = env["config"].get("game_kwargs", {}) | ({"tool_latency": latency} if latency else {})
    if lockstep:
        env = env | {"game": "bench.lockstep_game:LockstepMathToolGame"}
        kwargs |= {"max_turns": rollout["max_turns"]}
    env = env | {"config": env["config"] | {"game_kwargs": kwargs}}
    return base | {"model": base["model"] | {"name": model}, "optimization": base["optimization"] | {"steps": steps},
                   "rollout": rollout | {"step_timeout_s": STEP_TIMEOUT_S, "engine": engine},
                   "algorithm": base["algorithm"] | {"max_staleness": k},
                   "evaluation": base["evaluation"] | {"every": every, "n_samples": eval_n, "greedy": True},
                   "checkpoint": base["checkpoint"] | {"every": 0, "base_url": f"file://{tmp}"}, "env": env, "seed": seed}


def total(steps: list[dict], key: str) -> float:
    return sum(s.get(key, 0.0) for s in steps)


def summary(result: dict) -> dict:
    """A way's episodes/s, accuracy, staleness and where its time went (seconds over all steps)."""
    steps = result["steps"]
    train_s = total(steps, "step/seconds") - total(steps, "eval/seconds")
    episodes = total(steps, "rollout/episodes")
    return {"episodes_per_s": episodes / train_s if train_s else 0.0, "train_s": train_s, "wall_s": result["wall_s"],
            "final_accuracy": result["curve"][-1]["accuracy"] if result["curve"] else 0.0,
            "first_step_s": steps[0]["step/seconds"] - steps[0].get("eval/seconds", 0.0) if steps else 0.0,
            "lag_mean": total(steps, "rollout/version_lag_mean") / max(len(steps), 1),
            "lag_max": max((s["rollout/version_lag_max"] for s in steps), default=0), "dropped": total(steps, "rollout/groups_dropped"),
            "failed_episodes": total(steps, "rollout/failed_episodes"), "barrier_stalls": result.get("barrier_stalls", 0),
            "time": {"engine requests": total(steps, "rollout/engine_seconds"), "trainer busy": total(steps, "update/seconds"),
                     "trainer waiting for rollouts": total(steps, "rollout/seconds"),
                     "an episode on its tools": total(steps, "rollout/episode_tool_seconds"),
                     "slowest group after the median": total(steps, "rollout/straggler_seconds"),
                     "evaluation": sum(p["eval_s"] for p in result["curve"])},
            "turn_s": total(steps, "rollout/turn_seconds_mean") / max(len(steps), 1), "engine": result.get("engine")}


def time_to(curve: list[dict], accuracy: float) -> float | None:
    """Seconds (evaluations left out) until the greedy held-out accuracy first reaches `accuracy`."""
    spent = 0.0
    for point in curve:
        spent += point["eval_s"]
        if point["accuracy"] >= accuracy - 1e-9:
            return point["wall_s"] - spent
    return None


def train_times(curve: list[dict]) -> list[float]:
    out, spent = [], 0.0
    for point in curve:
        spent += point["eval_s"]
        out.append(point["wall_s"] - spent)
    return out


def calibrate(args, tmp: str, cores: int) -> tuple[float, dict]:
    """A turn's mean wait for the engine's reply with no tool latency (the first step left out: it warms the engine)."""
    result = run_way(spec_data(args.calibration_steps, 0, 4, 0, f"{tmp}/calibration", None, args.seed, model=args.model), cores)
    later = result["steps"][1:] or result["steps"]
    return sum(s["rollout/turn_seconds_mean"] for s in later) / len(later), result


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def time_ratio(way: dict, baseline: dict, accuracy: float) -> float | None:
    """`way`'s time to `accuracy` over `baseline`'s (None: either never reached it, or there is nothing to reach)."""
    return ratio(time_to(way["curve"], accuracy), time_to(baseline["curve"], accuracy)) if accuracy > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rhos", default="0.1,1,3")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="tiny-random for a smoke run (the HF engine: vLLM cannot run it)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--eval-n", type=int, default=32)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--calibration-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-recorded", action="store_true", help="also the barrier against the recorded lock-step loop's run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async_rl"))
    args = parser.parse_args()
    import torch

    cores = os.cpu_count() or 1
    rhos = [float(r) for r in args.rhos.split(",")]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print("calibrating a turn's time ...", flush=True)
        turn_s, runs["calibration"] = calibrate(args, tmp, cores)
        print(f"a turn waits {turn_s:.2f} s for its reply", flush=True)
        for rho in rhos:
            latency = {"distribution": "lognormal", "mean_s": rho * turn_s, "sigma": SIGMA, "seed": args.seed}
            for way, k, threads, layout, lockstep in (("lockstep", 0, cores, "process", True), ("k=0", 0, cores, "process", False),
                                                      (f"k={args.k} actors", args.k, max(1, cores // 2), "actors", False)):
                print(f"rho {rho:g}: {way} ...", flush=True)
                data = spec_data(args.steps, args.every, args.eval_n, k, f"{tmp}/{rho}-{way}", latency, args.seed, lockstep, args.model)
                runs[f"rho={rho:g} {way}"] = run_way(data, threads, layout) | {"latency": latency}
        if args.check_recorded:
            recorded = json.loads(RECORDED.read_text())
            print("the barrier in the recorded lock-step run's setting ...", flush=True)
            data = spec_data(12, 4, 32, 0, f"{tmp}/recorded", recorded["latency"] | {"seed": 0}, 0, True, engine="local")
            runs["recorded setting: lockstep barrier"] = run_way(data, cores)
    stats = {way: summary(r) for way, r in runs.items() if way != "calibration"}
    ratios: dict[str, dict] = {}
    for rho in rhos:
        lock, k0, kk = (stats.get(f"rho={rho:g} {w}") for w in ("lockstep", "k=0", f"k={args.k} actors"))
        target = k0["final_accuracy"]
        ratios[f"{rho:g}"] = {
            "k0_vs_lockstep_episodes_per_s": ratio(k0["episodes_per_s"], lock["episodes_per_s"]),
            "kk_vs_k0_episodes_per_s": ratio(kk["episodes_per_s"], k0["episodes_per_s"]),
            "kk_time_to_k0_final_accuracy": time_ratio(runs[f"rho={rho:g} k={args.k} actors"], runs[f"rho={rho:g} k=0"], target),
            "k0_time_to_k0_final_accuracy_vs_lockstep": time_ratio(runs[f"rho={rho:g} k=0"], runs[f"rho={rho:g} lockstep"], target),
            "target_accuracy": target}
    if args.check_recorded:
        old = recorded["stats"]["lockstep"]["episodes_per_s"]
        ratios["recorded"] = {"barrier_vs_recorded_lockstep_episodes_per_s": ratio(stats["recorded setting: lockstep barrier"]["episodes_per_s"], old),
                              "recorded_episodes_per_s": old}
    plot = {"x": "seconds of training (evaluations left out)", "y": "greedy held-out accuracy",
            "series": {way: [[t, p["accuracy"]] for p, t in zip(r["curve"], train_times(r["curve"]))]
                       for way, r in runs.items() if way.startswith("rho=1 ")}}
    engine = next((s["engine"] for s in stats.values() if s["engine"]), None) or "the default engine"
    from opentinker.backend.device import cpu_auto_choice, cpu_bf16_unit

    result = {"command": " ".join(["python", "bench/async_rl.py", *sys.argv[1:]]), "plot": plot, "turn_s": turn_s, "sigma": SIGMA,
              "machine": f"{platform.machine()}, {cores} CPU cores ({cpu_bf16_unit() or 'no bfloat16 unit'}), torch {torch.__version__}, "
                         f"trainer {str(cpu_auto_choice()[0]).removeprefix('torch.')}", "engine": engine,
              "stats": stats, "ratios": ratios, "runs": runs}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    Path(args.out + ".md").write_text("\n".join(report(result, args)) + "\n")
    print("\n".join(report(result, args)))


def report(result: dict, args) -> list[str]:
    fmt = lambda x: "not reached" if x is None else f"{x:.2f}x"  # noqa: E731 - None: a way never reached the accuracy
    md = [f"# Streaming rollouts and bounded staleness, in rho ({result['machine']})", "",
          f"examples/math_tool_grpo.yaml ({args.model}, LoRA r16, 8 x 4 episodes of up to 4 turns), {args.steps} steps, "
          f"greedy held-out accuracy on {args.eval_n} problems every {args.every} steps; {result['engine']}. A turn waits "
          f"**{result['turn_s']:.2f} s** for its reply here (calibrated, no latency); the calculator's latency is lognormal, "
          f"sigma {result['sigma']:g}, mean rho x that. Each way in a process of its own, one run.", "",
          "| rho | way | episodes/s | train s | first step s | final accuracy | lag mean / max | engine requests s | trainer busy s "
          "| trainer waiting s | tools s (an episode) | slowest group s | evaluation s |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for way, st in result["stats"].items():
        rho, _, name = way.partition(" ")
        t = st["time"]
        md.append(f"| {rho.removeprefix('rho=')} | {name} | {st['episodes_per_s']:.3f} | {st['train_s']:.0f} | {st['first_step_s']:.0f} | "
                  f"{st['final_accuracy']:.1%} | {st['lag_mean']:.2f} / {st['lag_max']:.0f} | {t['engine requests']:.0f} | {t['trainer busy']:.0f} | "
                  f"{t['trainer waiting for rollouts']:.0f} | {t['an episode on its tools']:.0f} | {t['slowest group after the median']:.0f} | "
                  f"{t['evaluation']:.0f} |")
    md.append("")
    for rho, r in result["ratios"].items():
        if rho == "recorded":
            md.append(f"- the barrier in the recorded lock-step run's setting (HF engine, 0.5 s) against that run "
                      f"({r['recorded_episodes_per_s']:.3f} episodes/s): **{fmt(r['barrier_vs_recorded_lockstep_episodes_per_s'])}**")
            continue
        goals = rho == "1"
        md.append(f"- rho {rho}: streaming k=0 against lockstep, episodes/s **{fmt(r['k0_vs_lockstep_episodes_per_s'])}**"
                  + (" (goal >= 2)" if goals else "") + f"; k={args.k} on actors against k=0 **{fmt(r['kk_vs_k0_episodes_per_s'])}**"
                  + (" (goal >= 1.3)" if goals else "") + f"; its time to k=0's final accuracy ({r['target_accuracy']:.1%}) "
                  f"**{fmt(r['kk_time_to_k0_final_accuracy'])}**" + (" (goal <= 0.75)" if goals else "")
                  + f"; k=0's against lockstep's **{fmt(r['k0_time_to_k0_final_accuracy_vs_lockstep'])}**")
    stalls = sum(st["barrier_stalls"] for st in result["stats"].values())
    md += ["", "Engine requests: the engine's own seconds for the HF engine; through a vLLM server, the sum of its requests' times, "
           "which overlap (the server's busy time is its own process's). Tools: an episode's wait on its tools, averaged over "
           "episodes and summed over steps. Slowest group: the step's last group after its median one, summed over steps.", "",
           f"Barrier stalls (an episode the barrier waited {BARRIER_TIMEOUT_S:.0f} s for in vain): {stalls}.", "", f"Made with `{result['command']}`"]
    return md


if __name__ == "__main__":
    main()
