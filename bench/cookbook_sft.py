"""tinker-cookbook's supervised loop against the gateway: held-out NLL on a local conversations file.

What it measures: whether tinker-cookbook 0.6.1's own SFT loop (`tinker_cookbook.supervised.train.
main`, unmodified), pointed at OpenTinker's gateway, lowers the held-out loss its own evaluator
reports. The data is a conversations JSONL file this script writes under a temporary folder (no
downloads), in the cookbook's format (`{"messages": [{"role": ..., "content": ...}, ...]}` a line,
as tinker_cookbook/example_data/conversations.jsonl): a seeded synthetic record-formatting task
("Format this record: city=paris; name=alice; age=34" -> "Name: Alice\\nAge: 34\\nCity: Paris\\n
Country: France\\nID: ALI34": fields in random order and lower case in; out a fixed order, one a line,
capitalised, the city's country from a fixed table of 28 cities, and an ID made of the name's first
three letters and the age) with a system message. `FromConversationFileBuilder` shuffles it and
holds out `--test-size` conversations; the cookbook then adds its `SamplerNLLEvaluator` (every `--eval-every` steps, before that step's update:
ephemeral `save_weights_for_sampler`, then `compute_logprobs`, i.e. `asample` with prompt_logprobs and
max_tokens=1, once per held-out conversation) and trains with `cross_entropy` + `optim_step` on
SmolLM2 (`HuggingFaceTB/SmolLM2-135M-Instruct`, which the gateway serves as smollm2-135m-instruct),
LoRA, the `qwen3_instruct` renderer (ChatML, SmolLM2's own template), the assistant turns as targets.

The learning rate defaults to the cookbook's LoRA recipe (`hyperparam_utils.get_lr`: 5e-5 x 10 for
LoRA x (2000 / hidden size) ** 0.781, its Llama-family exponent; SmolLM2 is a Llama-architecture
model with hidden size 576, which `get_lr` itself refuses by name), with the cookbook's linear decay
and Adam betas. The test NLL series comes from the run's metrics.jsonl (`test/nll` at steps 0,
eval_every, ...: the weights after that many updates), the train loss from `train_mean_nll`. After
the run the same evaluator scores the run's `final` sampler checkpoint (loaded by its tinker://
path) so the table ends with the weights after the last update. Exits 1 unless the run completed,
the last held-out NLL (the final checkpoint's) is below the first evaluation's and the cookbook's own
last evaluation is not above its first.

Offline: the tokenizer is the local SmolLM2 folder registered under the Hub id (the cookbook's
`register_tokenizer`); HF_HUB_OFFLINE=1, TINKER_TELEMETRY=0; the cookbook's pricing fetch fails and
is non-fatal. The gateway and its Tinker sessions run in this process
(opentinker.control.gateway.tinker_local). Install the cookbook with `make cookbook`.

    python bench/cookbook_sft.py [--steps 30] [--batch-size 16] [--eval-every 5] [--lr LR] [--rank 32] [--test-size 40] [--log-dir DIR]
writes bench/results/cookbook_sft.json and bench/results/cookbook_sft.md
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # an alias the gateway serves for smollm2-135m-instruct
LOCAL_MODEL = "smollm2-135m-instruct"
RENDERER = "qwen3_instruct"  # ChatML, SmolLM2's own template; stop token <|im_end|> = 2
SYSTEM = "You are a record formatter. Rewrite the record with one field per line: Name, Age, City, Country, ID."
NAMES = ["alice", "bob", "carla", "deepak", "elena", "farid", "grace", "hiro", "ines", "jonas", "kemal", "lucia",
         "mateo", "nadia", "oscar", "priya", "quinn", "rosa", "sven", "tamar", "umar", "vera", "wen", "ximena",
         "yusuf", "zoe", "anton", "bianca", "cyrus", "dalia", "emeka", "fiona", "gideon", "hana", "ivan", "jade"]
COUNTRIES = {"paris": "France", "lima": "Peru", "oslo": "Norway", "cairo": "Egypt", "delhi": "India", "tokyo": "Japan",
             "quito": "Ecuador", "rome": "Italy", "seoul": "South Korea", "dakar": "Senegal", "lagos": "Nigeria",
             "perth": "Australia", "boston": "USA", "madrid": "Spain", "hanoi": "Vietnam", "vienna": "Austria",
             "athens": "Greece", "dublin": "Ireland", "austin": "USA", "kyoto": "Japan", "nairobi": "Kenya",
             "lisbon": "Portugal", "denver": "USA", "bogota": "Colombia", "prague": "Czechia", "manila": "Philippines",
             "zurich": "Switzerland", "havana": "Cuba"}


def conversations(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` record-formatting conversations (system, user, assistant), seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, city, age = rng.choice(NAMES), rng.choice(sorted(COUNTRIES)), rng.randint(18, 90)
        fields = [f"name={name}", f"age={age}", f"city={city}"]
        rng.shuffle(fields)
        out.append({"messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Format this record: " + "; ".join(fields)},
            {"role": "assistant", "content": (f"Name: {name.capitalize()}\nAge: {age}\nCity: {city.capitalize()}\n"
                                               f"Country: {COUNTRIES[city]}\nID: {name[:3].upper()}{age}")},
        ]})
    return out


def cookbook_lora_lr(hidden_size: int) -> float:
    """`tinker_cookbook.hyperparam_utils.get_lr(model, is_lora=True)` for a Llama-family model of this
    hidden size (its formula; `get_lr` raises for model names outside its families)."""
    from tinker_cookbook.hyperparam_utils import get_lora_lr_over_full_finetune_lr

    return 5e-5 * get_lora_lr_over_full_finetune_lr(MODEL) * (2000 / hidden_size) ** 0.781


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


async def score_final(url: str, builder, sampler_path: str, tokenizer) -> dict[str, float]:
    """The cookbook's SamplerNLLEvaluator on the held-out split, against the run's final sampler
    checkpoint loaded by path."""
    import tinker
    from tinker_cookbook.supervised.nll_evaluator import SamplerNLLEvaluator

    _, test = builder()
    evaluator = SamplerNLLEvaluator.from_dataset(test, tokenizer=tokenizer)
    with tinker.ServiceClient(base_url=url) as service:
        sampler = await service.create_sampling_client_async(model_path=sampler_path)
        return await evaluator(sampler)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=None, help="default: the cookbook's LoRA learning rate for the model")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (the cookbook's default)")
    parser.add_argument("--test-size", type=int, default=40, help="held-out conversations")
    parser.add_argument("--conversations", type=int, default=None,
                        help="conversations in the file (default: enough for --steps batches in one epoch, plus the held-out ones)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="keep the cookbook's run folder here (default: a temporary folder)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cookbook_sft"))
    args = parser.parse_args()
    if args.eval_every <= 0 or args.steps <= 0 or args.test_size <= 0:
        parser.error("--steps, --eval-every and --test-size must be positive")
    n_conv = args.conversations or args.steps * args.batch_size + args.test_size
    if n_conv - args.test_size < args.batch_size:
        parser.error("--conversations must leave at least one batch after the held-out ones")

    os.environ.update(HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from opentinker.cli.common import quiet_libraries
    from opentinker.control.gateway.tinker_local import local_gateway
    from opentinker.model.loading import resolve_model

    try:
        from tinker_cookbook.supervised import train
        from tinker_cookbook.supervised.data import FromConversationFileBuilder
        from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
        from tinker_cookbook.tokenizer_utils import register_tokenizer
    except ImportError as e:
        raise SystemExit(f"tinker-cookbook 0.6.1 is not importable ({e}); install it with `make cookbook`")

    quiet_libraries()
    torch.set_num_threads(os.cpu_count() or 1)  # the Tinker sessions run in this process
    local = resolve_model(LOCAL_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(local)
    register_tokenizer(MODEL, lambda: tokenizer)
    lr = args.lr if args.lr is not None else cookbook_lora_lr(AutoConfig.from_pretrained(local).hidden_size)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_path = tmp / "conversations.jsonl"
        data_path.write_text("".join(json.dumps(c) + "\n" for c in conversations(n_conv, args.seed)))
        log_path = Path(args.log_dir) if args.log_dir else tmp / "run"
        if (log_path / "checkpoints.jsonl").exists():
            raise SystemExit(f"{log_path} holds a cookbook run already (it would resume); name an empty folder")
        builder = FromConversationFileBuilder(
            file_path=str(data_path), test_size=args.test_size, shuffle_seed=args.seed,
            common_config=ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name=RENDERER,
                                                         max_length=512, batch_size=args.batch_size))
        url, keys, sessions, server = local_gateway(tmp / "gateway")
        os.environ["TINKER_API_KEY"] = keys["alice"]  # supervised.train.main passes no api_key
        config = train.Config(
            log_path=str(log_path), model_name=MODEL, recipe_name="opentinker_bench_cookbook_sft",
            renderer_name=RENDERER, dataset_builder=builder, learning_rate=lr, lora_rank=args.rank,
            num_epochs=max(1, -(-args.steps * args.batch_size // (n_conv - args.test_size))),
            max_steps=args.steps, eval_every=args.eval_every, save_every=0, infrequent_eval_every=0,
            base_url=url)
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level  # the cookbook replaces the root handlers
        try:
            t0 = time.perf_counter()
            asyncio.run(train.main(config))
            wall = time.perf_counter() - t0
            for handler in [h for h in root.handlers if h not in handlers]:
                handler.close()
            root.handlers[:] = handlers
            root.setLevel(level)
            rows = read_jsonl(log_path / "metrics.jsonl")
            checkpoints = read_jsonl(log_path / "checkpoints.jsonl")
            final = [c for c in checkpoints if c.get("name") == "final" and c.get("sampler_path")]
            if not final:
                raise SystemExit(f"no final sampler checkpoint in {log_path / 'checkpoints.jsonl'}: {checkpoints}")
            t1 = time.perf_counter()
            final_metrics = asyncio.run(score_final(url, builder, final[-1]["sampler_path"], tokenizer))
            final_eval_s = time.perf_counter() - t1
            log_text = (log_path / "logs.log").read_text() if (log_path / "logs.log").exists() else ""
        finally:
            server.stop()
            sessions.close()

    train_rows = [r for r in rows if "train_mean_nll" in r]
    evals = [{"step": r["step"], "test_nll": r["test/nll"], "test_bpb": r.get("test/bpb")} for r in rows if "test/nll" in r]
    evals.append({"step": args.steps, "test_nll": final_metrics["test/nll"], "test_bpb": final_metrics.get("test/bpb"),
                  "final_checkpoint": True})
    first, last, cookbook_last = evals[0]["test_nll"], evals[-1]["test_nll"], evals[-2]
    ok = "Training completed successfully" in log_text and len(evals) >= 2 and last < first and cookbook_last["test_nll"] <= first
    eval_s = sum(r.get("time/evals", 0.0) for r in train_rows)
    command = " ".join(["python bench/cookbook_sft.py", shlex.join(sys.argv[1:])]).strip()

    print(f"\n{'step':>5} {'train loss':>11} {'held-out NLL':>13}")
    for r in train_rows:
        ev = next((e for e in evals if e["step"] == r["step"] and not e.get("final_checkpoint")), None)
        print(f"{r['step']:>5} {r['train_mean_nll']:>11.4f} {'' if ev is None else format(ev['test_nll'], '.4f'):>13}")
    print(f"{args.steps:>5} {'(final)':>11} {last:>13.4f}")
    print(f"held-out NLL {first:.4f} -> {last:.4f}; wall {wall:.0f} s; {'OK' if ok else 'FAILED'}")

    out = {
        "command": command,
        "model": MODEL,
        "model_folder": str(local),
        "renderer": RENDERER,
        "versions": {name: importlib.metadata.version(name) for name in ("tinker", "tinker-cookbook")},
        "settings": {"steps": args.steps, "batch_size": args.batch_size, "eval_every": args.eval_every,
                     "learning_rate": lr, "lr_schedule": config.lr_schedule, "adam": {"beta1": config.adam_beta1,
                     "beta2": config.adam_beta2, "eps": config.adam_eps}, "lora_rank": args.rank,
                     "num_epochs": config.num_epochs, "max_length": 512, "conversations": n_conv,
                     "test_size": args.test_size, "seed": args.seed, "train_on": "all assistant messages",
                     "loss_fn": "cross_entropy"},
        "example": conversations(1, args.seed)[0],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "wall_seconds": wall,
        "final_eval_seconds": final_eval_s,
        "seconds_per_step": wall / max(1, len(train_rows)),
        "evaluation_seconds": eval_s,
        "train": [{"step": r["step"], "train_mean_nll": r["train_mean_nll"], "learning_rate": r.get("learning_rate"),
                   "num_loss_tokens": r.get("num_loss_tokens")} for r in train_rows],
        "held_out": evals,
        "first_held_out_nll": first,
        "last_held_out_nll": last,
        "cookbook_last_evaluation": cookbook_last,
        "held_out_nll_fell": ok,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=2))

    lines = [
        f"# tinker-cookbook's SFT loop through the gateway: {MODEL}, LoRA r{args.rank} (CPU)",
        "",
        ("`tinker_cookbook.supervised.train.main` (0.6.1, unmodified) with `FromConversationFileBuilder` on a local "
         f"conversations file of {n_conv} seeded record-formatting chats ({args.test_size} held out), renderer "
         f"`{RENDERER}`, {args.steps} steps of {args.batch_size}, Adam lr {lr:.3g} (the cookbook's LoRA formula) with "
         f"linear decay; held-out NLL from the cookbook's `SamplerNLLEvaluator` every {args.eval_every} steps "
         "(`test/nll` in its metrics.jsonl), and once more on the run's `final` sampler checkpoint."),
        (f"Wall time {wall:.0f} s for the cookbook run ({out['seconds_per_step']:.1f} s a step; {eval_s:.0f} s of it in the "
         f"held-out evaluations), model load included; {os.cpu_count()} CPUs."),
        "",
        f"    {command}",
        "",
        "| step | train loss (mean NLL) | held-out NLL | held-out bits/byte |",
        "|---:|---:|---:|---:|",
    ]
    ev_at = {e["step"]: e for e in evals if not e.get("final_checkpoint")}
    for r in train_rows:
        ev = ev_at.get(r["step"])
        lines.append(f"| {r['step']} | {r['train_mean_nll']:.4f} | {'-' if ev is None else format(ev['test_nll'], '.4f')} "
                     f"| {'-' if ev is None or ev['test_bpb'] is None else format(ev['test_bpb'], '.4f')} |")
    fb = evals[-1]["test_bpb"]
    lines.append(f"| {args.steps} (final checkpoint) | - | {last:.4f} | {'-' if fb is None else format(fb, '.4f')} |")
    lines += ["", (f"Held-out NLL: first evaluation (step 0) **{first:.4f}**, last (final checkpoint) **{last:.4f}** "
                   f"({'fell' if last < first else 'did not fall'}; {last / first:.1%} of the first); the cookbook's own "
                   f"last evaluation (step {cookbook_last['step']}) {cookbook_last['test_nll']:.4f}."),
              "", "Example conversation:", "", "```json", json.dumps(out["example"]), "```", ""]
    Path(args.out + ".md").write_text("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
