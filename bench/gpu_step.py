"""RL steps on a GPU: rollout throughput, update throughput and the update's model-FLOPs utilisation.

A model of realistic size with random weights built from a config (the Qwen2.5-0.5B and -1.5B
shapes; nothing is downloaded), trained by the job's own parts: `HFRolloutEngine` samples the
group (transformers generation; vLLM is not used here, so this runs on a GPU node that has only
torch, transformers, peft, accelerate, numpy and pydantic), `PolicyTrainer` runs the GRPO update
in bf16 autocast with float32 weights and optimizer state. Prompts are random token ids; rewards
are random, so every group has advantages to train on.

Reported per shape (median over the timed steps; the first step is a warm-up):
- generated tokens/s: new tokens of the rollout / its seconds;
- update tokens/s: tokens the update runs forward and backward / its seconds;
- update MFU: the update's model FLOPs / (seconds x the device's dense bf16 peak). Model FLOPs
  per sequence of S tokens with R sampled: forward = 2·N·S (N: parameters of the decoder, not the
  embedding) + 2·V·d·R (the LM head runs only where a token is scored) + 2·L·d·S² (causal
  attention); the update is 3x the forward for full training (forward, gradients of activations
  and of weights), 2x for LoRA (the frozen weights get no gradient);
- peak GPU memory.

    python bench/gpu_step.py [--shapes qwen2.5-0.5b qwen2.5-1.5b] [--adapter full|lora] [--steps 4]
    python bench/gpu_step.py --shapes tiny --device cpu --steps 2   # a smoke run (results to a temp folder)

Writes bench/results/gpu_step_<adapter>.{json,md} with the device's name (GPU runs only).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2.5 shapes (config.json of the published models), random weights.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}
# Dense bf16 peak (no sparsity), FLOP/s, by a name the device reports.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12)]


def peak_flops(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, next((peak for key, peak in PEAK_BF16 if key in name), None)


def build(shape: str, device: torch.device, adapter: str):
    """(trainer, engine, config) for a random-weight model of `shape` on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opentinker.backend import HFRolloutEngine, PolicyTrainer
    from opentinker.backend.device import Placement
    from opentinker.core.spec import AlgorithmSpec, FullSpec, LoraSpec, OptimizationSpec

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, use_cache=True)
    config.eos_token_id = config.vocab_size - 1  # random weights seldom pick it: rollouts run their budget
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    tokens = SimpleNamespace(pad_token_id=0, eos_token_id=config.eos_token_id)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    where = Placement(device, dtype)
    spec = LoraSpec(r=16, alpha=32) if adapter == "lora" else FullSpec()
    trainer = PolicyTrainer(model, tokens, spec, AlgorithmSpec(), OptimizationSpec(lr=1e-6, micro_batch_size=ARGS.micro_batch, compile=ARGS.compile), 1.0, where)
    engine = HFRolloutEngine(trainer.model, tokens, max_batch_size=ARGS.prompts * ARGS.group, prefix_cache_tokens=0, placement=where)
    return trainer, engine, config


def update_flops(config, lengths: list[tuple[int, int]], adapter: str) -> float:
    """Model FLOPs of one update over sequences of (total tokens, sampled tokens)."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_dim = d // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * config.intermediate_size  # q, k, v, o, gate/up/down
    n_decoder = layers * per_layer
    forward = sum(2 * n_decoder * s + 2 * vocab * d * r + 2 * layers * d * s * s for s, r in lengths)
    return forward * (3 if adapter == "full" else 2)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_shape(shape: str, device: torch.device) -> dict:
    from opentinker.backend import SamplingParams
    from opentinker.core.trajectory import Trajectory

    trainer, engine, config = build(shape, device, ARGS.adapter)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    for step in range(ARGS.steps):
        prompts = [[rng.randrange(1, config.vocab_size - 1) for _ in range(ARGS.prompt_len)] for _ in range(ARGS.prompts)]
        expanded = [p for p in prompts for _ in range(ARGS.group)]
        sync(device)
        t0 = time.perf_counter()
        completions = engine.generate(expanded, params)
        sync(device)
        t1 = time.perf_counter()
        trajs = []
        for i, (prompt, c) in enumerate(zip(expanded, completions)):
            traj = Trajectory(prompt_ids=prompt, group_id=i // ARGS.group, policy_version=trainer.version)
            traj.append_sampled(c.token_ids, c.logprobs, "")
            traj.turns[-1].reward = float(rng.random() < 0.5)
            trajs.append(traj)
        metrics = trainer.update(trajs)
        sync(device)
        t2 = time.perf_counter()
        engine.policy_version = trainer.version
        generated = sum(len(c.token_ids) for c in completions)
        lengths = [(len(t.token_ids), t.num_sampled) for t in trajs]
        flops = update_flops(config, lengths, ARGS.adapter)
        steps.append({"rollout_s": t1 - t0, "update_s": t2 - t1, "generated_tokens": generated,
                      "update_tokens": sum(s for s, _ in lengths), "update_flops": flops, "loss": metrics.get("update/policy_loss")})
        print(f"{shape} step {step}: rollout {t1 - t0:.2f}s ({generated / (t1 - t0):.0f} tok/s), update {t2 - t1:.2f}s", flush=True)
    if ARGS.profile:
        profile(shape, engine, trainer, expanded, trajs, device)
    timed = steps[1:] or steps
    name, peak = peak_flops(device)
    update_s = statistics.median(s["update_s"] for s in timed)
    result = {
        "shape": shape, "adapter": ARGS.adapter, "device": name, "peak_bf16_flops": peak,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "generated_tokens_per_s": statistics.median(s["generated_tokens"] / s["rollout_s"] for s in timed),
        "update_tokens_per_s": statistics.median(s["update_tokens"] / s["update_s"] for s in timed),
        "update_mfu": statistics.median(s["update_flops"] / s["update_s"] for s in timed) / peak if peak else None,
        "update_s": update_s, "rollout_s": statistics.median(s["rollout_s"] for s in timed),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "steps": steps,
    }
    del trainer, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def profile(shape: str, engine, trainer, prompts, trajs, device: torch.device) -> None:
    """Where a rollout of 32 tokens and one update spend the device's time (the top kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from opentinker.backend import SamplingParams

    for t in trajs:  # the same records again, as if sampled by the trainer's current version
        t.policy_version = trainer.version
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    for label, run in (("rollout, 32 new tokens", lambda: engine.generate(prompts, SamplingParams(max_new_tokens=32))),
                       ("update", lambda: trainer.update(trajs))):
        with torch_profile(activities=activities) as prof:
            run()
            sync(device)
        print(f"--- {shape}: {label}", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60), flush=True)


def markdown(results: list[dict], setup: dict) -> str:
    lines = [f"# RL steps on {results[0]['device']} ({setup['adapter']}, {setup['precision']} compute, float32 trained weights and optimizer)", "",
             f"Random-weight models from a config; rollouts by transformers generation (HFRolloutEngine, no vLLM); "
             f"{setup['prompts']} prompts x {setup['group']} samples, {setup['prompt_len']} prompt tokens + {setup['new_tokens']} "
             f"new tokens, micro-batch {setup['micro_batch']}, records scored whole (optimization.shared_prefix auto: off on a GPU)"
             f"{', MLP and norms compiled (optimization.compile)' if setup.get('compile') else ''}; medians over steps 2..{setup['steps']} (step 1 is a warm-up). "
             f"torch {setup['torch']}, transformers {setup['transformers']}.", "",
             "| shape | parameters | generated tok/s | update tok/s | update MFU | peak memory |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        mfu = f"**{r['update_mfu']:.1%}**" if r["update_mfu"] is not None else "n/a (no bf16 peak known)"
        memory = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "-"
        lines.append(f"| {r['shape']} | {r['parameters'] / 1e9:.2f} B | {r['generated_tokens_per_s']:,.0f} | "
                     f"{r['update_tokens_per_s']:,.0f} | {mfu} | {memory} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import transformers

    device = torch.device(ARGS.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_step.py: no CUDA device here (a smoke run: --shapes tiny --device cpu)")
    results = [run_shape(shape, device) for shape in ARGS.shapes]
    setup = {k: getattr(ARGS, k) for k in ("adapter", "prompts", "group", "prompt_len", "new_tokens", "micro_batch", "steps", "compile")}
    setup |= {"torch": torch.__version__, "transformers": transformers.__version__,
              "precision": "bf16 autocast" if device.type == "cuda" else "float32"}
    out = Path(ARGS.out) if ARGS.out else (ROOT / "bench" / "results" if device.type == "cuda" else Path(tempfile.mkdtemp()))
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_step_{ARGS.adapter}"
    stem.with_suffix(".json").write_text(json.dumps({"setup": setup, "results": results}, indent=2))
    stem.with_suffix(".md").write_text(markdown(results, setup))
    print(markdown(results, setup))
    print(f"wrote {stem}.json and .md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--adapter", choices=["full", "lora"], default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="optimization.compile: the decoder layers' MLPs and norms compiled")
    parser.add_argument("--profile", action="store_true", help="print the top kernels of a rollout and an update per shape")
    parser.add_argument("--out", default=None, help="results folder (default: bench/results on a GPU, a temp folder on CPU)")
    return parser.parse_args(argv)


ARGS = parse_args([])  # replaced in __main__; the defaults let tests import the helpers

if __name__ == "__main__":
    ARGS = parse_args()
    main()
