"""Decoding on a GPU: the stream engine's decode step as CUDA graphs over fixed slots against eager
decoding, for the full model and a LoRA adapter, side by side in one run.

A random-weight model of a Qwen2.5 shape (bench/gpu_step.py's shapes; nothing is downloaded), float32
weights under bf16 autocast as a job holds them; 16 prompts x 8 samples of random token ids (a GRPO
group), 256 prompt tokens, 256 new tokens each (the end token is never drawn, so every row runs its
budget). Each configuration generates once to warm up (graph capture, allocator) and then `--repeats`
times; the median is reported:
- tokens/s: new tokens / wall seconds of the whole `generate` (prefill, decode, sampling);
- graph ms / step ms: the captured decode forward's GPU time per step (CUDA events around each
  replay) and the wall time of a decode step (`generate`'s seconds / its decode steps); their ratio
  is the device's busy fraction in the decode forward;
- LoRA: rank 32 on every linear layer of the decoder, a random nonzero adapter (graph path: merged
  into the decode copy; eager: peft's layers, as before).

    python bench/gpu_decode.py [--shapes qwen2.5-1.5b] [--repeats 2]
    python bench/gpu_decode.py --shapes tiny --device cpu --new-tokens 8 --prompt-len 8   # smoke (eager only)

Writes bench/results/gpu_decode.{json,md} with the device's name (GPU runs only).
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
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_step import SHAPES, peak_flops, sync  # noqa: E402


def model_of(shape: str, device: torch.device, lora: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, use_cache=True)
    config.eos_token_id = config.vocab_size - 1
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"))
        gen = torch.Generator(device="cpu").manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model, config


def measure(engine, config, device: torch.device) -> dict:
    from opentinker.backend import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0)
    runs = []
    slots = engine.stream.slots
    for repeat in range(ARGS.repeats + 1):
        prompts = [[rng.randrange(1, config.vocab_size - 1) for _ in range(ARGS.prompt_len)] for _ in range(ARGS.prompts)]
        expanded = [p for p in prompts for _ in range(ARGS.group)]
        if slots is not None and device.type == "cuda":
            slots.events = []
        forwards = engine.stream.decode_forwards
        sync(device)
        t0 = time.perf_counter()
        out = engine.generate(expanded, params, generators=[torch.Generator(device=device).manual_seed(i) for i in range(len(expanded))])
        sync(device)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in out)
        steps = engine.stream.decode_forwards - forwards - 1  # one forward is the prefill
        run = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "step_ms": 1e3 * seconds / max(1, steps)}
        if slots is not None and getattr(slots, "events", None):
            run["graph_ms"] = statistics.mean(a.elapsed_time(b) for a, b in slots.events)
        runs.append(run)
        print(f"  {'warm-up' if repeat == 0 else 'run'}: {tokens / seconds:,.0f} tok/s ({seconds:.2f} s, {run['step_ms']:.2f} ms/step"
              + (f", graph {run['graph_ms']:.2f} ms" if "graph_ms" in run else "") + ")", flush=True)
    timed = runs[1:]
    result = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed), "step_ms": statistics.median(r["step_ms"] for r in timed),
              "runs": runs}
    if all("graph_ms" in r for r in timed):
        result["graph_ms"] = statistics.median(r["graph_ms"] for r in timed)
        result["busy"] = result["graph_ms"] / result["step_ms"]
    if slots is not None:
        result |= {"captures": slots.captures, "replays": slots.replays, "capacity": slots.capacity}
    return result


def run_shape(shape: str, device: torch.device) -> list[dict]:
    from opentinker.backend import HFRolloutEngine
    from opentinker.backend.device import Placement

    where = Placement(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokens = SimpleNamespace(pad_token_id=0, eos_token_id=SHAPES[shape]["vocab_size"] - 1)
    rows = []
    for adapter in ARGS.adapters:
        model, config = model_of(shape, device, adapter == "lora")
        ways = [("eager", False), ("graphs", True)] if device.type == "cuda" else [("eager", False), ("slots", True)]
        ways = [(way, slots) for way, slots in ways if way in ARGS.ways or (way == "slots" and "graphs" in ARGS.ways)]
        for way, slots in ways:
            print(f"{shape} {adapter} {way}", flush=True)
            engine = HFRolloutEngine(model, tokens, max_batch_size=ARGS.prompts * ARGS.group, prefix_cache_tokens=0, placement=where,
                                     slots=slots)
            try:
                rows.append({"shape": shape, "adapter": adapter, "way": way} | measure(engine, config, device))
            except Exception as err:  # noqa: BLE001 - a way that fails is reported, the others still run
                print(f"  failed: {type(err).__name__}: {err}", flush=True)
                rows.append({"shape": shape, "adapter": adapter, "way": way, "error": f"{type(err).__name__}: {err}"})
            finally:
                engine.stream.close()
            del engine
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], setup: dict) -> str:
    lines = [f"# Decoding on {setup['device']}: CUDA graphs over fixed slots against eager decoding", "",
             f"Random-weight models from a config, float32 weights under bf16 autocast (the decode copy: linear weights bf16); "
             f"{setup['prompts']} prompts x {setup['group']} samples (batch {setup['prompts'] * setup['group']}), {setup['prompt_len']} prompt "
             f"tokens + {setup['new_tokens']} new tokens, sampled at temperature 1 from per-sequence generators; median of "
             f"{setup['repeats']} runs after a warm-up. LoRA: r 32 on every linear layer, random nonzero weights. "
             f"torch {setup['torch']}, transformers {setup['transformers']}.", "",
             "| shape | adapter | decoding | tokens/s | ms per step | graph ms per step | busy | vs eager |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    eager = {(r["shape"], r["adapter"]): r.get("tokens_per_s") for r in rows if r["way"] == "eager"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['adapter']} | {r['way']} | failed: {r['error'][:80]} | | | | |")
            continue
        base = eager.get((r["shape"], r["adapter"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base and r["way"] != "eager" else ""
        graph = f"{r['graph_ms']:.2f}" if "graph_ms" in r else "-"
        busy = f"{r['busy']:.0%}" if "busy" in r else "-"
        lines.append(f"| {r['shape']} | {r['adapter']} | {r['way']} | **{r['tokens_per_s']:,.0f}** | {r['step_ms']:.2f} | {graph} | {busy} | {ratio} |")
    full = {r["shape"]: r["tokens_per_s"] for r in rows if r["way"] != "eager" and r["adapter"] == "full" and "error" not in r}
    for r in rows:
        if r["way"] != "eager" and r["adapter"] == "lora" and "error" not in r and r["shape"] in full:
            lines.append(f"\nLoRA decoding {r['shape']}: {r['tokens_per_s'] / full[r['shape']]:.2f}x the full model's tokens/s at the same batch.")
    return "\n".join(lines) + "\n"


def main() -> None:
    import transformers

    device = torch.device(ARGS.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_decode.py: no CUDA device here (a smoke run: --shapes tiny --device cpu)")
    rows = [row for shape in ARGS.shapes for row in run_shape(shape, device)]
    setup = {k: getattr(ARGS, k) for k in ("prompts", "group", "prompt_len", "new_tokens", "repeats")}
    setup |= {"torch": torch.__version__, "transformers": transformers.__version__, "device": peak_flops(device)[0]}
    out = Path(ARGS.out) if ARGS.out else (ROOT / "bench" / "results" if device.type == "cuda" else Path(tempfile.mkdtemp()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_decode.json").write_text(json.dumps({"setup": setup, "results": rows}, indent=2))
    (out / "gpu_decode.md").write_text(markdown(rows, setup))
    print(markdown(rows, setup))
    print(f"wrote {out / 'gpu_decode'}.json and .md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--adapters", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--ways", nargs="+", default=["eager", "graphs"], choices=["eager", "graphs"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default=None, help="results folder (default: bench/results on a GPU, a temp folder on CPU)")
    return parser.parse_args(argv)


ARGS = parse_args([])

if __name__ == "__main__":
    ARGS = parse_args()
    main()
