"""The demo's learning through vLLM, sampling (and training) in float32 and in bfloat16, against the HF engine.

Each way runs bench/learning_math.py (examples/math_grpo.yaml: SmolLM2-135M-Instruct, LoRA r16,
GRPO, 25 steps, greedy held-out accuracy on 64 problems every 5) in a process of its own, one after
the other on this machine, for each seed:

- `hf`: rollout.engine local (the HF engine) under the float32 trainer: the demo as it was before vLLM;
- `vllm`: rollout.engine vllm, float32 sampling, float32 trainer;
- `vllm-bf16`: rollout.engine vllm, rollout.sampler_dtype bfloat16 under the float32 trainer (the
  loss weighs each token by decoupled PPO's capped pi_trainer / pi_sampler);
- `bf16`: vLLM sampling in bfloat16 and the trainer too (model.dtype bfloat16: its passes under
  bfloat16 autocast, the adapter and optimizer in float32, the same capped weight): the demo now;
- `bf16-gae`: the same with `algorithm.advantage: gae` (a critic beside the policy, opentinker/backend/critic.py)
  instead of GRPO's group baseline.

Reports per way: each seed's step-0 and final held-out accuracy and the job's wall time from its
start (the policy's load and, for vLLM, its server's start included: the part a user waits for
that the HF engine does not have), and the ways' wall times against `hf` in this same run. "Within noise": the final accuracies' spread across seeds of
one way against the difference between ways' means.

    python bench/vllm_learning.py [--seeds 0,1,2] [--ways hf,vllm,vllm-bf16,bf16] [--hf-seeds 0]
writes bench/results/vllm_learning.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"hf": ["--engine", "local", "--model-dtype", "float32"],
        "vllm": ["--engine", "vllm", "--sampler-dtype", "float32", "--model-dtype", "float32"],
        "vllm-bf16": ["--engine", "vllm", "--sampler-dtype", "bfloat16", "--model-dtype", "float32"],
        "bf16": ["--engine", "vllm", "--sampler-dtype", "bfloat16", "--model-dtype", "bfloat16"],
        "bf16-gae": ["--engine", "vllm", "--sampler-dtype", "bfloat16", "--model-dtype", "bfloat16", "--advantage", "gae"]}


def run(way: str, seed: int, tmp: str) -> dict:
    out = f"{tmp}/{way}-{seed}"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "learning_math.py"), "--seed", str(seed), "--out", out, *WAYS[way]],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if not Path(out + ".json").exists():  # recorded, and the other runs go on
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [f"exit {done.returncode}"]
        return {"seed": seed, "failed": last[0][:300]}
    result = json.loads(Path(out + ".json").read_text())
    curve = result["curve"]
    return {"seed": seed, "step0": curve[0]["greedy_accuracy"], "final": curve[-1]["greedy_accuracy"],
            "best": max(c["greedy_accuracy"] for c in curve), "wall_s": result["model_load_seconds"] + result["wall_seconds"],
            "start_s": result["model_load_seconds"],
            "curve": [(c["step"], c["greedy_accuracy"]) for c in curve]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--ways", default="hf,vllm,vllm-bf16,bf16")
    parser.add_argument("--hf-seeds", default="0", help="seeds the HF engine runs (its wall time is the baseline; its curves "
                                                        "for other seeds are bench/results/learning_math_seed*.json)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_learning"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in args.ways.split(","):
            for seed in ([int(s) for s in args.hf_seeds.split(",")] if way == "hf" else seeds):
                r = run(way, seed, tmp)
                results.setdefault(way, []).append(r)
                print(f"{way} seed {seed}: " + (f"FAILED: {r['failed']}" if "failed" in r else
                      f"{r['step0']:.1%} -> {r['final']:.1%} (best {r['best']:.1%}) in {r['wall_s']:.0f} s"), flush=True)
                write(Path(args.out), seeds, results)  # after every run: a partial run still says what it measured
    print(Path(args.out).with_suffix(".md").read_text())
    return 0


def write(out: Path, seeds: list[int], results: dict[str, list[dict]]) -> None:
    summary = {}
    for way, runs in results.items():
        finals = [r["final"] for r in runs if "failed" not in r]
        if finals:
            summary[way] = {"final_mean": statistics.fmean(finals), "final_spread": max(finals) - min(finals),
                            "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs if "failed" not in r)}
    if "hf" in summary:  # wall time against the HF engine's, on the seeds both ran
        for way, runs in results.items():
            both = [(r["wall_s"], h["wall_s"]) for r in runs for h in results["hf"] if r["seed"] == h["seed"] and "failed" not in r and "failed" not in h]
            if way in summary:
                summary[way]["wall_vs_hf"] = statistics.fmean(a / b for a, b in both) if both else None
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    command = shlex.join(["python", "bench/vllm_learning.py", *sys.argv[1:]])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": machine, "seeds": seeds, "runs": results,
                                                    "summary": summary}, indent=1))
    rows = "\n".join(f"| {way} | {r['seed']} | failed: {r['failed']} | | | | |" if "failed" in r else
                     f"| {way} | {r['seed']} | {r['step0']:.1%} | {r['final']:.1%} | {r['best']:.1%} | {r['wall_s']:.0f} | {r['start_s']:.0f} |"
                     for way, runs in results.items() for r in runs)
    sums = "\n".join(f"| {way} | {s['final_mean']:.1%} | {s['final_spread'] * 100:.1f} points | {s['wall_s_mean']:.0f} | "
                     f"{'-' if s.get('wall_vs_hf') is None else format(s['wall_vs_hf'], '.2f') + 'x'} |" for way, s in summary.items())
    out.with_suffix(".md").write_text(
        f"# The demo's learning, way against way: {', '.join(results)} ({machine}, one run)\n\n"
        f"bench/learning_math.py per way and seed (25 steps, greedy held-out accuracy on 64 problems every 5), one after the other. "
        f"Wall time: the job's, from its start (the policy's load and the vLLM server's start, which overlap, included) to its last evaluation.\n\n"
        f"| way | seed | step 0 | final | best | wall (s) | of which the start (s) |\n|---|---:|---:|---:|---:|---:|---:|\n{rows}\n\n"
        f"| way | final accuracy, mean | spread across seeds | wall (s), mean | wall against hf (same seeds) |\n"
        f"|---|---:|---:|---:|---:|\n{sums}\n")


if __name__ == "__main__":
    sys.exit(main())
