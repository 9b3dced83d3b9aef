"""What the Prefect + Ray orchestration costs: the same job run (a) by the step loop calling the job
directly in one process and (b) as the `rl-train` Prefect flow on Ray against a real local stack,
in the same run.

Both do the same steps (rollout, update, evaluate every k, checkpoint every k); (b) adds Prefect
task runs dispatched through RayTaskRunner, actor calls and MLflow logging. Printed: the step-loop
wall-time ratio b/a and the overhead per step in ms, plus the one-off start-up costs (Ray start,
actors, MLflow run) reported separately.

    python bench/overhead.py --model tiny-random --steps 20
    python bench/overhead.py --model smollm2-135m-instruct --steps 10
writes bench/results/overhead_<model>.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_spec(model: str, steps: int, base_url: str):
    from opentinker.core.spec import load_spec

    if model == "tiny-random":
        spec = load_spec(ROOT / "examples" / "toy_smoke.yaml")
    else:
        spec = load_spec(ROOT / "examples" / "math_grpo.yaml")
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"name": model})})
    return spec.model_copy(update={
        "optimization": spec.optimization.model_copy(update={"steps": steps}),
        "evaluation": spec.evaluation.model_copy(update={"every": 5}),
        "checkpoint": spec.checkpoint.model_copy(update={"every": 1, "base_url": base_url}),
    })


def _medians(history: list[dict[str, float]]) -> dict[str, float]:
    keys = ("rollout/seconds", "update/seconds", "eval/seconds")
    return {k: statistics.median(h[k] for h in history if k in h) for k in keys if any(k in h for h in history)}


def run_direct(spec) -> tuple[float, float, dict[str, float]]:
    """(total seconds, step-loop seconds, median phase seconds): the same step loop, called here."""
    from opentinker.rl import RLJob

    t0 = time.perf_counter()
    result = RLJob(spec, job_id="direct").run()
    return time.perf_counter() - t0, result.loop_seconds, _medians(result.history)


def run_flow(spec, settings) -> tuple[float, float, dict[str, float]]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.rl_train import rl_train

    with temporary_settings({PREFECT_API_URL: settings.prefect_api_url}):
        t0 = time.perf_counter()
        result = rl_train(spec, job_id="flow")
        return time.perf_counter() - t0, result["loop_seconds"], _medians(result["history"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    from opentinker.cli.common import quiet_libraries
    from opentinker.core.settings import Settings
    from opentinker.control.stack import Stack
    from opentinker.core.settings import mlflow_env, prefect_env, settings_env
    from tests.stack_fixtures import free_ports

    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        prefect_port, mlflow_port, gateway_port = free_ports(3)
        settings = Settings(state_dir=Path(tmp) / "state", prefect_port=prefect_port, mlflow_port=mlflow_port,
                            gateway_port=gateway_port)
        os.environ.update(settings_env(settings) | prefect_env(settings) | mlflow_env(settings))
        stack = Stack(settings)
        print("starting a local stack for the flow side ...", flush=True)
        stack.up(timeout=240)
        try:
            import torch

            torch.set_num_threads(os.cpu_count() or 1)
            spec = make_spec(args.model, args.steps, f"file://{tmp}/runs")
            direct_total, direct_loop, direct_phases = run_direct(spec)
            print(f"direct: loop {direct_loop:.1f}s, total {direct_total:.1f}s, median phases {direct_phases}", flush=True)
            flow_total, flow_loop, flow_phases = run_flow(spec, settings)
            print(f"flow:   loop {flow_loop:.1f}s, total {flow_total:.1f}s, median phases {flow_phases}", flush=True)
        finally:
            stack.down()

    ratio = flow_loop / direct_loop
    per_step_ms = (flow_loop - direct_loop) / args.steps * 1000
    startup = (flow_total - flow_loop) - (direct_total - direct_loop)
    result = {
        "model": args.model, "steps": args.steps, "cpus": os.cpu_count(),
        "direct_loop_s": direct_loop, "flow_loop_s": flow_loop, "ratio_flow_over_direct": ratio,
        "overhead_per_step_ms": per_step_ms, "direct_total_s": direct_total, "flow_total_s": flow_total,
        "extra_startup_s": startup, "direct_median_phase_s": direct_phases, "flow_median_phase_s": flow_phases,
    }
    out = ROOT / "bench" / "results" / f"overhead_{args.model}"
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    md = (
        f"# Orchestration overhead: {args.model}, {args.steps} steps (checkpoint every step, evaluation every 5)\n\n"
        "| | step loop (s) | total incl. start-up (s) |\n|---|---:|---:|\n"
        f"| direct step functions | {direct_loop:.1f} | {direct_total:.1f} |\n"
        f"| Prefect flow + RayTaskRunner + actors + MLflow | {flow_loop:.1f} | {flow_total:.1f} |\n\n"
        f"**Ratio flow / direct (step loop): {ratio:.3f}**, overhead {per_step_ms:.0f} ms per step; "
        f"one-off extra start-up {startup:.1f} s (Ray start, actor creation, MLflow run).\n\n"
        "Median seconds per phase, measured inside the step functions (direct) and inside the actor (flow): "
        + ", ".join(f"{k} {direct_phases[k]:.2f} vs {flow_phases.get(k, float('nan')):.2f}" for k in direct_phases) + "\n"
    )
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
