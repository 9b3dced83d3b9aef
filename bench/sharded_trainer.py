"""A full fine-tune of SmolLM2-135M-Instruct sharded over N = 1, 2, 4 ranks (FSDP2 over gloo, this CPU).

Why: a job wider than one device holds about 1/N of its model state (weights, gradients, AdamW's
two moments: 16 bytes a trained parameter) on each rank; this measures how close to 1/N it gets,
and what a step costs in communication, with the trainer the jobs use (opentinker.backend.sharded).

Per width: each rank's bytes of weights, gradients and optimizer state after a step (the shards it
holds, counted from its DTensors' local tensors), its peak resident memory (every rank loads the
whole model before FSDP shards it), the step's seconds (median of `--steps` after a warm-up) and the
share of rank 0's step spent in collectives (torch.profiler: c10d's and gloo's ops). On 2 cores, N
ranks share the same two cores: more ranks cannot be faster here, only smaller. The largest model
each width can fully fine-tune within a per-rank budget (`--budget-gib`) follows from the measured
bytes per parameter per rank (model state only: activations come on top and depend on the batch).

Batch: 8 groups of 4 records, prompts of 120 tokens and completions of 24-48 (the demo's shape),
micro-batches of 8, GRPO, float32.

    python bench/sharded_trainer.py [--widths 1,2,4] [--steps 2] [--budget-gib 16]
writes bench/results/sharded_trainer.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "smollm2-135m-instruct"


def batch(step: int):
    from opentinker.core.trajectory import Trajectory

    rng = random.Random(step)
    out = []
    for g in range(8):
        prompt = [rng.randrange(10, 40000) for _ in range(120)]
        for i in range(4):
            t = Trajectory(prompt_ids=list(prompt), group_id=g, policy_version=step)
            n = rng.randint(24, 48)
            t.append_sampled([rng.randrange(10, 40000) for _ in range(n)], [-rng.uniform(0.5, 3) for _ in range(n)], action="")
            t.turns[-1].reward = float((i + g) % 2)
            out.append(t)
    return out


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def rank_main(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from opentinker.backend.device import Placement
    from opentinker.backend.sharded import ShardedPolicyTrainer, init_ranks
    from opentinker.core.spec import AlgorithmSpec, FullSpec, OptimizationSpec
    from opentinker.model.policy import load_model

    torch.set_num_threads(max(1, 2 // world))
    init_ranks(rank, world, "127.0.0.1", port, "gloo", 600)
    model, tok = load_model(MODEL)
    trainer = ShardedPolicyTrainer(model, tok, FullSpec(), AlgorithmSpec(), OptimizationSpec(lr=1e-5, micro_batch_size=8, shared_prefix=False),
                                   placement=Placement(torch.device("cpu"), torch.float32))
    del model
    seconds, comm_share = [], None
    for step in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if step == steps and rank == 0:  # the last step under the profiler: how much of it is collectives
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.update(batch(step))
            wall = time.perf_counter() - t0
            events = prof.key_averages()
            comm = sum(e.cpu_time_total for e in events if any(k in e.key.lower() for k in ("c10d", "gloo", "all_gather", "reduce_scatter")))
            comm_share = comm / 1e6 / wall
        else:
            trainer.update(batch(step))
            if step:
                seconds.append(time.perf_counter() - t0)
    trainer.compute_gradients(batch(steps + 1))  # a step's gradients (the step frees them after AdamW's step): counted here
    params = list(trainer.model.parameters())
    state = {"weights": local_bytes(params), "gradients": local_bytes(p.grad for p in params if p.grad is not None),
             "optimizer": local_bytes(v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)}
    whole = sum(p.numel() for p in params)  # a DTensor's numel is the whole tensor's
    row = {"rank": rank, **state, "model_state": sum(state.values()), "parameters": whole,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "step_s": statistics.median(seconds) if seconds else None, "comm_share": comm_share}
    gathered = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sharded_trainer"))
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    rows = {}
    for n in widths:
        print(f"N = {n} ...", flush=True)
        tmp = f"/tmp/sharded_trainer_{n}.json"
        mp.spawn(rank_main, args=(n, free_port(), args.steps, tmp), nprocs=n)
        rows[n] = json.loads(Path(tmp).read_text())
    base = max(r["model_state"] for r in rows[widths[0]])
    budget = args.budget_gib * 2**30
    summary = []
    for n in widths:
        worst = max(r["model_state"] for r in rows[n])
        per_param = worst / rows[n][0]["parameters"]  # bytes a rank holds per parameter of the model
        summary.append({"ranks": n, "model_state_mib": worst / 2**20, "ratio": worst / base, "bytes_per_param_per_rank": per_param,
                        "largest_full_ft_params_b": budget / per_param / 1e9,
                        "peak_rss_mib": max(r["peak_rss_mib"] for r in rows[n]), "step_s": rows[n][0]["step_s"],
                        "comm_share": rows[n][0]["comm_share"]})
    from bench.cpu_precision import cpu_flags

    result = {"machine": {"cpu": cpu_flags(), "cores": os.cpu_count()},
              "model": MODEL, "budget_gib": args.budget_gib, "summary": summary, "ranks": rows,
              "command": f"python bench/sharded_trainer.py --widths {args.widths} --steps {args.steps} --budget-gib {args.budget_gib:g}"}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [f"# {MODEL} full fine-tune sharded over N ranks (FSDP2, gloo, {result['machine']['cores']} CPU cores)", "",
             "| ranks | model state a rank (MiB) | against N = 1 | bytes a parameter a rank | largest full fine-tune in "
             f"{args.budget_gib:g} GiB a rank | peak RSS a rank (MiB) | step s | collectives' share of rank 0's step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        lines.append(f"| {s['ranks']} | {s['model_state_mib']:.0f} | {s['ratio']:.3f}x | {s['bytes_per_param_per_rank']:.2f} | "
                     f"{s['largest_full_ft_params_b']:.2f} B parameters | {s['peak_rss_mib']:.0f} | {s['step_s']:.2f} | {s['comm_share']:.0%} |")
    lines += ["", "Model state: the weights, gradients and AdamW moments a rank holds (its DTensors' local shards; "
              "gradients counted after a step's backward). Goals: at most 0.55x at N = 2, 0.3x at N = 4. "
              "The ranks share this machine's cores, so a wider step is not faster here; on GPUs each rank has its own device. "
              "Largest model: the budget over the measured bytes a parameter a rank (model state only; activations come on top).", "",
              f"Made with `{result['command']}`"]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
