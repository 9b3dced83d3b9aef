"""The sharded trainer (FSDP2) on one device against the plain trainer: what the sharding machinery
costs where nothing is split (goal: at most 1.1x the plain update's time).

Why: a job over N devices pays FSDP2's gathers, reductions and hooks in every pass; at N = 1 the
communication is nothing, so the ratio is the overhead of the mechanism itself, which a wider job
pays on top of its communication. The model is the Qwen2.5-1.5B shape with random weights
(bench/gpu_step.py's), fully fine-tuned in bf16 autocast with float32 weights and AdamW; the batch
is random records (8 groups of 4, prompts of 256 tokens, completions of 128), the same for both.
One trainer after the other (two 1.5B full fine-tunes may not fit one device together), `--steps`
updates each after a warm-up; the median of each is reported.

    python bench/gpu_fsdp.py [--shape qwen2.5-1.5b] [--steps 3]
    python bench/gpu_fsdp.py --shape tiny --device cpu --steps 2 --out /tmp/gpu_fsdp   # a smoke run (gloo)
writes bench/results/gpu_fsdp.{json,md}
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_step import SHAPES, peak_flops, sync  # noqa: E402


def records(vocab: int, step: int, version: int, prompt_len: int, new: int):
    from opentinker.core.trajectory import Trajectory

    rng = random.Random(step)
    out = []
    for g in range(8):
        prompt = [rng.randrange(1, vocab - 1) for _ in range(prompt_len)]
        for i in range(4):
            t = Trajectory(prompt_ids=list(prompt), group_id=g, policy_version=version)
            t.append_sampled([rng.randrange(1, vocab - 1) for _ in range(new)], [-rng.uniform(0.5, 3) for _ in range(new)], "")
            t.turns[-1].reward = float((i + g) % 2)
            out.append(t)
    return out


def trainer(kind: str, shape: str, device: torch.device, micro_batch: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opentinker.backend import PolicyTrainer
    from opentinker.backend.device import Placement
    from opentinker.backend.sharded import ShardedPolicyTrainer
    from opentinker.core.spec import AlgorithmSpec, FullSpec, OptimizationSpec

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    where = Placement(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    cls = ShardedPolicyTrainer if kind == "fsdp2" else PolicyTrainer
    optim = OptimizationSpec(lr=1e-6, micro_batch_size=micro_batch, shared_prefix=False)
    return cls(model, SimpleNamespace(pad_token_id=0, eos_token_id=config.vocab_size - 1), FullSpec(), AlgorithmSpec(), optim, 1.0, where), config


def main() -> None:
    from opentinker.backend.sharded import init_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_fsdp"))
    args = ap.parse_args()
    device = torch.device(args.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_ranks(0, 1, "127.0.0.1", port, "nccl" if device.type == "cuda" else "gloo")
    seconds: dict[str, list[float]] = {"plain": [], "fsdp2": []}
    memory: dict[str, float | None] = {}
    for kind in ("plain", "fsdp2"):  # one model at a time: two 1.5B full fine-tunes may not fit together
        t, config = trainer(kind, args.shape, device, args.micro_batch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for step in range(args.steps + 1):
            batch = records(config.vocab_size, step, t.version, args.prompt_len, args.new_tokens)
            sync(device)
            t0 = time.perf_counter()
            t.update(batch)
            sync(device)
            if step:
                seconds[kind].append(time.perf_counter() - t0)
            print(f"{kind} step {step}: {time.perf_counter() - t0:.2f}s", flush=True)
        memory[kind] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        del t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    median = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = median["fsdp2"] / median["plain"]
    name, _ = peak_flops(device)
    result = {"device": name, "shape": args.shape, "torch": torch.__version__, "seconds": seconds, "median_s": median,
              "ratio": ratio, "peak_memory_gib": memory, "goal": 1.1, "command": f"python bench/gpu_fsdp.py --shape {args.shape} --steps {args.steps}"}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    lines = [f"# FSDP2 on one device against the plain trainer ({name}, {args.shape}, full fine-tune)", "",
             "| trainer | update s (median of %d) | peak memory GiB |" % args.steps, "|---|---:|---:|"]
    for kind in ("plain", "fsdp2"):
        mem = f"{memory[kind]:.1f}" if memory[kind] is not None else "-"
        lines.append(f"| {kind} | {median[kind]:.3f} | {mem} |")
    lines += ["", f"FSDP2 against plain: **{ratio:.2f}x** (goal: at most 1.1x). Each step: 32 records of "
              f"{args.prompt_len} + {args.new_tokens} tokens, micro-batches of {args.micro_batch}.", "",
              f"Made with `{result['command']}`"]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
