"""What lifts an RL step on a GPU: the levers, measured side by side on one model in one run.

`bench/gpu_step.py` measures the job's step as it is; this runs the same step's two halves in
several ways on the same random-weight model (the Qwen2.5-1.5B shape by default), so that each
lever's gain is a ratio against the baseline measured minutes before on the same device:

rollout (16 prompts x 8 samples, 256 new tokens, transformers decoding in the HF engine):
- `cast per token`: autocast's cast cache off, so every float32 weight is cast to bf16 at every
  token (what the decode loop did before it became one autocast region);
- `cast once`: the decode loop as it is;
- `compiled`: as `cast once`, with each decoder layer's MLP and RMS norms compiled by
  `torch.compile` (regional compilation: the attention, which updates the KV cache, stays eager);

update (GRPO, on the trajectories of the last rollout, weights stepped each time):
- `shared prefix, packs of N tokens`: the trainer's default scoring (each group's prompt once)
  with the CPU-sized packs (2048) and larger ones;
- `per sequence, micro-batch M`: every record whole (`optimization.shared_prefix: false`);
- `compiled, per sequence, micro-batch M`: the same with the compiled regions.

Update tokens/s counts every record's tokens (the same work whichever way it is scored); MFU is
bench/gpu_step.py's (model FLOPs of the per-sequence update over the device's dense bf16 peak).
The first call of each variant is a warm-up (for `compiled`, it includes compiling).

    python bench/gpu_variants.py --adapter full [--shape qwen2.5-1.5b] [--out DIR]
    python bench/gpu_variants.py --shape tiny --device cpu --repeats 1      # a smoke run

Writes <out>/gpu_variants_<adapter>.{json,md} after every variant (bench/results on a GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_step  # noqa: E402  (bench/gpu_step.py: the model, FLOP count and device peak)

from opentinker.backend.regional_compile import compile_regions  # noqa: E402


class Run:
    """One shape and adapter: its model, data and the variants measured so far."""

    def __init__(self, args):
        self.args, self.device = args, torch.device(args.device)
        gpu_step.ARGS = gpu_step.parse_args(["--prompts", str(args.prompts), "--group", str(args.group),
                                             "--micro-batch", "16", "--device", args.device])
        self.trainer, self.engine, self.config = gpu_step.build(args.shape, self.device, args.adapter)
        self.rng = random.Random(0)
        self.trajs = None
        self.name, self.peak = gpu_step.peak_flops(self.device)
        self.result = {"command": " ".join(["python", "bench/gpu_variants.py", *sys.argv[1:]]),
                       "setup": {k: getattr(args, k) for k in ("shape", "adapter", "prompts", "group", "prompt_len", "new_tokens", "repeats")}
                       | {"device": self.name, "peak_bf16_flops": self.peak, "torch": torch.__version__,
                          "precision": "bf16 autocast" if self.device.type == "cuda" else "float32",
                          "parameters": sum(p.numel() for p in self.trainer.model.parameters())},
                       "rollout": [], "update": []}

    def _sync(self):
        gpu_step.sync(self.device)

    def _rollout_once(self) -> tuple[float, int]:
        from opentinker.backend import SamplingParams
        from opentinker.core.trajectory import Trajectory

        a = self.args
        prompts = [[self.rng.randrange(1, self.config.vocab_size - 1) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
        expanded = [p for p in prompts for _ in range(a.group)]
        self._sync()
        t0 = time.perf_counter()
        completions = self.engine.generate(expanded, SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0))
        self._sync()
        seconds = time.perf_counter() - t0
        self.trajs = []
        for i, (prompt, c) in enumerate(zip(expanded, completions)):
            traj = Trajectory(prompt_ids=prompt, group_id=i // a.group, policy_version=self.trainer.version)
            traj.append_sampled(c.token_ids, c.logprobs, "")
            traj.turns[-1].reward = float(self.rng.random() < 0.5)
            self.trajs.append(traj)
        return seconds, sum(len(c.token_ids) for c in completions)

    def rollout(self, name: str, cast_cache: bool = True) -> None:
        torch.set_autocast_cache_enabled(cast_cache)
        try:
            runs = [self._rollout_once() for _ in range(1 + self.args.repeats)]
        finally:
            torch.set_autocast_cache_enabled(True)
        rates = [n / s for s, n in runs[1:]]
        self._add("rollout", {"variant": name, "warmup_s": runs[0][0], "seconds": [s for s, _ in runs[1:]],
                              "tokens_per_s": statistics.median(rates)}, "tokens_per_s")

    def update(self, name: str, shared_prefix: bool, micro_batch: int, pack_tokens: int = 2048) -> None:
        t = self.trainer
        t.optim_spec = t.optim_spec.model_copy(update={"shared_prefix": shared_prefix, "micro_batch_size": micro_batch})
        t.pack_tokens = pack_tokens
        lengths = [(len(tr.token_ids), tr.num_sampled) for tr in self.trajs]
        flops = gpu_step.update_flops(self.config, lengths, self.args.adapter)
        tokens = sum(n for n, _ in lengths)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        times, computed = [], 0.0
        try:
            for _ in range(1 + self.args.repeats):
                for tr in self.trajs:
                    tr.policy_version = t.version
                self._sync()
                t0 = time.perf_counter()
                metrics = t.update(self.trajs)
                self._sync()
                times.append(time.perf_counter() - t0)
                computed = metrics["update/positions_computed"]
        except torch.OutOfMemoryError as error:
            t.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            self._add("update", {"variant": name, "error": f"out of memory: {str(error).splitlines()[0]}"}, None)
            return
        seconds = statistics.median(times[1:])
        self._add("update", {"variant": name, "warmup_s": times[0], "seconds": times[1:], "tokens_per_s": tokens / seconds,
                             "mfu": flops / seconds / self.peak if self.peak else None, "positions_computed": computed,
                             "peak_memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None},
                  "tokens_per_s")

    def busy(self, label: str, call) -> None:
        """How much of `call`'s wall time the device is busy: the call timed alone, then again under
        the profiler for its kernels' (and copies') summed device time and their number."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        self._sync()
        t0 = time.perf_counter()
        call()
        self._sync()
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            self._sync()
        device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy_s = sum(e.time_range.elapsed_us() for e in device) / 1e6
        self.result.setdefault("busy", []).append({"call": label, "wall_s": wall, "device_busy_s": busy_s,
                                                   "device_busy_fraction": busy_s / wall, "device_events": len(device)})
        print(f"busy: {self.result['busy'][-1]}", flush=True)
        self.write()

    def _add(self, kind: str, row: dict, key: str | None) -> None:
        rows = self.result[kind]
        base = next((r for r in rows if "error" not in r), None)
        if key and base is not None and key in row:
            row["ratio"] = row[key] / base[key]
        rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "seconds"}
        print(f"{kind}: {shown}", flush=True)
        self.write()

    def write(self) -> None:
        out = Path(self.args.out) if self.args.out else (ROOT / "bench" / "results" if self.device.type == "cuda" else Path(tempfile.mkdtemp()))
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"gpu_variants_{self.args.adapter}"
        stem.with_suffix(".json").write_text(json.dumps(self.result, indent=2))
        stem.with_suffix(".md").write_text(markdown(self.result))


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"# What lifts an RL step on {s['device']}: {s['shape']}, {s['adapter']}", "",
             f"{s['parameters'] / 1e9:.2f} B parameters, random weights, {s['precision']} (float32 trained weights and optimizer); "
             f"{s['prompts']} prompts x {s['group']} samples, {s['prompt_len']} prompt + {s['new_tokens']} new tokens; "
             f"median of {s['repeats']} runs after a warm-up; torch {s['torch']}. Ratios against the first row of each table, "
             "measured in the same run.", "",
             "| rollout | generated tok/s | ratio |", "|---|---:|---:|"]
    lines += [f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {r.get('ratio', 1.0):.2f}x |" for r in result["rollout"]]
    busy = [f"| {b['call']} | {b['wall_s']:.2f} s | {b['device_busy_s']:.2f} s | {b['device_busy_fraction']:.0%} | {b['device_events']:,} |"
            for b in result.get("busy", [])]
    lines += ["", "| update | update tok/s | MFU | ratio | positions computed | peak memory |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["update"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error']} | | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        memory = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {mfu} | {r.get('ratio', 1.0):.2f}x | {r['positions_computed']:,.0f} | {memory} |")
    if busy:
        lines += ["", "| profiled (last variant) | wall | device busy | share | kernels and copies |", "|---|---:|---:|---:|---:|", *busy]
    return "\n".join(lines) + "\n"


def main(args) -> None:
    run = Run(args)
    run.rollout("cast per token", cast_cache=False)
    run.rollout("cast once")
    run.update("shared prefix, packs of 2048 tokens", True, 32, 2048)
    for pack in args.packs:
        run.update(f"shared prefix, packs of {pack} tokens", True, 32, pack)
    for mb in args.micro_batches:
        run.update(f"per sequence, micro-batch {mb}", False, mb)
    if args.compile:
        t0 = time.perf_counter()
        n = compile_regions(run.trainer.model)
        print(f"compiled {n} modules (lazily, at their first call) in {time.perf_counter() - t0:.1f}s", flush=True)
        run.rollout("compiled MLP and norms")
        run.update(f"compiled, per sequence, micro-batch {args.micro_batches[-1]}", False, args.micro_batches[-1])
    if args.profile:
        short = argparse.Namespace(**vars(args) | {"new_tokens": 32})
        run.args, full = short, run.args
        run.busy("rollout of 32 new tokens", run._rollout_once)
        run.args = full

        def update():
            for t in run.trajs:
                t.policy_version = run.trainer.version
            run.trainer.update(run.trajs)

        run.busy(f"update ({run.result['update'][-1]['variant']})", update)
    print(markdown(run.result))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(gpu_step.SHAPES))
    parser.add_argument("--adapter", choices=["full", "lora"], default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each variant, after one warm-up")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--packs", type=int, nargs="*", default=[16384], help="shared-prefix pack sizes besides 2048")
    parser.add_argument("--micro-batches", type=int, nargs="*", default=[16, 32], help="per-sequence micro-batch sizes")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--profile", action="store_true", help="last: the device's busy share of a short rollout and an update")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_variants.py: no CUDA device here (a smoke run: --shape tiny --device cpu)")
    main(ARGS)
