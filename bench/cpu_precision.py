"""The demo's update in float32 and in bfloat16 on this CPU, side by side in one process.

Why: the update is most of a CPU demo step, and a CPU with AMX or AVX-512 BF16 multiplies bfloat16
matrices several times faster than float32 ones; this says how much of that reaches the update.

Task: examples/math_grpo.yaml (SmolLM2-135M-Instruct, LoRA r16 on every projection, GRPO, 8 prompts
x 4 samples, micro-batches of 16, decoupled PPO as under a bfloat16 vLLM sampler). Two batches are
rolled out once (the HF engine, float32); then one trainer per precision, from the same weights and
the same LoRA initialisation, updates on them in turn, `--repeats` times each after a warm-up.
Reported: the CPU's flags and the matmul rate of each precision at the model's shapes, the median
update seconds and their ratio, the update's matmul FLOPs (torch's FLOP counter) and the rate they
were done at, and where each update's time goes (torch.profiler, grouped: matmuls, attention,
casts, element-wise, the rest).

    python bench/cpu_precision.py [--repeats 4] [--threads N] [--save-as cpu_precision_epyc]
writes bench/results/cpu_precision.{json,md} (or the --save-as name: one file per kind of CPU)
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRECISIONS = ("float32", "bfloat16")
SHAPES = [(768, 576, 1536), (768, 1536, 576), (768, 576, 576), (256, 576, 49152)]  # rows x in -> out, SmolLM2's
FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
GROUPS = {  # profiler op name -> what it is
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention"),
    "casts": ("aten::copy_", "aten::_to_copy"),
    "log-softmax": ("aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::exp"),
}


def cpu_flags() -> dict:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), platform.processor())
    return {"model": model, **{f: f in flags for f in FLAGS}}


def matmul_rate(dtype, rows: int, inner: int, out: int, seconds: float = 1.0) -> float:
    """GFLOP/s of `x @ W.T` at one shape, the best of a second's repeats."""
    import torch

    x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(out, inner, dtype=dtype)
    for _ in range(3):
        x @ w.T
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        x @ w.T
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * inner * out / best / 1e9


def rollouts(spec, batches: int) -> list:
    """`batches` steps' trajectories of the demo, sampled once (the HF engine, float32)."""
    from opentinker.rl import RLJob

    job = RLJob(spec, job_id="bench-precision")
    out = []
    for step in range(batches):
        job.rollout(step)
        out.append(job.sampler.batch(step).trajectories)
        job.policy.trainer.version += 1  # the next batch may start: no update runs on this job
        job._sync()
    job.close()  # its producer would go on sampling the next steps' groups beside the updates timed below
    return out


def trainer(spec, model, tokenizer, dtype: str):
    import torch

    from opentinker.backend.device import placement
    from opentinker.backend.trainer import PolicyTrainer

    torch.manual_seed(0)  # the same LoRA initialisation for both
    return PolicyTrainer(copy.deepcopy(model), tokenizer, spec.adapter, spec.algorithm, spec.optimization, spec.rollout.temperature,
                         placement(0, dtype), sampled_apart=True)


def update(t, batch) -> float:
    t.version = batch[0].policy_version  # the same batches again and again: each fresh to the trainer
    t0 = time.perf_counter()
    t.update(batch)
    return time.perf_counter() - t0


def matmul_flops(t, batch) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        update(t, batch)
    return float(counter.get_total_flops())


def profile(t, batch) -> dict:
    """Seconds of one update by group of operators (self time; the rest is everything else)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        update(t, batch)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    groups = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / 1e6 for name, prefixes in GROUPS.items()}
    casts = [e for e in events if e.key == "aten::_to_copy"]
    return {**groups, "element-wise and the rest": total - sum(groups.values()), "total": total,
            "cast calls": sum(e.count for e in casts)}


def main() -> None:
    import torch

    from opentinker.core.spec import load_spec
    from opentinker.model.policy import load_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--save-as", default="cpu_precision", help="the results' name in bench/results (one per kind of CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = cpu_flags()
    print(f"CPU {flags['model']}: " + ", ".join(f for f in FLAGS if flags[f]) + f"; {torch.get_num_threads()} threads", flush=True)
    rates = {dt: [round(matmul_rate(getattr(torch, dt), *shape), 1) for shape in SHAPES] for dt in PRECISIONS}
    for dt in PRECISIONS:
        print(f"matmul GFLOP/s {dt}: " + ", ".join(f"{r}x{i}->{o} {g:.0f}" for (r, i, o), g in zip(SHAPES, rates[dt])), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        spec = load_spec(ROOT / "examples" / "math_grpo.yaml")
        spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"engine": "hf"}),
                                       "checkpoint": spec.checkpoint.model_copy(update={"base_url": f"file://{tmp}"})})
        batches = rollouts(spec, 2)
    model, tokenizer = load_model(spec.model.name, "float32")
    trainers = {dt: trainer(spec, model, tokenizer, dt) for dt in PRECISIONS}
    for t in trainers.values():  # warm-up
        update(t, batches[0])
    seconds = {dt: [] for dt in PRECISIONS}
    for rep in range(args.repeats):  # interleaved, so that a busy moment of the machine costs both
        for dt, t in trainers.items():
            seconds[dt].append(update(t, batches[rep % 2]))
            print(f"{dt} update {rep}: {seconds[dt][-1]:.2f} s", flush=True)
    flops = matmul_flops(trainers["float32"], batches[0])
    results = {"cpu": flags, "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats,
               "matmul_shapes": SHAPES, "matmul_gflops": rates, "update_matmul_gflop": flops / 1e9, "ways": {}}
    for dt, t in trainers.items():
        median = statistics.median(seconds[dt])
        results["ways"][dt] = {"update_s": seconds[dt], "median_s": median, "achieved_gflops": flops / median / 1e9,
                               "profile_s": profile(t, batches[0])}
    ratio = results["ways"]["bfloat16"]["median_s"] / results["ways"]["float32"]["median_s"]
    results["bf16_over_fp32"] = ratio
    lines = ["# The demo's update: bfloat16 against float32 on this CPU\n",
             (f"CPU: {flags['model']} ({', '.join(f for f in FLAGS if flags[f]) or 'none of ' + ', '.join(FLAGS)}), "
             f"{results['threads']} threads, torch {torch.__version__}; {args.repeats} updates each after a warm-up, interleaved.\n"),
             "| | float32 | bfloat16 |", "|---|---|---|",
             (f"| update, median s | {results['ways']['float32']['median_s']:.2f} | {results['ways']['bfloat16']['median_s']:.2f} "
             f"(**{ratio:.2f}×**) |"),
             (f"| update's matmuls: {flops / 1e9:.0f} GFLOP, achieved GFLOP/s | {results['ways']['float32']['achieved_gflops']:.0f} | "
             f"{results['ways']['bfloat16']['achieved_gflops']:.0f} |"),
             (f"| matmul GFLOP/s at the model's shapes ({', '.join(f'{r}x{i}->{o}' for r, i, o in SHAPES)}) | "
             f"{' / '.join(f'{g:.0f}' for g in rates['float32'])} | {' / '.join(f'{g:.0f}' for g in rates['bfloat16'])} |")]
    for key in [*GROUPS, "element-wise and the rest", "total", "cast calls"]:
        values = [results["ways"][dt]["profile_s"][key] for dt in PRECISIONS]
        shown = [f"{v:.0f}" if key == "cast calls" else f"{v:.2f} s" for v in values]
        lines.append(f"| profiled: {key} | {shown[0]} | {shown[1]} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results"
    results["command"] = "python bench/cpu_precision.py" + (f" --save-as {args.save_as}" if args.save_as != "cpu_precision" else "")
    (out / f"{args.save_as}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{args.save_as}.md").write_text(text + f"\nMade with `{results['command']}`\n")


if __name__ == "__main__":
    main()
