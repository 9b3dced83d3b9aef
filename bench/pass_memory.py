"""Peak memory of one Tinker forward_backward: the head's logits all at once against in chunks.

A training client's call on SmolLM2-135M (LoRA rank 32 on attention, MLP and unembedding: the
SDK's default), `--rows` datums of `--tokens` tokens with cross_entropy, run in a fresh process
per way, one after the other, in the same run:

    whole:   HEAD_CHUNK_POSITIONS = 0, the logits of every position of a pass at once (before);
    chunked: the default (opentinker/backend/primitives.py), a chunk's logits at a time,
             recomputed in the backward.

Per way: the process's peak resident memory (ru_maxrss) after the model is loaded and after the
call, their difference (what the call added), the call's seconds, and the loss (the same both ways).

    python bench/pass_memory.py                    # 16 x 1,024 tokens
    python bench/pass_memory.py --rows 2 --tokens 64 --model tiny-random --out /tmp/smoke
writes bench/results/pass_memory.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ONE = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import opentinker.backend.primitives as primitives
from opentinker.backend.primitives import LoraShape, PrimitiveModel
from opentinker.model import load_model
from opentinker.tinker.wire import TokenDatum
chunk, model, rows, tokens = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if chunk >= 0:
    primitives.HEAD_CHUNK_POSITIONS = chunk
base, tok = load_model(model)
pm = PrimitiveModel(base, tok, model, LoraShape(rank=32, seed=0))
gen = np.random.default_rng(0)
data = []
for _ in range(rows):
    ids = gen.integers(100, 30000, tokens + 1)
    data.append(TokenDatum(ids[:-1].tolist(), {"target_tokens": ids[1:].astype(np.int64), "weights": np.ones(tokens, np.float32)}))
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
_, metrics = pm.forward_backward(data, "cross_entropy", {})
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"head_chunk_positions": primitives.HEAD_CHUNK_POSITIONS, "loaded_mib": loaded, "peak_mib": peak,
                  "call_added_mib": peak - loaded, "seconds": seconds, "loss": metrics["loss:sum"]}))
"""


def one(chunk: int, args: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE, str(ROOT), str(chunk), args.model, str(args.rows), str(args.tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pass_memory"))
    args = parser.parse_args()
    whole, chunked = one(0, args), one(-1, args)
    ratio = chunked["call_added_mib"] / whole["call_added_mib"]
    result = {"command": shlex.join(["python", "bench/pass_memory.py", *sys.argv[1:]]), "model": args.model, "rows": args.rows, "tokens": args.tokens, "whole": whole, "chunked": chunked,
              "call_memory_ratio": ratio, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=2))
    rows = [f"| {name} ({r['head_chunk_positions'] or 'all'} positions) | {r['loaded_mib']:,.0f} | {r['peak_mib']:,.0f} | "
            f"{r['call_added_mib']:,.0f} | {r['seconds']:.1f} | {r['loss']:.2f} |" for name, r in (("whole", whole), ("chunked", chunked))]
    md = "\n".join([
        f"One `forward_backward` of {args.rows} x {args.tokens} tokens (cross_entropy) on {args.model}, LoRA r32 on every linear "
        f"layer, {os.cpu_count()} CPUs; peak RSS of a fresh process per way, same run.", "",
        "| head logits | RSS after load (MiB) | peak RSS (MiB) | the call added (MiB) | seconds | loss:sum |",
        "|---|---|---|---|---|---|", *rows, "",
        f"The call's memory, chunked against whole: **{ratio:.2f}x**.", ""])
    Path(f"{args.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
