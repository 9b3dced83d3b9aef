"""What a decode forward costs per row on this machine: why rows that run apart (streams) pay more
per token than rows decoded together (lock-step) on a CPU.

SmolLM2-135M-Instruct with a LoRA adapter (r 16, every linear layer, as the demo trains), float32,
`--width` cached positions per row, one new token per row, the median of five forwards at each
number of rows; also a prefill of 20 new tokens per row (an episode's next observation). Ratio:
the cost of a token at 1 row against at the largest batch.

    python bench/decode_rows.py [--rows 1,4,8,16,32] [--width 300]
writes bench/results/decode_rows.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_forwards(model, rows: int, width: int, repeats: int = 5) -> tuple[float, float]:
    """(median seconds of a one-token decode forward, seconds of a 20-token prefill) at `rows` rows."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        ids = torch.randint(0, 1000, (rows, width))
        cache = model(input_ids=ids, use_cache=True).past_key_values
        times = []
        for _ in range(repeats):
            fresh = DynamicCache(ddp_cache_data=[(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])
            t0 = time.perf_counter()
            model(input_ids=torch.randint(0, 1000, (rows, 1)), position_ids=torch.full((rows, 1), width),
                  attention_mask=torch.ones(rows, width + 1, dtype=torch.long), past_key_values=fresh, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        model(input_ids=ids[:, :20], use_cache=True)
        prefill = time.perf_counter() - t0
    return statistics.median(times), prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--width", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_rows"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opentinker.model.loading import resolve_model

    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m-instruct"), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)).eval()
    table = []
    for rows in [int(r) for r in args.rows.split(",")]:
        decode, prefill = timed_forwards(model, rows, args.width)
        table.append({"rows": rows, "decode_ms": decode * 1e3, "decode_ms_per_row": decode * 1e3 / rows,
                      "prefill_ms": prefill * 1e3, "prefill_ms_per_row": prefill * 1e3 / rows})
    ratio = table[0]["decode_ms_per_row"] / table[-1]["decode_ms_per_row"]
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    command = " ".join(["python", "bench/decode_rows.py", *sys.argv[1:]])
    Path(args.out + ".json").write_text(json.dumps({"command": command, "machine": machine, "width": args.width, "table": table,
                                                    "ratio_per_token_one_vs_most": ratio}, indent=2))
    md = [f"# A decode forward's cost per row ({machine})", "",
          f"SmolLM2-135M-Instruct + LoRA r16, float32, {args.width} cached positions a row; median of five forwards.", "",
          "| rows | decode forward (ms) | per row (ms) | 20-token prefill (ms) | per row (ms) |", "|---:|---:|---:|---:|---:|"]
    md += [f"| {r['rows']} | {r['decode_ms']:.1f} | {r['decode_ms_per_row']:.1f} | {r['prefill_ms']:.0f} | {r['prefill_ms_per_row']:.0f} |" for r in table]
    md += ["", f"- a token decoded alone costs **{ratio:.1f}x** one decoded among {table[-1]['rows']} rows", "", f"Made with `{command}`"]
    Path(args.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
