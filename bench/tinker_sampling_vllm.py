"""Tinker sampling for several tenants' adapters of one base: our shared base against vLLM's multi-LoRA.

What a Tinker sampling client asks of a base-model worker: tenants' LoRA adapters (rank 16 on every
linear layer of SmolLM2-135M-Instruct, random, one per tenant) each sampling `--samples` completions
of `--new-tokens` tokens (temperature 1, end-of-turn ignored on both) from a prompt of its own, all
tenants at once, `--rounds` times after a warm-up round. Ways, one after the other in this run:

- `shared`: today's path, opentinker.inference.engine_multi_lora.MultiLoraEngine over a SharedBase
  (the Tinker door's samplers on a base-model worker), in this process, float32;
- `vllm-lora`: what `tinker_sampling_engine: vllm` gives Tinker samplers
  (opentinker.inference.engine_vllm_lora.VLLMAdapterEngine): a vLLM server with LoRA enabled
  (`--max-loras` = tenants), every adapter loaded at run time by name, each completion a request,
  all concurrent (vLLM batches rows of several adapters), float32;
- `vllm-lora-bf16`: the same in bfloat16.

Reported: generated tokens per second over the rounds, against `shared`.

    python bench/tinker_sampling_vllm.py [--tenants 4] [--samples 8] [--new-tokens 32] [--rounds 3]
writes bench/results/tinker_sampling_vllm.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODEL = "smollm2-135m-instruct"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(tmp: Path, n: int) -> list[Path]:
    """`n` random rank-16 peft adapters of the base, saved as folders."""
    import torch
    from peft import LoraConfig, get_peft_model

    from opentinker.model import load_model

    folders = []
    for i in range(n):
        base, _ = load_model(MODEL)
        model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)
        folders.append(tmp / f"tenant{i}")
        model.save_pretrained(folders[-1])
    return folders


def prompts(n: int) -> list[list[int]]:
    from opentinker.model import load_model

    _, tok = load_model(MODEL)
    return [tok.apply_chat_template([{"role": "user", "content": f"Tenant {i}: write a short story about the number {i * 7 + 3}."}],
                                    add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] for i in range(n)]


def timed_rounds(sample_all, rounds: int) -> dict:
    sample_all()  # warm-up
    t0, tokens = time.perf_counter(), 0
    for _ in range(rounds):
        tokens += sample_all()
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def shared_way(folders: list[Path], asks: list[list[int]], args) -> dict:
    from opentinker.backend import SamplingParams
    from opentinker.backend.shared_base import SharedBase
    from opentinker.inference.engine_multi_lora import MultiLoraEngine
    from opentinker.model import load_model

    base, tok = load_model(MODEL)
    engine = MultiLoraEngine(SharedBase(base, tok, MODEL), max_batch_size=max(64, args.tenants * args.samples))
    for i, folder in enumerate(folders):
        engine.load_adapter(f"tenant{i}", str(folder.resolve()))
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)

    def sample_all() -> int:
        futures = [engine.generate([ask] * args.samples, [args.new_tokens] * args.samples, params, seed=i, adapter=f"tenant{i}",
                                   stop_rule=lambda tokens: False) for i, ask in enumerate(asks)]
        return sum(len(c.token_ids) for f in futures for c in f.result())

    try:
        return timed_rounds(sample_all, args.rounds)
    finally:
        engine.close()


def vllm_way(folders: list[Path], asks: list[list[int]], args, dtype: str) -> dict:
    """The production path: opentinker.inference.engine_vllm_lora.VLLMAdapterEngine (what
    `tinker_sampling_engine: vllm` gives Tinker samplers), its server started here."""
    import torch

    from opentinker.backend import SamplingParams
    from opentinker.backend.device import Placement
    from opentinker.inference.engine_vllm_lora import VLLMAdapterEngine
    from opentinker.tinker.sampling import StopRule

    t0 = time.perf_counter()
    engine = VLLMAdapterEngine.start(MODEL, Placement(torch.device("cpu"), getattr(torch, dtype)), max_rank=16, max_loras=args.tenants)
    started = time.perf_counter() - t0
    try:
        for i, folder in enumerate(folders):
            engine.load_adapter(f"tenant{i}", str(folder.resolve()))
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)

        def sample_all() -> int:
            futures = [engine.generate([ask] * args.samples, [args.new_tokens] * args.samples, params, seed=i, adapter=f"tenant{i}",
                                       stop_rule=StopRule()) for i, ask in enumerate(asks)]
            return sum(len(c.token_ids) for f in futures for c in f.result())

        return timed_rounds(sample_all, args.rounds) | {"server_start_s": started}
    finally:
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tinker_sampling_vllm"))
    args = parser.parse_args()
    import torch

    from opentinker.cli.common import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        folders, asks = adapters(Path(tmp), args.tenants), prompts(args.tenants)
        ways = {"shared": shared_way(folders, asks, args), "vllm-lora": vllm_way(folders, asks, args, "float32"),
                "vllm-lora-bf16": vllm_way(folders, asks, args, "bfloat16")}
    for way, r in ways.items():
        r["vs_shared"] = r["tokens_per_s"] / ways["shared"]["tokens_per_s"]
        print(f"{way}: {r['tokens_per_s']:.0f} tokens/s ({r['vs_shared']:.2f}x shared)", flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    out = Path(args.out)
    command = shlex.join(["python", "bench/tinker_sampling_vllm.py", *sys.argv[1:]])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": machine, "args": vars(args), "ways": ways}, indent=1))
    rows = "\n".join(f"| {way} | {r['tokens_per_s']:.0f} | {r['vs_shared']:.2f}x | {r.get('server_start_s', 0):.0f} |" for way, r in ways.items())
    out.with_suffix(".md").write_text(
        f"# Tinker sampling, {args.tenants} tenants' adapters on one base: our shared base against vLLM's multi-LoRA ({machine}, one run)\n\n"
        f"Each tenant: {args.samples} completions of {args.new_tokens} tokens from its own prompt, all tenants at once, {args.rounds} rounds "
        f"after a warm-up; LoRA r16 on every linear layer of SmolLM2-135M-Instruct.\n\n"
        f"| way | tokens/s | against shared | server start (s) |\n|---|---:|---:|---:|\n{rows}\n")
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
