"""The demo's rollouts and evaluations through vLLM against the HF engine, side by side on this machine.

Task: examples/math_grpo.yaml (SmolLM2-135M-Instruct, LoRA r16, GRPO, 8 prompts x 4 samples, 24 new
tokens at temperature 0.7; 64 greedy held-out problems), `--steps` steps a way with an evaluation
before the first and after the last. Each way in a process of its own, the same seed:

- `hf`: rollout.engine local, the HF engine in the job's process (today's default);
- `vllm`: rollout.engine vllm, the job's own vLLM server (float32, eager), the policy's LoRA factors
  merged into its weights in place after every update (rollout.weight_sync merged, the CPU's default);
- `vllm-bf16`: the same, the server sampling in bfloat16 (the trainer in float32, the loss weighing
  each token by decoupled PPO's capped pi_trainer / pi_sampler);
- `vllm-bf16-trainer`: the same with the trainer in bfloat16 too (`model.dtype: auto` on a CPU with
  Intel AMX, where the demo runs so; the trainer's frozen base bfloat16, its adapter float32);
- `vllm-lora` (with `--ways`): the server taking the adapter by name.

`--adapter full` runs the same ways as a full fine-tune (lr 1e-5): its weights, all 540 MB of them,
reach the vLLM server in place of the LoRA's factors.

Per way: the job's start (model, and the server's start-up), per step the rollout's wait, its
generated tokens, the weight sync and the update, the evaluations' seconds, and the peak memory of
the job's process and of its server's processes. Ratios against `hf`: rollout tokens per second (the
step's generated tokens over the trainer's wait for them), evaluation seconds, step seconds.

    python bench/vllm_engine.py [--steps 3] [--ways hf,vllm,vllm-bf16,vllm-bf16-trainer] [--adapter lora|full]
writes bench/results/vllm_engine.{json,md} (vllm_engine_full.{json,md} for a full fine-tune)
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One way, in a fresh process; prints RESULT {json}.
RUN = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[1])
import psutil
from opentinker.cli.common import quiet_libraries
from opentinker.core.spec import parse_spec
from opentinker.inference.launch import rollout_server
from opentinker.rl import RLJob
quiet_libraries()
me = psutil.Process()
peak = {"job": 0, "server": 0}
def watch():
    while True:
        servers = [p for p in me.children(recursive=True) if "vllm" in " ".join(p.cmdline())]
        peak["job"] = max(peak["job"], me.memory_info().rss)
        peak["server"] = max(peak["server"], sum(p.memory_info().rss for p in servers if p.is_running()))
        time.sleep(0.5)
threading.Thread(target=watch, daemon=True).start()
started = {}
def timed_server(*args):
    t0 = time.perf_counter()
    handle = rollout_server(*args)
    started["server_s"] = time.perf_counter() - t0
    return handle
t0 = time.perf_counter()
job = RLJob(parse_spec(json.loads(sys.argv[2])), job_id="bench", start_server=timed_server)
built = time.perf_counter() - t0
steps, evals = [], []
def on_step(report):
    m = report.metrics
    steps.append({"step": report.step, "rollout_s": m["rollout/seconds"], "tokens": m["rollout/generated_tokens"],
                  "sync_s": m.get("rollout/sync_seconds", 0.0), "update_s": m.get("update/seconds", 0.0),
                  "step_s": m["step/seconds"] - m.get("eval/seconds", 0.0), "reward": m["rollout/reward_mean"],
                  "sampler_gap": m.get("update/sampler_logprob_gap"), "behaviour_weight": m.get("update/behaviour_weight_mean")})
def on_eval(ev):
    evals.append({"step": ev.step, "seconds": ev.metrics["eval/seconds"], "accuracy": ev.metrics.get("eval/accuracy")})
job.run(on_step=on_step, on_eval=on_eval)
job.close()
print("RESULT " + json.dumps({"start_s": built, **started, "steps": steps, "evals": evals,
                              "peak_job_gb": peak["job"] / 1e9, "peak_server_gb": peak["server"] / 1e9}), flush=True)
"""

WAYS = {"hf": {"engine": "local", "sampler_dtype": "auto"}, "vllm": {"engine": "vllm", "weight_sync": "merged", "sampler_dtype": "float32"},
        "vllm-bf16": {"engine": "vllm", "weight_sync": "merged", "sampler_dtype": "bfloat16"},
        "vllm-bf16-trainer": {"engine": "vllm", "weight_sync": "merged", "sampler_dtype": "bfloat16"},
        "vllm-lora": {"engine": "vllm", "weight_sync": "lora", "sampler_dtype": "float32"}}
TRAINER_DTYPE = {"vllm-bf16-trainer": "bfloat16"}  # the others' trainer: float32 on every CPU (the baseline's)


def spec_data(way: str, steps: int, tmp: str, adapter: str) -> dict:
    from opentinker.core.spec import load_spec

    data = load_spec(ROOT / "examples" / "math_grpo.yaml").model_dump(mode="json")
    data["rollout"] |= WAYS[way]
    data["model"]["dtype"] = TRAINER_DTYPE.get(way, "float32")
    if adapter == "full":
        data["adapter"] = {"kind": "full"}
        data["optimization"]["lr"] = 1e-5
    data["optimization"]["steps"] = steps
    data["evaluation"]["every"] = steps  # before the first step and after the last
    data["checkpoint"] |= {"every": 0, "base_url": f"file://{tmp}/{way}"}
    return data


def run_way(way: str, steps: int, tmp: str, adapter: str) -> dict:
    out = subprocess.run([sys.executable, "-c", RUN, str(ROOT), json.dumps(spec_data(way, steps, tmp, adapter))], capture_output=True,
                         text=True, cwd=ROOT, timeout=7200)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{way}: exit {out.returncode}: {out.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    rollout_s = sum(s["rollout_s"] for s in result["steps"])
    result |= {"way": way, "rollout_tokens_per_s": sum(s["tokens"] for s in result["steps"]) / rollout_s,
               "eval_s": statistics.fmean(e["seconds"] for e in result["evals"]),
               "step_s": statistics.fmean(s["step_s"] for s in result["steps"])}
    return result


def _gap(result: dict) -> str:
    """Mean |log pi_trainer - log pi_sampler| over the trained tokens (a float32 pair: none, the same numbers)."""
    gaps = [s["sampler_gap"] for s in result["steps"] if s.get("sampler_gap") is not None]
    return f"{statistics.fmean(gaps):.4f}" if gaps else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ways", default="hf,vllm,vllm-bf16,vllm-bf16-trainer")
    parser.add_argument("--adapter", choices=("lora", "full"), default="lora")
    parser.add_argument("--out", default=None, help="default: bench/results/vllm_engine (vllm_engine_full for --adapter full)")
    args = parser.parse_args()
    args.out = args.out or str(ROOT / "bench" / "results" / ("vllm_engine" if args.adapter == "lora" else "vllm_engine_full"))
    import tempfile

    ways = args.ways.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ways:
            t0 = time.perf_counter()
            results[way] = run_way(way, args.steps, tmp, args.adapter)
            r = results[way]
            print(f"{way}: {r['rollout_tokens_per_s']:.0f} rollout tok/s, eval {r['eval_s']:.1f} s, step {r['step_s']:.1f} s, "
                  f"start {r['start_s']:.0f} s ({time.perf_counter() - t0:.0f} s in all)", flush=True)
    base = results["hf"]
    ratios = {way: {"rollout_tokens_per_s": r["rollout_tokens_per_s"] / base["rollout_tokens_per_s"],
                    "eval_seconds": r["eval_s"] / base["eval_s"], "step_seconds": r["step_s"] / base["step_s"]}
              for way, r in results.items() if way != "hf"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from opentinker.backend.device import cpu_bf16_unit

    machine = f"{platform.machine()}, {os.cpu_count()} cores, {cpu_bf16_unit() or 'no bfloat16 unit'}"
    command = " ".join(["python", "bench/vllm_engine.py", *sys.argv[1:]])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": machine, "steps": args.steps, "adapter": args.adapter,
                                                   "ways": results, "ratios": ratios}, indent=1))
    trained = "LoRA r16" if args.adapter == "lora" else "full fine-tune at lr 1e-5"
    what = "" if args.adapter == "lora" else ", a full fine-tune"
    rows = "\n".join(
        f"| {way} | {r['start_s']:.0f} | {r.get('server_s', 0):.0f} | {r['rollout_tokens_per_s']:.0f} | "
        f"{statistics.fmean(s['rollout_s'] for s in r['steps']):.1f} | {statistics.fmean(s['sync_s'] for s in r['steps']):.2f} | "
        f"{statistics.fmean(s['update_s'] for s in r['steps']):.1f} | {r['step_s']:.1f} | {r['eval_s']:.1f} | "
        f"{r['peak_job_gb']:.2f} | {r['peak_server_gb']:.2f} | {_gap(r)} |" for way, r in results.items())
    lines = "; ".join(f"{way}/hf: rollout tokens/s **{q['rollout_tokens_per_s']:.2f}x**, evaluation time **{q['eval_seconds']:.2f}x**, "
                      f"step time {q['step_seconds']:.2f}x" for way, q in ratios.items())
    out.with_suffix(".md").write_text(
        f"# The demo's rollouts and evaluations{what}: vLLM against the HF engine (same run, {machine})\n\n"
        f"examples/math_grpo.yaml (SmolLM2-135M-Instruct, {trained}, GRPO, 8 x 4 episodes of up to 24 tokens a step, 64 greedy "
        f"held-out problems), {args.steps} steps a way, each in a process of its own, the trainer in float32 (vllm-bf16: its server samples in bfloat16; vllm-bf16-trainer: the trainer in bfloat16 as well). Start: the job's start, the server's "
        f"start-up included (vLLM eager on the CPU); rollout: the trainer's wait for a step's episodes; sync: the update's weights "
        f"reaching the engine; memory: peak RSS of the job's process and of its server's processes; trainer-sampler gap: mean "
        f"|log pi_trainer - log pi_sampler| over the trained tokens (`update/sampler_logprob_gap`, where the update corrects for it).\n\n"
        f"| way | start (s) | server start-up (s) | rollout tokens/s | rollout (s) | sync (s) | update (s) | step (s) | evaluation (s) | "
        f"job peak (GB) | server peak (GB) | trainer-sampler gap |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n{rows}\n\n{lines}.\n")
    print(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
