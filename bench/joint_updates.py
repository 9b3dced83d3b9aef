"""Hosted LoRA jobs' updates on one shared base: in turn, or in joint passes (both in one run).

N native LoRA jobs are adapters of one `SharedBase` (opentinker.backend.shared_base), each with
its own trainer and its own batch of trajectories (random prompts and completions of the given
lengths: an update's cost does not depend on what the tokens say). A round is one update of every
job:

- `in turn`: the jobs' updates one after another, each in its own per-sequence passes, on the
  worker's compute thread (opentinker.backend.compute_thread) as a base-model worker runs them;
- `joint`: the N updates at once, one thread each, their per-sequence micro-batches joined into
  passes by the base's runner (`joint_updates`, the worker's default on a GPU);
- `in turn, shared prefix`: as `in turn`, each group's prompt run once (`optimization.shared_prefix`,
  the default on a CPU; joint passes are per sequence).

Rounds alternate between the ways after one warm-up round of each, so that a drift of the
machine falls on all; ratios are tokens/s over the first way's, medians of the same run.

    python bench/joint_updates.py                                   # the GPU: Qwen2.5-0.5B shape, 4 jobs
    python bench/joint_updates.py --shape tiny --device cpu --jobs 2 --repeats 1   # a smoke run
    python bench/joint_updates.py --device cpu --shape smollm2-135m --prompt-len 64 --new-tokens 16

Writes <out>/joint_updates_<cpu|gpu>.{json,md} (bench/results by default).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gpu_step  # noqa: E402  (bench/gpu_step.py: the model shapes and the device's name)

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               vocab_size=49152, tie_word_embeddings=True)  # SmolLM2-135M's config.json (a Llama)


def base_model(shape: str, device: torch.device):
    """(random-weight causal LM of `shape`, a tokenizer stand-in)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls, fields = (LlamaConfig, LlamaForCausalLM, SMOLLM2) if shape == "smollm2-135m" else \
        (Qwen2Config, Qwen2ForCausalLM, gpu_step.SHAPES[shape])
    config = config_cls(**fields, max_position_embeddings=4096)
    with torch.device(device):
        torch.manual_seed(0)
        model = model_cls(config)
    return model, SimpleNamespace(pad_token_id=0, eos_token_id=config.vocab_size - 1)


def trajectories(args, vocab: int, seed: int) -> list:
    """A batch of `prompts` groups of `group` records: random prompt, random completion, 0/1 rewards."""
    from opentinker.core.trajectory import Trajectory

    rng = random.Random(seed)
    out = []
    for g in range(args.prompts):
        prompt = [rng.randrange(1, vocab - 1) for _ in range(args.prompt_len)]
        for _ in range(args.group):
            traj = Trajectory(prompt_ids=prompt, group_id=g, policy_version=0)
            traj.append_sampled([rng.randrange(1, vocab - 1) for _ in range(args.new_tokens)], [-2.0] * args.new_tokens, "")
            traj.turns[-1].reward = float(rng.random() < 0.5)
            out.append(traj)
    return out


class Jobs:
    """N adapters of one shared base, each with its trainer and its batch."""

    def __init__(self, args):
        from opentinker.backend import PolicyTrainer
        from opentinker.backend.device import Placement
        from opentinker.backend.shared_base import SharedBase
        from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec

        self.args, self.device = args, torch.device(args.device)
        model, tokens = base_model(args.shape, self.device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.shared = SharedBase(model, tokens, args.shape, placement=Placement(self.device, dtype))
        lora = LoraSpec(r=args.rank, alpha=2 * args.rank)
        optim = OptimizationSpec(lr=1e-5, micro_batch_size=args.micro_batch, shared_prefix=False)
        self.trainers, self.batches = [], []
        for i in range(args.jobs):
            key = f"job/bench/{i}"
            adapter = self.shared.add_job(key, lora.r, lora.alpha, lora.target_modules, lora.dropout, seed=i)
            trainer = PolicyTrainer(adapter, tokens, lora, AlgorithmSpec(), optim, 1.0, self.shared.placement)
            self.trainers.append((key, trainer))
            self.batches.append(trajectories(args, model.config.vocab_size, seed=i))
        self.tokens = sum(len(t) for batch in self.batches for t in batch)

    def _update(self, i: int) -> dict[str, float]:
        key, trainer = self.trainers[i]
        for t in self.batches[i]:
            t.policy_version = trainer.version
        with trainer.model.using():
            return trainer.update(self.batches[i])

    def round(self, way: str) -> tuple[float, float]:
        """(seconds of one update of every job, share of passes held by two jobs or more)."""
        from opentinker.backend import compute_thread

        joint = way == "joint"
        for key, trainer in self.trainers:
            trainer.joint = functools.partial(self.shared.joint_update, key) if joint else None
            trainer.optim_spec = trainer.optim_spec.model_copy(update={"shared_prefix": way == "in turn, shared prefix"})
        gpu_step.sync(self.device)
        t0 = time.perf_counter()
        if joint:
            metrics: list[dict] = [{}] * len(self.trainers)
            barrier = threading.Barrier(len(self.trainers))

            def run(i: int) -> None:
                barrier.wait()
                metrics[i] = self._update(i)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(self.trainers))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if any("update/joint_passes" not in m for m in metrics):
                raise RuntimeError("a joint update failed (see its thread's traceback above)")
            share = statistics.mean(m["update/joint_share"] for m in metrics)
        else:
            for i in range(len(self.trainers)):
                compute_thread.run_on(self.device, self._update, i)
            share = 0.0
        gpu_step.sync(self.device)
        return time.perf_counter() - t0, share


def main(args) -> dict:
    jobs = Jobs(args)
    name, _ = gpu_step.peak_flops(jobs.device)
    rows: dict[str, list[float]] = {"in turn": [], "joint": [], "in turn, shared prefix": []}
    shares = []
    for repeat in range(1 + args.repeats):
        for way in rows:
            seconds, share = jobs.round(way)
            print(f"round {repeat} {way}: {seconds:.2f} s" + (f", joint share {share:.2f}" if way == "joint" else ""), flush=True)
            if repeat:  # the first round of each way is a warm-up
                rows[way].append(seconds)
                if way == "joint":
                    shares.append(share)
    table = [{"way": way, "seconds": times, "median_s": statistics.median(times), "tokens_per_s": jobs.tokens / statistics.median(times)}
             for way, times in rows.items()]
    for row in table[1:]:
        row["ratio"] = row["tokens_per_s"] / table[0]["tokens_per_s"]
    table[1]["joint_share"] = statistics.mean(shares)
    result = {"command": " ".join(["python", "bench/joint_updates.py", *sys.argv[1:]]),
              "setup": {k: getattr(args, k) for k in ("shape", "jobs", "rank", "prompts", "group", "prompt_len", "new_tokens", "micro_batch", "repeats")}
              | {"device": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "precision": "bf16 autocast" if jobs.device.type == "cuda" else "float32", "tokens_per_round": jobs.tokens},
              "rows": table}
    out = Path(args.out) if args.out else ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"joint_updates_{'gpu' if jobs.device.type == 'cuda' else 'cpu'}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {stem}.json and .md")
    return result


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [f"# {s['jobs']} hosted LoRA jobs' updates on one base, in turn and joint: {s['device']}", "",
             f"{s['shape']} (random weights, {s['precision']}), LoRA rank {s['rank']} on every projection; each job "
             f"{s['prompts']} x {s['group']} records of {s['prompt_len']} + {s['new_tokens']} tokens, per-sequence micro-batches of "
             f"{s['micro_batch']}; median of {s['repeats']} rounds of each way, alternated, after a warm-up; torch {s['torch']}, "
             f"{s['threads']} threads. Command: `{result['command']}`.", "",
             "| way | seconds per round | update tok/s (all jobs) | ratio | passes shared |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        share = f"{r['joint_share']:.0%}" if "joint_share" in r else "-"
        lines.append(f"| {r['way']} | {r['median_s']:.2f} | {r['tokens_per_s']:,.0f} | {r.get('ratio', 1.0):.2f}x | {share} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(gpu_step.SHAPES) + ["smollm2-135m"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="results folder (default: bench/results)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench/joint_updates.py: no CUDA device here (on the CPU: --device cpu)")
    main(parsed)
