"""Peak memory of one Tinker forward_backward: the head's logits all at once against in chunks.

A training client's call on SmolLM2-135M (LoRA rank 32 on attention, MLP and unembedding: the
SDK's default), `--rows` datums of `--tokens` tokens with cross_entropy, run in a fresh process
per way, one after the other, in the same run:

    whole:   HEAD_CHUNK_POSITIONS = 0, the logits of every position of a pass at once (before);
    chunked: the default (opentinker/backend/primitives.py), a chunk's logits at a time,
             recomputed in the backward;
    shared:  the call on a shared base (a base-model worker's) whose memory bound leaves room for
             passes of --pass-tokens tokens by the rule of opentinker/backend/pass_memory.py.

Per way: the process's peak resident memory (ru_maxrss) after the model is loaded (and a first
16-token call made) and after the call, their difference (what the call added), what the rule predicts for the way's largest pass,
the call's seconds, and the loss (the same every way).

    python bench/pass_memory.py                    # 16 x 1,024 tokens (about 25 minutes on 2 cores)
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
from opentinker.backend.pass_memory import PASS_SHARE, PassMemory
from opentinker.backend.primitives import MICRO_BATCH_TOKENS, LoraShape, PrimitiveModel
from opentinker.backend.shared_base import SharedBase
from opentinker.model import load_model
from opentinker.tinker.wire import TokenDatum
chunk, model, rows, tokens, pass_tokens = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
if chunk >= 0:
    primitives.HEAD_CHUNK_POSITIONS = chunk
base, tok = load_model(model)
rule = PassMemory.of(base.config, 4, primitives.HEAD_CHUNK_POSITIONS)
if pass_tokens:  # a shared base whose bound leaves room for passes of pass_tokens tokens
    sb = SharedBase(base, tok, model, joint=False)
    pm = sb.attach("a", LoraShape(rank=32, seed=0))
    sb.memory_bytes = sb.base_bytes() + sb.held_bytes() + (rule.pass_bytes(pass_tokens) + 1) / PASS_SHARE
    largest = min(rows * tokens, max(tokens, (sb.pass_budget() // tokens) * tokens))
else:
    pm = PrimitiveModel(base, tok, model, LoraShape(rank=32, seed=0))
    largest = min(rows * tokens, max(tokens, (MICRO_BATCH_TOKENS // tokens) * tokens))
predicted = rule.pass_bytes(largest) / 2**20 if chunk != 0 else None  # the rule assumes chunked logits
gen = np.random.default_rng(0)
data = []
for _ in range(rows):
    ids = gen.integers(100, 30000, tokens + 1)
    data.append(TokenDatum(ids[:-1].tolist(), {"target_tokens": ids[1:].astype(np.int64), "weights": np.ones(tokens, np.float32)}))
warm = gen.integers(100, 30000, 17)  # a first short call: what any first call allocates (packed weights, thread pools) is not the pass's
pm.forward_backward([TokenDatum(warm[:-1].tolist(), {"target_tokens": warm[1:].astype(np.int64), "weights": np.ones(16, np.float32)})],
                    "cross_entropy", {})
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
_, metrics = pm.forward_backward(data, "cross_entropy", {})
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"head_chunk_positions": primitives.HEAD_CHUNK_POSITIONS, "loaded_mib": loaded, "peak_mib": peak,
                  "call_added_mib": peak - loaded, "largest_pass_tokens": largest, "rule_mib": predicted,
                  "seconds": seconds, "loss": metrics["loss:sum"]}), flush=True)
import os; os._exit(0)  # a shared base's runner thread would abort the interpreter's exit
"""


def one(chunk: int, args: argparse.Namespace, pass_tokens: int = 0) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE, str(ROOT), str(chunk), args.model, str(args.rows), str(args.tokens), str(pass_tokens)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--pass-tokens", type=int, default=1024, help="the shared way's room for passes, by the rule")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pass_memory"))
    args = parser.parse_args()
    ways = {"whole": one(0, args), "chunked": one(-1, args), "shared": one(-1, args, args.pass_tokens)}
    whole, chunked = ways["whole"], ways["chunked"]
    ratio = chunked["call_added_mib"] / whole["call_added_mib"]
    result = {"command": shlex.join(["python", "bench/pass_memory.py", *sys.argv[1:]]), "model": args.model, "rows": args.rows, "tokens": args.tokens,
              **ways, "call_memory_ratio": ratio, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=2))
    rule = lambda r: "n/a" if r["rule_mib"] is None else f"{r['rule_mib']:,.0f}"  # noqa: E731
    rows = [f"| {name} ({r['head_chunk_positions'] or 'all'} positions) | {r['largest_pass_tokens']:,} | {r['loaded_mib']:,.0f} | "
            f"{r['peak_mib']:,.0f} | {r['call_added_mib']:,.0f} | {rule(r)} | {r['seconds']:.1f} | {r['loss']:.2f} |" for name, r in ways.items()]
    md = "\n".join([
        f"One `forward_backward` of {args.rows} x {args.tokens} tokens (cross_entropy) on {args.model}, LoRA r32 on every linear "
        f"layer, {os.cpu_count()} CPUs; peak RSS of a fresh process per way, same run.", "",
        "| way (head logits) | largest pass (tokens) | RSS after load (MiB) | peak RSS (MiB) | the call added (MiB) | "
        "the rule's pass (MiB) | seconds | loss:sum |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"The call's memory, chunked against whole: **{ratio:.2f}x**. The shared way's bound leaves room for passes of "
        f"{args.pass_tokens:,} tokens by the rule (opentinker/backend/pass_memory.py): measured against predicted "
        f"**{ways['shared']['call_added_mib'] / ways['shared']['rule_mib']:.2f}x** (at most 1 means the rule holds).", "",
        f"Made with `{result['command']}`", ""])
    Path(f"{args.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
