"""The stream engine's two ways of holding the running rows' key/values, side by side on the CPU.

- `slots` (a GPU's default for an engine of one policy, opentinker/backend/slots.py, run eagerly
  here): fixed slots a joining row copies its own prefill into and a leaving row frees;
- `growing` (the CPU's default, and what engines of several adapters keep, stream.py `_join` /
  `_retire`): one cache left-padded to the widest row, so every join re-pads and every leave
  re-slices all running rows. (Why the CPU keeps it: memory, see docs/benchmarks.md.)

Task: examples/math_tool_grpo.yaml (SmolLM2-135M-Instruct, LoRA r16, GRPO, 8 prompts x 4 samples,
up to 4 turns) with the calculator's lognormal latency (mean 0.5 s, sigma 1.0, seeded), k = 0,
`--steps` steps each way, evaluations left out; each way in a process of its own, the same seed, so
both draw the same episodes (the sampled rewards are printed to show it). Per way: the rollout
seconds of each step (the trainer's wait for the step's groups) and the step seconds. Ratio:
slots / growing, mean rollout seconds.

    python bench/stream_slots.py [--steps 3]
writes bench/results/stream_slots.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One way, in a fresh process: the engine built with slots on or off (HFRolloutEngine's `slots`).
RUN = r"""
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
slots = sys.argv[3] == "slots"
import opentinker.backend.rollout as rollout
built = rollout.HFRolloutEngine.__init__
def init(self, *args, **kwargs):
    built(self, *args, **(kwargs | {"slots": slots}))
rollout.HFRolloutEngine.__init__ = init
from opentinker.cli.common import quiet_libraries
from opentinker.core.spec import parse_spec
from opentinker.rl import RLJob
quiet_libraries()
job = RLJob(parse_spec(json.loads(sys.argv[2])), job_id="bench")
steps = []
def on_step(report):
    m = report.metrics
    steps.append({"step": report.step, "rollout_s": m["rollout/seconds"], "step_s": m["step/seconds"] - m.get("eval/seconds", 0.0),
                  "reward": m["rollout/reward_mean"]})
job.run(on_step=on_step)
job.close()
print("RESULT " + json.dumps(steps), flush=True)
"""


def spec_data(steps: int, tmp: str) -> dict:
    from opentinker.core.spec import load_spec

    base = load_spec(str(ROOT / "examples" / "math_tool_grpo.yaml")).model_dump(mode="json")
    env = base["env"]
    latency = {"distribution": "lognormal", "mean_s": 0.5, "sigma": 1.0}
    env = env | {"config": env["config"] | {"game_kwargs": env["config"].get("game_kwargs", {}) | {"tool_latency": latency}}}
    return base | {"optimization": base["optimization"] | {"steps": steps}, "env": env,
                   "evaluation": base["evaluation"] | {"every": 0, "n_samples": 8},
                   "checkpoint": base["checkpoint"] | {"every": 0, "base_url": f"file://{tmp}"}}


def run_way(way: str, data: dict) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", RUN, str(ROOT), json.dumps(data), way], capture_output=True, text=True, cwd=str(ROOT),
                         env=os.environ | {"TOKENIZERS_PARALLELISM": "false"})
    line = next((line for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the {way} run failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "stream_slots"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import tempfile

    import torch

    runs = {}
    for way in ("growing", "slots"):
        print(f"{way} ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            runs[way] = run_way(way, spec_data(args.steps, tmp))
    mean = {way: statistics.mean(s["rollout_s"] for s in steps) for way, steps in runs.items()}
    ratio = mean["slots"] / mean["growing"]
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    command = " ".join(["python", "bench/stream_slots.py", *sys.argv[1:]])
    Path(args.out + ".json").write_text(json.dumps({"command": command, "machine": machine, "runs": runs, "mean_rollout_s": mean,
                                                    "ratio_slots_vs_growing": ratio}, indent=2))
    md = [f"# The stream engine's key/values: fixed slots against a growing cache ({machine})", "",
          "examples/math_tool_grpo.yaml with the lognormal tool latency (mean 0.5 s, sigma 1.0), k = 0, each way in a process of its own.",
          "", "| way | rollout s per step | step s per step | sampled reward per step |", "|---|---|---|---|"]
    def column(steps: list[dict], key: str, digits: int) -> str:
        return ", ".join(f"{s[key]:.{digits}f}" for s in steps)

    for way, steps in runs.items():
        md.append(f"| {way} | {column(steps, 'rollout_s', 1)} | {column(steps, 'step_s', 1)} | {column(steps, 'reward', 3)} |")
    md += ["", f"- slots against growing, mean rollout seconds: **{ratio:.2f}x** ({mean['slots']:.1f} s vs {mean['growing']:.1f} s)",
           "", f"Made with `{command}`"]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
